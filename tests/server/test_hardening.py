"""Hostile requests: preprocessing errors are the client's (400, never 500), request templates only
when trusted, preprocessing off the event loop, a body-size limit, the API key checked before
anything else, aborted requests counted, start-up limits refused."""

from __future__ import annotations

import http.client
import json
import logging
import threading
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from portattn.testing.chat import CHAT_TEMPLATE

from .conftest import StepGate, request, running_server, tiny_checkpoint, wait_until

# The checkpoint's template of a "strict" model: roles must alternate (as Mistral's template demands,
# through raise_exception), and a `think` variable that requests may set (chat_template_kwargs).
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}"
    "{% endfor %}" + CHAT_TEMPLATE + "{% if think %}<|system|>{% endif %}"
)
USER = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def strict_checkpoint(model_root) -> str:
    from transformers import AutoTokenizer

    path = tiny_checkpoint(model_root)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = STRICT_TEMPLATE
    strict = f"{model_root}/strict"
    import shutil

    shutil.copytree(path, strict, dirs_exist_ok=True)
    tok.save_pretrained(strict)
    return strict


@pytest.fixture(scope="module")
def trusting(strict_checkpoint):
    """A server of the strict checkpoint that accepts request templates."""
    with running_server(strict_checkpoint, served_model_name="strict", trust_request_chat_template=True) as url_app:
        yield url_app


def chat(url: str, **body):
    return request(url + "/v1/chat/completions", "POST", {"max_tokens": 2, **body})


def test_preprocessing_errors_are_400s_without_a_traceback(trusting, caplog):
    url, _ = trusting

    def template(text: str) -> dict:
        return {"messages": USER, "chat_template": text}

    cases = [
        ("lone surrogate in a prompt", "/v1/completions", {"prompt": "\ud800"}, "lone surrogate"),
        ("lone surrogate in a message", None, {"messages": [{"role": "user", "content": "a\udc00"}]}, "surrogate"),
        ("the checkpoint template's raise_exception", None, {"messages": USER * 2}, "roles must alternate"),
        ("request template: raise_exception", None, template("{{ raise_exception('no') }}"), "no"),
        ("request template: undefined", None, template("{{ nothing.here }}"), "UndefinedError"),
        ("request template: unsafe", None, template("{% set x = [] %}{{ x.append(1) }}"), "SecurityError"),
        ("request template: syntax", None, template("{% for m in messages %}"), "TemplateSyntaxError"),
        ("reserved template kwarg", None, {"messages": USER, "chat_template_kwargs": {"tokenize": True}}, "tokenize"),
    ]
    with caplog.at_level(logging.ERROR, logger="portattn"):
        for name, path, body, words in cases:
            status, payload, _ = request(url + (path or "/v1/chat/completions"), "POST", {"max_tokens": 2, **body})
            assert status == 400, (name, payload)
            error = payload["error"]
            assert error["type"] == "invalid_request_error" and words in error["message"], (name, error)
            assert error["param"] in ("prompt", "messages", "chat_template_kwargs"), (name, error)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no "request failed" traceback
    assert chat(url, messages=USER)[0] == 200


def test_request_templates_only_with_the_flag(trusting, served):
    body = {"messages": USER, "chat_template": "{{ messages[0]['content'] }}!"}
    status, payload, _ = chat(served[0], **body)
    assert status == 400 and payload["error"]["code"] == "chat_template_not_allowed"
    assert "--trust-request-chat-template" in payload["error"]["message"]
    status, payload, _ = request(served[0] + "/tokenize", "POST", {"messages": USER, "chat_template": "x"})
    assert status == 400 and payload["error"]["code"] == "chat_template_not_allowed"
    tok = trusting[1].state.server.preprocessor.processor.tokenizer
    status, payload, _ = request(trusting[0] + "/tokenize", "POST", body)
    assert status == 200 and payload["tokens"] == tok("Hello there!", add_special_tokens=False)["input_ids"]
    status, payload, _ = chat(trusting[0], **body)
    assert status == 200 and payload["usage"]["prompt_tokens"] == len(tok("Hello there!")["input_ids"]) - 1


