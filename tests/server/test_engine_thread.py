"""When the engine thread ends on an error (a failed step, a failure while adding a request), every
request it had not answered, added or still in its inbox, gets the error instead of waiting forever,
and the error is recorded (``portattn serve`` then exits for its supervisor to restart it)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from .conftest import StepGate, request, running_server, tiny_checkpoint, wait_until

BODY = {"prompt": "Rivers run", "max_tokens": 50, "ignore_eos": True}


def send(url: str, results: list, timeout: float = 20) -> threading.Thread:
    """A completion request on a thread; its ``(status, payload, headers)`` lands in ``results``."""
    thread = threading.Thread(
        target=lambda: results.append(request(url + "/v1/completions", "POST", BODY, timeout=timeout)), daemon=True
    )
    thread.start()
    return thread


def test_requests_in_the_inbox_get_the_error_when_the_engine_dies(model_root):
    with running_server(tiny_checkpoint(model_root), max_num_seqs=1) as (url, app):
        async_engine = app.state.server.engine
        results: list = []
        with StepGate(async_engine.engine) as gate:
            running = send(url, results)
            assert gate.entered.wait(timeout=20)
            waiting = send(url, results)  # the engine thread is in its step: this one stays in the inbox
            assert wait_until(lambda: len(app.state.server.streams) == 2)

            def broken_step():
                raise RuntimeError("the device fell over")

            gate.step = broken_step
            gate.allow(1)
            running.join(timeout=30)
            waiting.join(timeout=30)
        assert not running.is_alive() and not waiting.is_alive(), "a request hangs after the engine died"
        assert [r[0] for r in results] == [500, 500]
        assert all("the device fell over" in r[1]["error"]["message"] for r in results)
        assert isinstance(async_engine.error, RuntimeError) and not async_engine.alive
        assert request(url + "/health")[0] == 503


def test_an_unexpected_error_while_adding_a_request_ends_the_engine_visibly(model_root, monkeypatch):
    """Not a silent death (no error recorded, the request never answered): the request gets the
    error, ``error`` is set (``portattn serve`` then exits for its supervisor), /health says 503."""
    with running_server(tiny_checkpoint(model_root)) as (url, app):
        async_engine = app.state.server.engine

        def broken_add(*args, **kwargs):
            raise RuntimeError("the scheduler is broken")

        monkeypatch.setattr(async_engine.engine, "add_request", broken_add)
        status, payload, _ = request(url + "/v1/completions", "POST", BODY, timeout=20)
        assert status == 500 and "the scheduler is broken" in payload["error"]["message"], payload
        assert wait_until(lambda: not async_engine.alive)
        assert isinstance(async_engine.error, RuntimeError)
        assert request(url + "/health")[0] == 503


def test_stopping_the_server_shuts_the_engine_down(model_root, monkeypatch):
    """The app's shutdown stops the engine too (under tensor parallelism, its other ranks), once
    the engine thread has stopped: not only at interpreter exit."""
    calls = []
    with running_server(tiny_checkpoint(model_root)) as (url, app):
        engine = app.state.server.engine.engine
        monkeypatch.setattr(engine, "shutdown", lambda: calls.append(app.state.server.engine.alive))
        assert request(url + "/v1/completions", "POST", {**BODY, "max_tokens": 2})[0] == 200
        assert calls == []
    assert calls == [False]  # once, after the engine thread ended


def test_the_engine_thread_takes_the_gil_within_the_switch_interval(llm):
    """Starting the engine thread shortens the GIL's switch interval to SWITCH_INTERVAL_S (a thread asking
    for the GIL waits up to that long); a shorter one already set is kept."""
    import sys

    from portattn.server.async_engine import SWITCH_INTERVAL_S, AsyncEngine

    before = sys.getswitchinterval()
    try:
        for start, want in ((0.005, SWITCH_INTERVAL_S), (SWITCH_INTERVAL_S / 5, SWITCH_INTERVAL_S / 5)):
            sys.setswitchinterval(start)
            async_engine = AsyncEngine(llm.engine)
            async_engine.start()
            try:
                assert sys.getswitchinterval() == pytest.approx(want)
            finally:
                async_engine.shutdown()
            assert not async_engine.alive
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_the_step_trace_says_where_the_engine_loop_went(model_root, tmp_path, monkeypatch, engine_process):
    """``PORTATTN_STEP_TRACE``: at shutdown the engine's loop (its own process's too) is written out, a row a step
    with its parts' times, the requests added before it and the prompt tokens it computed, and a row an idle wait."""
    import json

    from portattn.server.async_engine import STEP_TRACE_ENV

    path = tmp_path / "trace.json"
    monkeypatch.setenv(STEP_TRACE_ENV, str(path))
    with running_server(tiny_checkpoint(model_root), engine_process=engine_process) as (url, _):
        for _ in range(2):
            status, reply, _ = request(url + "/v1/completions", "POST", {**BODY, "max_tokens": 5})
            assert status == 200, reply
    prompt_len = reply["usage"]["prompt_tokens"]
    rows = json.loads(path.read_text())["steps"]
    steps = [row for row in rows if "step_ms" in row]
    assert sum(row["added"] for row in rows) == 2 and len(steps) >= 10  # 5 tokens each, one request at a time
    assert all(row["step_ms"] > 0 and row["drain_ms"] >= 0 and row["emit_ms"] >= 0 for row in steps)
    assert all(row["running"] + row["waiting"] <= 1 for row in steps)
    # the prompt tokens each step computed: the first prompt's whole, the second's less what the prefix cache held
    assert steps[0]["prompt_tokens"] == prompt_len and all(row["prompt_tokens"] >= 0 for row in steps)
    assert prompt_len < sum(row["prompt_tokens"] for row in steps) <= 2 * prompt_len
    assert any("idle_ms" in row for row in rows)
    assert [row["t"] for row in rows] == sorted(row["t"] for row in rows)
