"""``portattn serve`` as a process: SIGTERM/SIGINT drain the streams in flight for at most
``--shutdown-timeout`` seconds, then end each with an error event and ``[DONE]``; a second signal
ends them at once; exit status 0 without a traceback. A taken port fails before the model loads.
Periodic statistics at INFO."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from .conftest import ENGINE, StepGate, request, running_server, tiny_checkpoint, wait_until

SRC = str(Path(__file__).resolve().parents[2] / "src")
# A pool for one request of the whole context: a stream of 3000 tokens runs for seconds.
SMALL = ["--page-size", "16", "--num-pages", "300", "--max-num-seqs", "4", "--max-model-len", "4096"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, *flags: str, group: bool = False) -> tuple[subprocess.Popen, int]:
    """A started ``portattn serve MODEL`` (answering /health) and its port; ``group``: in a process group of
    its own (as a terminal's foreground job, which Ctrl-C signals as a whole)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "portattn.cli", "serve", model, "--port", str(port), *SMALL, *flags]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, start_new_session=group
    )
    up = wait_until(lambda: proc.poll() is not None or _healthy(port), timeout=120)
    if not up or proc.poll() is not None:
        proc.kill()
        pytest.fail(f"the server did not start:\n{proc.communicate()[0]}")
    return proc, port


def _healthy(port: int) -> bool:
    try:
        return request(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200
    except OSError:
        return False


def open_stream(port: int, max_tokens: int = 3000) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": "Rivers run", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def events(resp) -> list:
    """The stream's events up to ``[DONE]`` (included)."""
    out = []
    while True:
        line = resp.readline()
        assert line, f"the stream ended without [DONE] after {out[-2:]}"
        if line.startswith(b"data: "):
            data = line[len(b"data: ") :].strip()
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
            if out[-1] == "[DONE]":
                return out


def next_event(resp) -> dict:
    while True:
        line = resp.readline()
        assert line
        if line.startswith(b"data: "):
            return json.loads(line[len(b"data: ") :])


def finish(proc: subprocess.Popen) -> str:
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "Error" not in out.replace("error event", ""), out
    return out


def test_first_signal_drains_second_ends_at_once(model_root):
    proc, port = serve(tiny_checkpoint(model_root), "--shutdown-timeout", "600")
    try:
        conn, resp = open_stream(port)
        next_event(resp)
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: not _accepts(port), timeout=30)  # no new connections
        texts = [next_event(resp)["choices"][0]["text"] for _ in range(5)]  # the stream goes on
        assert len(texts) == 5
        proc.send_signal(signal.SIGTERM)
        tail = events(resp)
        assert tail[-1] == "[DONE]" and tail[-2]["error"]["code"] == "server_shutdown", tail[-3:]
        assert all("choices" in e for e in tail[:-2])
        conn.close()
        out = finish(proc)
    finally:
        proc.kill()
    assert "SIGTERM: shutting down; 1 requests in flight" in out and "SIGTERM again" in out
    assert "CPU: intra-op threads: " in out  # chosen at start-up, logged


@pytest.mark.parametrize(
    "flags", [("--engine-process",), ("--tensor-parallel-size", "2")], ids=["engine_process", "tp2"]
)
def test_ctrl_c_drains_with_the_engine_in_other_processes(model_root, flags):
    """Ctrl-C signals the terminal's whole foreground group, the engine's process and tensor-parallel ranks
    too: they keep stepping while the server drains (the server stops them), and the second Ctrl-C ends the
    streams."""
    proc, port = serve(tiny_checkpoint(model_root), "--shutdown-timeout", "600", *flags, group=True)
    try:
        conn, resp = open_stream(port)
        next_event(resp)
        os.killpg(proc.pid, signal.SIGINT)
        assert wait_until(lambda: not _accepts(port), timeout=30)
        texts = [next_event(resp)["choices"][0]["text"] for _ in range(5)]  # the engine still steps
        assert len(texts) == 5
        os.killpg(proc.pid, signal.SIGINT)
        tail = events(resp)
        assert tail[-1] == "[DONE]" and tail[-2]["error"]["code"] == "server_shutdown", tail[-3:]
        conn.close()
        out = finish(proc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert "SIGINT: shutting down; 1 requests in flight" in out and "SIGINT again" in out


@contextlib.contextmanager
def serving_in_process(model: str, shutdown_timeout: float):
    """``(port, app, thread)`` of ``lifecycle.serve`` on a thread (the signals stay the test's)."""
    from portattn.server import create_app
    from portattn.server.lifecycle import bind_socket
    from portattn.server.lifecycle import serve as serve_app

    app = create_app(model, **ENGINE)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    run = functools.partial(serve_app, app, sock, shutdown_timeout=shutdown_timeout, handle_signals=False)
    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: _healthy(port), timeout=60)
        yield port, app, thread
    finally:
        if thread.is_alive():
            signal_server(app, signal.SIGINT)
            signal_server(app, signal.SIGINT)
        thread.join(timeout=30)


def signal_server(app, sig) -> None:
    """What the signal ``sig`` does to ``portattn serve``, to a server on a thread."""
    shutdown = app.state.shutdown
    shutdown.loop.call_soon_threadsafe(shutdown.on_signal, sig)


def test_streams_are_ended_after_the_shutdown_timeout(model_root):
    with serving_in_process(tiny_checkpoint(model_root), 0.3) as (port, app, thread):
        with StepGate(app.state.server.engine.engine) as gate:  # the stream cannot finish by itself
            gate.allow(1)
            conn, resp = open_stream(port, max_tokens=400)
            next_event(resp)
            signal_server(app, signal.SIGTERM)
            tail = events(resp)
        assert tail[-1] == "[DONE]" and tail[-2]["error"]["code"] == "server_shutdown"
        assert "timed out" in tail[-2]["error"]["message"]
        conn.close()
        thread.join(timeout=30)
        assert not thread.is_alive() and not app.state.server.engine.alive


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def test_a_taken_port_fails_before_the_model_loads(tmp_path, capsys):
    from portattn.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        missing = str(tmp_path / "no-such-checkpoint")  # loading it would fail with another message
        assert main(["serve", missing, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"expected a free --port, got {port}: 127.0.0.1:{port} is in use" in err and "Traceback" not in err


def test_statistics_are_logged_periodically(model_root, caplog):
    with (
        caplog.at_level(logging.INFO, logger="portattn"),
        running_server(tiny_checkpoint(model_root), log_stats_interval=0.05) as (url, _),
    ):
        body = {"prompt": "hi", "max_tokens": 40, "ignore_eos": True}
        assert request(url + "/v1/completions", "POST", body)[0] == 200
        assert wait_until(lambda: any("stats:" in r.getMessage() for r in caplog.records))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stats:")]
    assert all("tok/s" in line and "running" in line and "KV cache" in line for line in lines)
    generated = [float(line.split("generation ")[1].split()[0]) for line in lines]
    assert max(generated) > 0