def test_template_kwargs_reach_the_template(trusting):
    url, app = trusting
    tok = app.state.server.preprocessor.processor.tokenizer
    counts = {}
    for think in (False, True):
        body = {"messages": USER, "chat_template_kwargs": {"think": think}}
        status, payload, _ = request(url + "/tokenize", "POST", body)
        want = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, think=think)
        assert status == 200 and payload["tokens"] == tok(want, add_special_tokens=False)["input_ids"]
        assert want.endswith("<|system|>") == think
        status, reply, _ = chat(url, **body)
        assert status == 200 and reply["usage"]["prompt_tokens"] == payload["count"]
        counts[think] = payload["count"]
    assert counts[True] == counts[False] + 1


def test_health_answers_while_a_prompt_is_tokenized(served):
    url, app = served
    processor = app.state.server.preprocessor.processor
    tokenize = processor.tokenize
    entered, release = threading.Event(), threading.Event()

    def held_tokenize(text, **kwargs):  # a huge prompt, as long as the test wants
        entered.set()
        release.wait(timeout=30)
        return tokenize(text, **kwargs)

    processor.tokenize = held_tokenize
    result = {}
    sender = threading.Thread(
        target=lambda: result.update(out=request(url + "/v1/completions", "POST", {"prompt": "hi", "max_tokens": 2}))
    )
    try:
        sender.start()
        assert entered.wait(timeout=30)
        assert request(url + "/health", timeout=5)[0] == 200  # the event loop is free
        status, payload, _ = request(url + "/v1/models", timeout=5)
        assert status == 200 and payload["data"][0]["id"] == app.state.server.model_name
    finally:
        release.set()
        sender.join(timeout=30)
        processor.tokenize = tokenize
    assert result["out"][0] == 200 and result["out"][1]["usage"]["completion_tokens"] == 2


def test_bodies_over_the_limit_are_refused_early(model_root):
    with running_server(tiny_checkpoint(model_root), max_request_bytes=2000) as (url, _):
        host = urlparse(url)
        # Content-Length over the limit: answered before the body is sent.
        conn = http.client.HTTPConnection(host.hostname, host.port, timeout=10)
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(10**9))
        conn.endheaders()
        resp = conn.getresponse()
        error = json.loads(resp.read())["error"]
        assert resp.status == 413 and error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]
        conn.close()
        # A chunked body, no length given: refused once it passes the limit.
        conn = http.client.HTTPConnection(host.hostname, host.port, timeout=10)
        chunks = [b'{"prompt": "', *[b"x" * 500] * 8, b'"}']
        conn.request("POST", "/v1/completions", body=iter(chunks), encode_chunked=True)
        resp = conn.getresponse()
        assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
        conn.close()
        status, payload, _ = request(
            url + "/v1/completions", "POST", {"prompt": "The quick brown fox " * 50, "max_tokens": 2}
        )
        assert status == 200 and payload["usage"]["completion_tokens"] == 2


def test_max_queue_zero_is_refused_at_start_up(model_root):
    from portattn.cli import main
    from portattn.server import create_app

    with pytest.raises(ValueError, match="expected max_queue to be None or a positive int, got 0"):
        create_app(f"{model_root}/no-such-checkpoint", max_queue=0)  # refused before anything loads
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", tiny_checkpoint(model_root), "--max-queue", "0"])
    assert exit_info.value.code == 2


def test_cpu_threads_leave_a_core_to_the_event_loop(tmp_path, monkeypatch, capsys):
    from portattn.server.lifecycle import cpu_threads

    assert cpu_threads({"OMP_NUM_THREADS": "3"})[0] == 3
    assert cpu_threads({"OMP_NUM_THREADS": "4,2"})[0] == 4  # OpenMP's nested form: the first level
    for bad in ("0", "four", "-1"):
        with pytest.raises(ValueError, match=f"expected OMP_NUM_THREADS to be a positive int, got '{bad}'"):
            cpu_threads({"OMP_NUM_THREADS": bad})
    import os

    cores = len(os.sched_getaffinity(0))
    threads, why = cpu_threads({})
    assert threads == max(1, cores - 1) and f"{cores} cores" in why
    from portattn.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "four")
    assert main(["serve", str(tmp_path / "no-such-checkpoint")]) == 2  # refused before anything loads
    assert "expected OMP_NUM_THREADS to be a positive int, got 'four'" in capsys.readouterr().err


