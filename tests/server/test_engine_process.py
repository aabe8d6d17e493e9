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
    from portattn.server import create_app

    app = create_app(model, **{**ENGINE, "served_model_name": "m", "engine_process": True})
    # the statistics the facade waited for, read before the server starts it (then the engine's loop publishes
    # its own): no step and no engine-thread CPU time (the statistics line's share starts after)
    first = app.state.server.engine.stats
    with running_server(None, app=app) as (url, app):  # (asserted inside: the server stops the engine's process)
        assert (first.steps, first.engine_cpu_s) == (0, 0.0)
        engine = app.state.server.engine
        got = answers(url)
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

    with pytest.raises(ValueError) as thread_error:  # bad input: the engine's own error, as on a thread
        create_app(tiny_checkpoint(str(tmp_path)), **{**ENGINE, "num_pages": 1})
    with pytest.raises(ValueError) as process_error:
        create_app(tiny_checkpoint(str(tmp_path)), engine_process=True, **{**ENGINE, "num_pages": 1})
    assert str(process_error.value) == str(thread_error.value) and "num_pages" in str(process_error.value)
    from portattn.server.engine_process import _start_up_error

    error = _start_up_error(("MemoryError", "out of memory", "Traceback ..."))  # not bad input: named
    assert (
        isinstance(error, RuntimeError)
        and str(error) == "the engine process failed to start: MemoryError: out of memory"
    )
    assert type(_start_up_error(("FileNotFoundError", "no config.json in /x", ""))) is FileNotFoundError


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


def test_serve_runs_the_engine_in_its_own_process_on_a_gpu_for_text_models(tmp_path, model_root):
    """``portattn serve``'s default (``--engine-process`` not given, ``create_app(engine_process=None)``): a
    process of its own on a GPU for a text model; a thread on a CPU and for a model that takes images;
    ``--engine-process`` and ``--no-engine-process`` decide."""
    import argparse
    import types

    import torch

    from portattn.server.cli import add_arguments, engine_process_default
    from tiny_models import checkpoint

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["m"]).engine_process is None
    assert parser.parse_args(["m", "--engine-process"]).engine_process is True
    assert parser.parse_args(["m", "--no-engine-process"]).engine_process is False
    text, images = tiny_checkpoint(model_root), checkpoint("qwen2_5_vl", str(tmp_path))
    gpu = torch.device("cuda", 0)
    assert engine_process_default(types.SimpleNamespace(device=gpu, model=text))[0] is True
    on_gpu_images = engine_process_default(types.SimpleNamespace(device=gpu, model=images))
    assert on_gpu_images[0] is False and "takes images" in on_gpu_images[1]
    assert engine_process_default(types.SimpleNamespace(device=torch.device("cpu"), model=text))[0] is False
    with running_server(text, served_model_name="m", engine_process=None) as (url, app):
        on_cpu = app.state.server.engine.engine.config.device.type == "cpu"
        assert type(app.state.server.engine).__name__ == ("AsyncEngine" if on_cpu else "EngineProcess")
        status, reply, _ = request(f"{url}/v1/completions", "POST", {"model": "m", "prompt": "ok", "max_tokens": 2})
        assert status == 200, reply


