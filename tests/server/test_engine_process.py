"""The engine in a process of its own (``create_app(engine_process=True)``, ``portattn serve --engine-process``):
the same answers as the engine on a thread (greedy completions and chats, streamed and whole, several choices
with log-probabilities, stop strings, best_of), its statistics and metrics, refused requests, a start-up that fails,
a model that takes images refused, the process ended with the server."""

from __future__ import annotations

import json
import urllib.request

import pytest

from .conftest import ENGINE, request, running_server, tiny_checkpoint, wait_until

pytest.importorskip("fastapi")

BODIES = [
    {"prompt": "hello there", "max_tokens": 12, "temperature": 0},
    {"prompt": [5, 6, 7, 8], "max_tokens": 9, "temperature": 0, "n": 2, "logprobs": 2, "ignore_eos": True},
    {"prompt": "a b c", "max_tokens": 16, "temperature": 0, "stop": ["e"], "ignore_eos": True},
]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0}


def answers(url: str) -> list:
    out = []
    for body in BODIES:
        status, reply, _ = request(f"{url}/v1/completions", "POST", {"model": "m", **body})
        assert status == 200, reply
        out.append([(c["index"], c["text"], c["finish_reason"], c["logprobs"]) for c in reply["choices"]])
        out.append(streamed(f"{url}/v1/completions", {"model": "m", **body}))
    best_of = {"model": "m", "prompt": "x y", "max_tokens": 6, "n": 2, "best_of": 3, "temperature": 0.9, "seed": 3}
    status, reply, _ = request(f"{url}/v1/completions", "POST", best_of)  # the 2 likeliest of 3, whole only
    assert status == 200, reply
    out.append([(c["index"], c["text"], c["finish_reason"]) for c in reply["choices"]])
    status, reply, _ = request(f"{url}/v1/chat/completions", "POST", {"model": "m", **CHAT})
    assert status == 200, reply
    out.append([(c["message"]["content"], c["finish_reason"]) for c in reply["choices"]])
    out.append(streamed(f"{url}/v1/chat/completions", {"model": "m", **CHAT}))
    return out


def streamed(url: str, body: dict) -> list:
    """The text of each choice of a streamed response, and each choice's finish reason."""
    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    texts: dict = {}
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp.read().decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                text = c.get("text", c.get("delta", {}).get("content", "")) or ""
                entry = texts.setdefault(c["index"], ["", None])
                entry[0] += text
                entry[1] = c["finish_reason"] or entry[1]
    return sorted(texts.items())


def test_the_engine_process_answers_as_the_engine_thread(model_root):
    model = tiny_checkpoint(model_root)
    with running_server(model, served_model_name="m") as (url, _):
        want = answers(url)
    with running_server(model, served_model_name="m", engine_process=True) as (url, app):
        got = answers(url)
        engine = app.state.server.engine
        assert wait_until(lambda: engine.stats.generation_tokens > 0 and engine.stats.running == 0)
        status, metrics, _ = request(f"{url}/metrics")
        assert status == 200 and "portattn:generation_tokens_total" in metrics
        process = engine._process
        assert process.is_alive()
    assert got == want
    assert wait_until(lambda: not process.is_alive(), timeout=30)  # ended with the server


def test_requests_the_engine_refuses_get_the_openai_error(model_root):
    with running_server(tiny_checkpoint(model_root), served_model_name="m", engine_process=True) as (url, _):
        status, reply, _ = request(f"{url}/v1/completions", "POST", {"model": "m", "prompt": [10**6], "max_tokens": 2})
        assert status == 400 and "token ids" in reply["error"]["message"]
        long = list(range(1, ENGINE["max_model_len"] + 1))
        status, reply, _ = request(f"{url}/v1/completions", "POST", {"model": "m", "prompt": long, "max_tokens": 2})
        assert status == 400 and "maximum context length is 512" in reply["error"]["message"]
        body = {"model": "m", "prompt": "x", "max_tokens": 2, "stop_token_ids": [10**6]}
        status, reply, _ = request(f"{url}/v1/completions", "POST", body)
        assert status == 400 and "stop_token_ids" in reply["error"]["message"]
        status, reply, _ = request(f"{url}/v1/completions", "POST", {"model": "m", "prompt": "ok", "max_tokens": 3})
        assert status == 200 and reply["usage"]["completion_tokens"] >= 1  # and it still serves


def test_a_start_up_that_fails_says_why(tmp_path):
    from portattn.server import create_app

    with pytest.raises(RuntimeError, match=r"the engine process failed to start: .*num_pages"):
        create_app(tiny_checkpoint(str(tmp_path)), engine_process=True, **{**ENGINE, "num_pages": 1})


def test_a_model_that_takes_images_is_refused(tmp_path):
    from portattn.server import create_app
    from tiny_models import checkpoint

    path = checkpoint("qwen2_5_vl", str(tmp_path))
    with pytest.raises(ValueError, match=r"expected a text model for --engine-process .*Qwen2_5_VL.*takes images"):
        create_app(path, engine_process=True, **ENGINE)


def test_an_engine_process_that_dies_fails_its_streams_and_the_server_answers_503(model_root):
    """The engine's process killed while a request streams: that stream ends with an error event, /health
    and new requests answer 503 (engine_dead), and the server still shuts down."""
    import threading

    with running_server(tiny_checkpoint(model_root), served_model_name="m", engine_process=True) as (url, app):
        engine = app.state.server.engine
        body = {"model": "m", "prompt": "go", "max_tokens": 400, "ignore_eos": True, "stream": True}
        events = []

        def stream() -> None:
            data = json.dumps(body).encode()
            req = urllib.request.Request(
                f"{url}/v1/completions", data=data, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                for line in resp:
                    events.append(line.decode().strip())

        reader = threading.Thread(target=stream)
        reader.start()
        assert wait_until(lambda: len(events) > 4)  # tokens are streaming
        engine._process.kill()
        reader.join(timeout=30)
        assert not reader.is_alive()
        errors = [json.loads(e[6:]) for e in events if e.startswith("data: {") and '"error"' in e]
        assert errors and "the engine failed: its process exited" in errors[0]["error"]["message"], events[-3:]
        assert [e for e in events if e][-1] == "data: [DONE]"
        assert wait_until(lambda: request(f"{url}/health")[0] == 503)
        status, reply, _ = request(f"{url}/v1/completions", "POST", {"model": "m", "prompt": "x", "max_tokens": 2})
        assert status == 503 and reply["error"]["code"] == "engine_dead"


def test_a_client_that_goes_away_has_its_request_aborted_in_the_engine(model_root):
    """A streamed request whose client closes the connection: the engine's process drops it (nothing running,
    every page back) and the server forgets its stream."""
    import http.client

    with running_server(tiny_checkpoint(model_root), served_model_name="m", engine_process=True) as (url, app):
        engine = app.state.server.engine
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        body = {"model": "m", "prompt": "go", "max_tokens": 400, "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        assert wait_until(lambda: engine.stats.running == 1)
        conn.close()
        assert wait_until(lambda: engine.stats.running == 0 and engine.stats.pages_used == 0)
        assert wait_until(lambda: not engine._streams)
        assert engine.stats.generation_tokens < 400  # stopped early