def test_aborted_requests_are_counted(served):
    url, app = served
    metrics, engine = app.state.server.metrics, app.state.server.engine.engine

    def aborted() -> float:
        return metrics.requests.labels(model_name=metrics.model_name, finished_reason="abort")._value.get()

    expected = aborted()
    host = urlparse(url)
    for n, stream in ((1, True), (2, False)):
        with StepGate(engine) as gate:
            conn = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
            body = {"prompt": "hi", "max_tokens": 50, "n": n, "temperature": 1, "ignore_eos": True, "stream": stream}
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            assert gate.entered.wait(timeout=30)  # added, and held before its first step
            conn.sock.close()  # the client leaves
            conn.close()
            if stream:
                gate.allow(1)  # a stream notices when it next writes: one step, one chunk
            expected += n  # one per choice, counted when the handler lets the request go
            assert wait_until(lambda want=expected: aborted() == want), (n, stream, aborted(), expected)
        assert wait_until(lambda: not engine.requests)
    _, text, _ = request(url + "/metrics")
    assert 'finished_reason="abort"' in text


def test_api_key_is_checked_before_routes_and_bodies(model_root):
    with running_server(tiny_checkpoint(model_root), api_key="sk-key") as (url, _):
        key = {"Authorization": "Bearer sk-key"}
        for path, method, body, with_key in [
            ("/v1/no-such-route", "POST", {"x": 1}, 404),
            ("/v1/completions", "POST", b"{not json", 400),
            ("/v1/completions", "POST", {"prompt": 5}, 400),
            ("/v1/models/other", "GET", None, 404),
            ("/v1/completions", "GET", None, 405),
        ]:
            status, payload, _ = request(url + path, method, body)
            assert status == 401 and payload["error"]["code"] == "invalid_api_key", (path, payload)
            assert request(url + path, method, body, headers=key)[0] == with_key, path
        for path in ("/health", "/ping", "/version", "/metrics"):
            assert request(url + path)[0] == 200, path


def stream_events(url: str, body: dict) -> list:
    """A streamed completion's events up to ``[DONE]`` (included)."""
    host = urlparse(url)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    out = []
    try:
        while not out or out[-1] != "[DONE]":
            line = resp.readline()
            assert line, f"the stream ended without [DONE] after {out[-2:]}"
            if line.startswith(b"data: "):
                data = line[len(b"data: ") :].strip()
                out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    finally:
        conn.close()
    return out


def test_stream_errors_end_as_openai_error_events(served, monkeypatch, caplog):
    """A stream that fails ends with an error event and ``[DONE]``, its body as the whole response's
    would be: the engine refusing the request is the client's error, a defect of the server is logged."""
    url, app = served
    engine = app.state.server.engine.engine
    body = {"prompt": "hi", "max_tokens": 3}
    with monkeypatch.context() as patch:

        def refuse(*args, **kwargs):
            raise ValueError("expected top_k to be -1 or at least 1, got 0")

        patch.setattr(engine, "add_request", refuse)
        status, whole, _ = request(url + "/v1/completions", "POST", body)
        tail = stream_events(url, body)
    assert status == 400 and tail[-1] == "[DONE]" and tail[-2] == whole, (whole, tail)
    assert whole["error"]["param"] == "top_k" and whole["error"]["type"] == "invalid_request_error"

    from portattn.server.responses import CompletionFormat

    def broken(self, prompt, out):
        raise KeyError("a defect")

    with monkeypatch.context() as patch, caplog.at_level(logging.ERROR, logger="portattn"):
        patch.setattr(CompletionFormat, "choices", broken)
        tail = stream_events(url, {**body, "max_tokens": 50, "ignore_eos": True})
    assert tail[-1] == "[DONE]" and tail[-2]["error"]["type"] == "server_error", tail
    assert "KeyError" in tail[-2]["error"]["message"]
    assert any(r.getMessage() == "request failed" for r in caplog.records)
    assert wait_until(lambda: not engine.requests)  # the request was aborted