def test_the_engine_process_runs_tensor_parallel_ranks(model_root):
    """Tensor parallelism inside the engine's process (its ranks are that process's subprocesses): the
    greedy answers of two ranks there equal one rank's on the server's thread (on the CPU: ranks over gloo)."""
    model = tiny_checkpoint(model_root)
    body = {"model": "m", "prompt": "hello there", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    texts = []
    for kwargs in ({}, {"engine_process": True, "tensor_parallel_size": 2}):
        with running_server(model, served_model_name="m", device="cpu", **kwargs) as (url, _):
            status, reply, _ = request(f"{url}/v1/completions", "POST", body)
            assert status == 200, reply
            texts.append(reply["choices"][0]["text"])
    assert texts[0] == texts[1] and len(texts[0]) > 0


def delta(index: int, *choices, finished: bool = False, prompt_logprobs=None):
    from portattn.engine.outputs import CompletionOutput, RequestOutput

    outputs = [
        CompletionOutput(index=i, text=t, token_ids=ids, logprobs=[{x: -1.0} for x in ids], finish_reason=f)
        for i, t, ids, f in choices
    ]
    return index, RequestOutput("r", "p", [1, 2], outputs, finished, prompt_logprobs=prompt_logprobs)


def test_a_reader_that_fell_behind_takes_each_prompts_queued_deltas_merged():
    """The engine in its own process sends every step's delta; on the server's side a reader that finds several
    queued takes one per prompt: each choice's text, tokens and log-probabilities joined in order, its latest
    finish, the prompt's log-probabilities of the first delta; an error ends what is taken after what came first."""
    import asyncio
    import types

    from portattn.server.engine_process import _MergingStream, merge_queued

    items = [
        delta(0, (0, "a", [1], None), (1, "x", [7], None), prompt_logprobs=[None, {2: -0.5}]),
        delta(1, (0, "q", [3], None)),
        delta(0, (1, "y", [8], None)),
        delta(0, (0, "b", [2], "stop")),
        delta(1, (0, "r", [4], "length"), finished=True),
        delta(0, (1, "z", [9], "length"), finished=True),
    ]
    taken = merge_queued(items)
    assert [index for index, _ in taken] == [0, 1]
    first, second = taken[0][1], taken[1][1]
    got = [(c.index, c.text, c.token_ids, [list(p) for p in c.logprobs], c.finish_reason) for c in first.outputs]
    assert got == [(0, "ab", [1, 2], [[1], [2]], "stop"), (1, "xyz", [7, 8, 9], [[7], [8], [9]], "length")]
    assert first.finished and first.prompt_logprobs == [None, {2: -0.5}]
    assert [(c.text, c.token_ids, c.finish_reason) for c in second.outputs] == [("qr", [3, 4], "length")]
    assert second.finished and second.prompt_logprobs is None
    assert merge_queued(items[:1]) == items[:1]  # one delta: passed as it came
    error = RuntimeError("the engine failed")
    head = merge_queued([items[0], items[2], error, items[3]])
    assert [(c.text, c.token_ids) for c in head[0][1].outputs] == [("a", [1]), ("xy", [7, 8])] and head[1] is error

    async def read() -> tuple[list, int]:
        engine = types.SimpleNamespace(abort=lambda request_id: None)
        stream = _MergingStream(engine, "r", num_prompts=2)
        for item in items:
            stream.queue.put_nowait(item)
        return [item async for item in stream], stream.taken

    read_items, taken_count = asyncio.run(read())
    assert taken_count == len(items) and [(i, [c.text for c in o.outputs]) for i, o in read_items] == [
        (0, ["ab", "xyz"]),
        (1, ["qr"]),
    ]


def test_the_engine_process_registers_the_servers_models(tmp_path, model_root, monkeypatch):
    """A model architecture registered in the server's process (``--register``, ``register_model``) is
    registered in the engine's; one registered in ``__main__``, which that process cannot import, is
    refused there with the way out, and ``portattn serve``'s default keeps the engine on a thread for it."""
    import types

    import torch

    from distributed.faulty import faulty_checkpoint  # rank 0's forwards never fail
    from portattn import models
    from portattn.server import create_app
    from portattn.server.cli import engine_process_default

    path = faulty_checkpoint(model_root, tmp_path, "raise")
    with running_server(path, served_model_name="m", engine_process=True) as (url, _):
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        status, reply, _ = request(f"{url}/v1/completions", "POST", body)
        assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply
    monkeypatch.setitem(models._REGISTRY, "MainLlama", "__main__:MainLlama")
    with pytest.raises(ValueError, match=r"expected 'MainLlama' registered from an importable module for --engine"):
        create_app(tiny_checkpoint(model_root), engine_process=True, **ENGINE)
    on_gpu = engine_process_default(types.SimpleNamespace(device=torch.device("cuda", 0), model=path))
    assert on_gpu[0] is False and "__main__" in on_gpu[1]


def test_deltas_cross_the_pipe_as_values_with_the_prompt_once():
    """What the engine's process sends of a delta (``encoded``) gives the same output back (``decoded``), every
    field of the output and of its choices; a prompt's later deltas leave out the prompt's text and token ids,
    which the server's side takes from the delta before; an aborted request is forgotten."""
    import dataclasses
    import pickle
    import types

    import torch

    from portattn.engine.outputs import CompletionOutput, RequestOutput
    from portattn.server.engine_process import _Sender, decoded, encoded

    prompt_ids = list(range(100, 868))
    choice = CompletionOutput(
        index=1, text=" hi", token_ids=[5, 6], cumulative_logprob=-1.5, logprobs=[{5: -0.5}, {6: -1.0}],
        finish_reason="stop", stop_reason="!", logits=torch.randn(2, 7),
    )  # fmt: skip
    first = RequestOutput(
        "r-0", "a prompt", prompt_ids, [choice], True, prompt_logprobs=[None, {101: -2.0}], prompt_logits=torch.ones(3)
    )
    back = decoded(pickle.loads(pickle.dumps(encoded(first, with_prompt=True))), None)
    for field in dataclasses.fields(RequestOutput):
        if field.name != "outputs":
            want, got = getattr(first, field.name), getattr(back, field.name)
            assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, field.name
    for field in dataclasses.fields(CompletionOutput):
        want, got = getattr(choice, field.name), getattr(back.outputs[0], field.name)
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, field.name
    later = RequestOutput("r-0", "a prompt", prompt_ids, [CompletionOutput(index=0, text=" x", token_ids=[9])], False)
    sent = encoded(later, with_prompt=False)
    assert len(pickle.dumps(sent)) < 200  # (the prompt's 768 token ids: over 2 KB)
    again = decoded(sent, first)
    assert (again.prompt, again.prompt_token_ids, again.outputs[0].token_ids) == ("a prompt", prompt_ids, [9])

    messages = []
    sender = _Sender(types.SimpleNamespace(send=messages.append))
    step = [("a", (0, later)), ("a", (1, later)), ("b", (0, later))]
    sender.call_soon_threadsafe(None, step)
    sender.call_soon_threadsafe(None, step)
    with_prompt = [[values[2] is not None for _, _, values in items] for _, items in messages]
    assert with_prompt == [[True, True, True], [False, False, False]]
    sender.forget("a")  # aborted
    sender.call_soon_threadsafe(None, [("b", (0, dataclasses.replace(later, finished=True)))])
    assert sender.started == {}  # b's prompt finished, a forgotten
    error = ValueError("refused")
    sender.call_soon_threadsafe(None, [("c", error)])
    assert messages[-1] == ("items", [("c", error)])


class _BlockedPipe:
    """A pipe end whose sends wait until :attr:`opened` is set (an engine that has not read yet), then record
    what was sent; ``broken``: every send raises."""

    def __init__(self, broken: bool = False):
        import threading

        self.opened = threading.Event()
        self.sent: list = []
        self.broken = broken

    def send(self, obj) -> None:
        if self.broken:
            raise BrokenPipeError("the engine is gone")
        self.opened.wait(timeout=30)
        self.sent.append(obj)


def test_messages_to_the_engine_never_wait_for_the_pipe_and_go_together():
    """The server's side queues each message (the event loop never waits for a full pipe: a burst of requests
    used to stop every stream until the engine's reader had taken them one by one) and its sender thread sends
    all that queued meanwhile as one list, in order; ``stop`` ends the sending."""
    import time

    from portattn.server.engine_process import Outbox

    pipe = _BlockedPipe()
    outbox = Outbox(pipe)
    messages = [("add", f"r{i}", 1, [[i] * 1024], None) for i in range(100)] + [("abort", "r7"), ("stop",)]
    start = time.monotonic()
    assert all(outbox.put(m) for m in messages)  # while the first send waits for the engine
    assert time.monotonic() - start < 5 and pipe.sent == []
    pipe.opened.set()
    outbox.join(timeout=30)
    assert [m for batch in pipe.sent for m in batch] == messages  # every message, in order
    assert len(pipe.sent) <= 2  # the one waiting when the rest came, then the rest together
    assert outbox.put(("add", "late", 1, [], None)) is False  # sending ended with stop


def test_a_broken_pipe_ends_the_sending():
    from portattn.server.engine_process import Outbox

    outbox = Outbox(_BlockedPipe(broken=True))
    assert outbox.put(("add", "r0", 1, [], None)) is True  # queued before the send failed
    outbox.join(timeout=30)
    assert outbox.put(("add", "r1", 1, [], None)) is False


def test_the_engines_reader_takes_a_list_a_send_and_wakes_the_step_loop_once():
    """The engine's side of :class:`Outbox`: each list's adds and aborts go to the step loop's inbox in order,
    counted as pending, with one wake-up a list; ``stop`` ends the reading."""
    import queue
    import threading
    import types

    from portattn.server.engine_process import _EngineSide, _RemoteStream

    lists = iter([[("add", "r0", 1, ["p0"], "params"), ("add", "r1", 2, ["p1", "p2"], "params"), ("abort", "r0")],
                  [("stop",), ("add", "after stop", 1, [], None)]])  # fmt: skip
    side = _EngineSide.__new__(_EngineSide)  # (no engine: only the reader's fields)
    wakes = []
    side.conn = types.SimpleNamespace(recv=lambda: next(lists))
    side.sender = types.SimpleNamespace()
    side._inbox, side._pending, side._pending_lock = queue.SimpleQueue(), 0, threading.Lock()
    side._wake = types.SimpleNamespace(set=lambda: wakes.append(side._inbox.qsize()))
    side.serve()
    taken = []
    while not side._inbox.empty():
        taken.append(side._inbox.get_nowait())
    assert [(m[0], m[1].request_id, m[1].num_prompts, m[2]) if m[0] == "add" else m for m in taken] == [
        ("add", "r0", 1, ["p0"]), ("add", "r1", 2, ["p1", "p2"]), ("abort", "r0")]  # fmt: skip
    assert all(isinstance(m[1], _RemoteStream) for m in taken if m[0] == "add")
    assert side._pending == 2 and wakes == [3, 3]  # once for the first list, once as it stops


def test_the_servers_process_takes_the_gil_within_the_switch_interval_too(model_root):
    """With the engine in its own process, the server's thread that hands each step's tokens to the event loop
    asks for the GIL as the engine thread would: the switch interval is shortened there too."""
    import sys

    from portattn.server.async_engine import SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        with running_server(tiny_checkpoint(model_root), engine_process=True):
            assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
    finally:
        sys.setswitchinterval(before)
