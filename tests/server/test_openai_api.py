"""The OpenAI-compatible server, driven by the official ``openai`` client and by raw HTTP: the same
greedy text as ``LLM.generate``, streams that join into the whole, stop strings, seeded choices,
log-probabilities, 64 concurrent clients, disconnects, the queue limit, the API key, metrics."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

from portattn.engine.llm import LLM  # noqa: E402
from portattn.engine.sampling_params import SamplingParams  # noqa: E402

from .conftest import request, running_server, tiny_checkpoint, wait_until  # noqa: E402

PROMPTS = ["The quick brown fox", "Servers stream tokens to", "At the café a", "Rivers run"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def engine_idle(app) -> bool:
    engine = app.state.server.engine.engine
    return not engine.requests and engine.allocator.num_used == 0


def test_client_gets_the_same_greedy_text_as_generate(llm, client, served):
    want = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    model = client.models.list().data[0].id
    got = client.completions.create(
        model=model, prompt=PROMPTS, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in got.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in got.choices] == [o.text for o in want]
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)
    assert got.usage.completion_tokens == 12 * len(PROMPTS)
    ids = want[0].prompt_token_ids
    by_ids = client.completions.create(
        model=model, prompt=[ids, ids[1:]], max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == want[0].text and by_ids.usage.prompt_tokens == 2 * len(ids) - 1
    chat_want = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.content == chat_want.text and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(chat_want.prompt_token_ids) and chat.choices[0].finish_reason == "length"


def test_streamed_deltas_join_into_the_whole_text(client):
    kwargs = dict(model=None, max_tokens=16, temperature=0.9, seed=11, n=2)
    for make, whole_text, delta_text in [
        (client.completions.create, lambda c: c.text, lambda c: c.text),
        (client.chat.completions.create, lambda c: c.message.content, lambda c: c.delta.content or ""),
    ]:
        args = {"prompt": PROMPTS[:2]} if make == client.completions.create else {"messages": MESSAGES}
        whole = make(**args, **kwargs)
        joined, reasons, usage = {}, {}, None
        for chunk in make(**args, **kwargs, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage
                assert chunk.choices == []
            assert len(chunk.choices) <= 1  # one choice per chunk, as OpenAI's API streams n > 1
            for c in chunk.choices:
                assert c.index not in reasons  # nothing after a choice's finish
                joined[c.index] = joined.get(c.index, "") + delta_text(c)
                if c.finish_reason is not None:
                    reasons[c.index] = c.finish_reason
        assert joined == {c.index: whole_text(c) for c in whole.choices}
        assert reasons == {c.index: c.finish_reason for c in whole.choices}
        assert usage is not None and usage.model_dump() == whole.usage.model_dump()


def boundary_stop(llm: LLM, prompt: str) -> tuple[str, str]:
    """A two-character stop string made of the last character of one generated token and the first of
    the next, and the greedy text before its first occurrence."""
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    pieces = [llm.tokenizer.decode(out.token_ids[: i + 1]) for i in range(len(out.token_ids))]
    for i in range(len(pieces) - 1):
        end = len(pieces[i])
        stop = pieces[-1][end - 1 : end + 1]
        grew = end > len(pieces[i - 1] if i else "") and pieces[-1].startswith(pieces[i + 1])
        if grew and len(stop) == 2 and "\ufffd" not in stop and pieces[-1].find(stop) == end - 1:
            return stop, pieces[-1][: end - 1]
    pytest.fail("no stop string across a token boundary")


def test_stop_strings_cut_exactly(llm, client):
    stop, before = boundary_stop(llm, PROMPTS[0])
    got = client.completions.create(
        model=None, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop, "§§"], extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == before and got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=None,
        prompt=PROMPTS[0],
        max_tokens=24,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in streamed) == before


def test_n3_choices_are_reproducible_with_a_seed(llm, client):
    kwargs = dict(model=None, prompt=PROMPTS[1], n=3, max_tokens=10, temperature=1.0, seed=1234)
    first = [c.text for c in client.completions.create(**kwargs).choices]
    again = [c.text for c in client.completions.create(**kwargs).choices]
    assert first == again and len(set(first)) == 3
    offline = llm.generate(PROMPTS[1], SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=1234), use_tqdm=False)
    assert first == [c.text for c in offline[0].outputs]


def test_logprobs_match_the_engine(llm, client):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    want = llm.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0]
    got = (
        client.completions.create(
            model=None, prompt=PROMPTS[2], max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .logprobs
    )
    assert got.token_logprobs == pytest.approx([e[t].logprob for t, e in zip(want.token_ids, want.logprobs)], abs=1e-5)
    assert got.tokens == [e[t].decoded_token for t, e in zip(want.token_ids, want.logprobs)]
    assert all(len(top) >= 3 for top in got.top_logprobs)
    assert got.text_offset[0] == 0
    chat = client.chat.completions.create(
        model=None, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)


def test_64_concurrent_clients_finish_and_free_every_page(llm, served):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(64)]
    lengths = [4 + i % 9 for i in range(64)]
    want = llm.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths], use_tqdm=False
    )
    aclient = openai.AsyncOpenAI(base_url=served[0] + "/v1", api_key="unused", timeout=120, max_retries=0)

    async def one(i: int) -> str:
        kwargs = dict(
            model=None, prompt=prompts[i], max_tokens=lengths[i], temperature=0, extra_body={"ignore_eos": True}
        )
        if i % 2:
            return "".join([c.choices[0].text async for c in await aclient.completions.create(**kwargs, stream=True)])
        return (await aclient.completions.create(**kwargs)).choices[0].text

    async def everyone():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), timeout=120)

    got = asyncio.run(everyone())
    assert got == [o.text for o in want]
    assert wait_until(lambda: engine_idle(served[1]))
    _, text, _ = request(served[0] + "/metrics")
    assert "portattn:kv_pages_used{model_name=" in text and "portattn:time_to_first_token_seconds_count" in text
    assert served[1].state.server.engine.stats.pages_used == 0


def test_a_client_that_disconnects_frees_its_pages(served, monkeypatch):
    url, app = served
    engine = app.state.server.engine.engine
    step = engine.step

    def slow_step():  # 400 tokens take at least 2 s however fast the machine: the client leaves first
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    host = urlparse(url)
    for stream in (True, False):
        conn = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
        body = {"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": stream}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        if stream:
            resp = conn.getresponse()
            assert resp.status == 200 and resp.readline().startswith(b"data: ")
        else:
            assert wait_until(lambda: engine.allocator.num_used > 0)
        (seq,) = list(engine.requests.values())
        conn.sock.close()  # the client goes away mid-generation
        conn.close()
        assert wait_until(lambda: engine_idle(app), timeout=10), f"stream={stream}: pages still held"
        assert seq.finish_reason == "abort" and len(seq.output_token_ids) < 400
    assert request(url + "/health")[0] == 200


def bad_requests(url: str, max_len: int):
    """``(name, method, path, body, expected status, expected param)`` of wrong requests."""
    long_prompt = list(range(10, 10 + max_len))
    c, chat = "/v1/completions", "/v1/chat/completions"
    ok = {"prompt": "hi", "max_tokens": 2}
    okc = {"messages": MESSAGES, "max_tokens": 2}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    return [
        ("missing prompt", "POST", c, {"max_tokens": 2}, 400, "prompt"),
        ("temperature not a number", "POST", c, {**ok, "temperature": "hot"}, 400, "temperature"),
        ("negative temperature", "POST", c, {**ok, "temperature": -1}, 400, "temperature"),
        ("top_p zero", "POST", c, {**ok, "top_p": 0}, 400, "top_p"),
        ("n zero", "POST", c, {**ok, "n": 0}, 400, "n"),
        ("max_tokens zero", "POST", c, {**ok, "max_tokens": 0}, 400, "max_tokens"),
        ("logprobs above 20", "POST", c, {**ok, "logprobs": 21}, 400, "logprobs"),
        ("presence_penalty out of range", "POST", c, {**ok, "presence_penalty": 5}, 400, "presence_penalty"),
        ("prompt of the wrong type", "POST", c, {"prompt": {"text": "hi"}}, 400, "prompt"),
        ("not JSON", "POST", c, b"{not json", 400, None),
        ("unknown model", "POST", c, {**ok, "model": "gpt-4"}, 404, "model"),
        ("empty prompt list", "POST", c, {"prompt": []}, 400, "prompt"),
        ("token id outside the vocabulary", "POST", c, {"prompt": [1, 10**6]}, 400, "prompt"),
        ("prompt longer than the context", "POST", c, {"prompt": long_prompt}, 400, "prompt"),
        ("max_tokens beyond the context", "POST", c, {**ok, "max_tokens": max_len}, 400, "max_tokens"),
        ("lone surrogate in a prompt", "POST", c, {**ok, "prompt": "a\ud800b"}, 400, "prompt"),
        ("top_k zero", "POST", c, {**ok, "top_k": 0}, 400, "top_k"),
        ("min_tokens above max_tokens", "POST", c, {**ok, "min_tokens": 5}, 400, "min_tokens"),
        ("stop token outside the vocabulary", "POST", c, {**ok, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
        ("logit_bias", "POST", c, {**ok, "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
        (
            "stream_options without stream",
            "POST",
            c,
            {**ok, "stream_options": {"include_usage": True}},
            400,
            "stream_options",
        ),
        ("no messages", "POST", chat, {"messages": []}, 400, "messages"),
        ("message without a role", "POST", chat, {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
        (
            "lone surrogate in a message",
            "POST",
            chat,
            {"messages": [{"role": "user", "content": "\udfff"}]},
            400,
            "messages",
        ),
        (
            "image for a text-only model",
            "POST",
            chat,
            {"messages": [{"role": "user", "content": [image]}]},
            400,
            "messages",
        ),
        (
            "unknown content part",
            "POST",
            chat,
            {"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
            400,
            "messages",
        ),
        ("tools", "POST", chat, {**okc, "tools": [{"type": "function"}]}, 400, "tools"),
        ("top_logprobs without logprobs", "POST", chat, {**okc, "top_logprobs": 2}, 400, "top_logprobs"),
        (
            "json response_format",
            "POST",
            chat,
            {**okc, "response_format": {"type": "json_object"}},
            400,
            "response_format",
        ),
        (
            "both max_tokens and max_completion_tokens",
            "POST",
            chat,
            {**okc, "max_completion_tokens": 3},
            400,
            "max_completion_tokens",
        ),
        ("a request's chat template", "POST", chat, {**okc, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
        ("unknown route", "POST", "/v1/embeddings", {"input": "hi"}, 404, None),
        ("wrong method", "GET", c, None, 405, None),
    ]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served):
    url, app = served
    cases = bad_requests(url, app.state.server.max_model_len)
    assert len(cases) >= 20
    for name, method, path, body, status, param in cases:
        got, payload, _ = request(url + path, method, body)
        assert got == status, (name, payload)
        assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}, name
        assert payload["error"]["param"] == param and payload["error"]["message"], (name, payload)
    status, payload, _ = request(url + "/v1/completions", "POST", {"prompt": "hi", "max_tokens": 3})
    assert status == 200 and payload["usage"]["completion_tokens"] >= 1
    assert engine_idle(app)


def test_chat_without_a_template_is_a_400(model_root):
    with running_server(tiny_checkpoint(model_root, chat_template=False), served_model_name="bare") as (url, _):
        status, payload, _ = request(url + "/v1/chat/completions", "POST", {"messages": MESSAGES})
        assert status == 400 and "chat template" in payload["error"]["message"]
        assert request(url + "/v1/completions", "POST", {"prompt": "hi", "model": "bare"})[0] == 200


def test_api_key_and_queue_limit(model_root):
    path = tiny_checkpoint(model_root)
    with running_server(path, api_key="sk-test", max_num_seqs=1, max_queue=1) as (url, app):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, payload, _ = request(url + "/v1/models", headers=headers)
            assert status == 401 and payload["error"]["code"] == "invalid_api_key"
        assert request(url + "/health")[0] == 200  # not behind the key
        keyed = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-test", timeout=60, max_retries=0)
        # Hold the engine thread inside its first step, so the queue fills however fast the machine is.
        async_engine = app.state.server.engine
        engine, step = async_engine.engine, async_engine.engine.step
        entered, release = threading.Event(), threading.Event()

        def held_step():
            entered.set()
            release.wait(timeout=60)
            return step()

        engine.step = held_step

        async def one(i: int):
            try:
                out = await keyed.completions.create(
                    model=path, prompt=PROMPTS[i % 4], max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
                )
                return out.usage.completion_tokens
            except openai.APIStatusError as err:
                return err

        async def until(condition):
            for _ in range(600):
                if condition():
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("timed out")

        async def burst():
            running = asyncio.ensure_future(one(0))  # taken by the engine, which then waits in its step
            await until(entered.is_set)
            waiting = asyncio.ensure_future(one(1))  # submitted, not yet added: fills the queue of one
            await until(lambda: async_engine.queue_full())
            refused = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(2, 6))), timeout=60)
            release.set()
            return [await running, await waiting, *refused]

        try:
            results = asyncio.run(burst())
        finally:
            release.set()
            engine.step = step
        assert results[:2] == [30, 30]
        refused = results[2:]
        assert all(isinstance(r, openai.APIStatusError) and r.status_code == 503 for r in refused), refused
        assert all(r.response.headers["retry-after"] == "1" for r in refused)
        assert all(r.response.json()["error"]["code"] == "queue_full" for r in refused)
        assert wait_until(lambda: engine_idle(app))


def test_models_health_and_metrics(served, client):
    url, app = served
    card = client.models.list().data
    assert [m.id for m in card] == [app.state.server.model_name]
    assert request(url + "/health")[0] == 200
    client.completions.create(model=None, prompt="hi", max_tokens=3, temperature=0)
    status, text, headers = request(url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in (
        "portattn:num_requests_running",
        "portattn:num_requests_waiting",
        "portattn:kv_pages_used",
        "portattn:kv_pages_free",
        "portattn:kv_pages_prefix_cache_only",
        "portattn:kv_cache_usage_perc",
        "portattn:prefix_cache_hit_rate",
        "portattn:prompt_tokens_total",
        "portattn:generation_tokens_total",
        "portattn:time_to_first_token_seconds_bucket",
        "portattn:time_per_output_token_seconds_bucket",
    ):
        assert name in text, name
    values = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values["portattn:generation_tokens_total"] >= 3 and values["portattn:kv_pages_free"] > 0
