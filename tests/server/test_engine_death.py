"""``portattn serve`` under tensor parallelism exits with status 1 and one clear log line when its
engine dies (here rank 1 exits in its second forward), instead of answering 503 forever: a
supervisor restarts it. The model class comes from ``--register``, which reaches rank 1 too."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import portattn
from distributed.faulty import faulty_checkpoint

from .conftest import request

TESTS = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_exits_when_a_rank_dies(tmp_path):
    path = faulty_checkpoint(str(tmp_path), tmp_path, "exit")
    port = free_port()
    argv = [sys.executable, "-m", "portattn.cli", "serve", "--register", "distributed.faulty:register"]
    argv += ["--model", path, "--tensor-parallel-size", "2", "--device", "cpu", "--num-pages", "32"]
    argv += ["--max-model-len", "256", "--port", str(port)]
    src = str(Path(portattn.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(TESTS), os.environ.get("PYTHONPATH", "")]))
    server = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while server.poll() is None and time.monotonic() < deadline:
            try:
                if request(f"{url}/health", timeout=2)[0] == 200:
                    break
            except OSError:  # not listening yet
                time.sleep(0.2)
        assert server.poll() is None, server.stderr.read()[-3000:]
        body = {"model": path, "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}
        status, reply, _ = request(f"{url}/v1/completions", "POST", body)
        assert status == 500 and "rank 1 exited with code 3" in reply["error"]["message"]
        assert server.wait(timeout=30) == 1
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    log = server.stderr.read()
    line = next(line for line in log.splitlines() if "the engine died" in line)
    assert line.startswith("portattn: the engine died (WorkerError: tensor-parallel rank 1 exited with code 3")
    assert line.endswith("the server exits")
