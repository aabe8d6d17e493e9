"""What OpenAI clients and vLLM's users send: unknown fields ignored (logged once), schema errors as
the client's BadRequestError, echo with prompt log-probabilities (lm-eval's loglikelihood), one
wording for context-length errors, /tokenize, /detokenize, /version, /ping, a model by id, and chat
messages with images for the vision-language family."""

from __future__ import annotations

import base64
import io
import logging

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import portattn  # noqa: E402
from portattn.engine.llm import LLM  # noqa: E402
from portattn.engine.sampling_params import SamplingParams  # noqa: E402

from .conftest import request, running_server  # noqa: E402

PROMPT = "The quick brown fox jumps over"


def test_unknown_fields_are_accepted_and_logged_once(served, caplog):
    url, _ = served
    body = {"prompt": "hi", "max_tokens": 2, "frobnicate": {"x": 1}, "stream_options": None}
    with caplog.at_level(logging.WARNING, logger="portattn"):
        for _ in range(2):
            status, payload, _ = request(url + "/v1/completions", "POST", body)
            assert status == 200 and payload["usage"]["completion_tokens"] == 2
        chat = {"messages": [{"role": "user", "content": "hi", "weight": 1}], "max_tokens": 2, "frobnicate": 1}
        assert request(url + "/v1/chat/completions", "POST", chat)[0] == 200
    logged = [r.getMessage() for r in caplog.records if "frobnicate" in r.getMessage()]
    assert len(logged) == 1 and "ignoring" in logged[0] and "/v1/completions" in logged[0]


def test_schema_errors_are_the_clients_bad_request(client):
    for kwargs in ({"max_tokens": 0}, {"temperature": -1}, {"extra_body": {"n": "many"}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=None, prompt="hi", **{"max_tokens": 2, **kwargs})
        error = info.value.body
        assert info.value.status_code == 400 and error["type"] == "invalid_request_error" and error["param"]


def test_echo_with_logprobs_gives_the_prompts_logprobs(llm, client):
    ids = llm.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2, logprobs=2)
    want = llm.generate([ids], params, use_tqdm=False)[0]
    # As lm-eval's loglikelihood requests it: token ids, one token, echo, logprobs.
    got = client.completions.create(model=None, prompt=[ids], max_tokens=1, temperature=0, echo=True, logprobs=2)
    choice = got.choices[0]
    lp = choice.logprobs
    assert choice.text == llm.tokenizer.decode(ids) + want.text
    assert len(lp.tokens) == len(ids) + 1 and lp.tokens[0] == llm.tokenizer.decode([ids[0]])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    prompt_want = [e[t].logprob for t, e in zip(ids[1:], want.prompt_logprobs[1:])]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(prompt_want, abs=1e-5)
    assert lp.token_logprobs[-1] == pytest.approx(want.outputs[0].logprobs[0][want.token_ids[0]].logprob, abs=1e-5)
    for t, entry, top in zip(ids[1:], want.prompt_logprobs[1:], lp.top_logprobs[1:]):
        assert len(top) >= 2 and max(top.values()) == pytest.approx(max(e.logprob for e in entry.values()), abs=1e-5)
        assert top[entry[t].decoded_token] == pytest.approx(entry[t].logprob, abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == choice.text and lp.tokens[0] == llm.tokenizer.bos_token
    # A text prompt echoes as given; a stream sends the prompt first, once per choice.
    text = client.completions.create(model=None, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert text.choices[0].text.startswith(PROMPT) and text.choices[0].logprobs is None
    chunks = client.completions.create(
        model=None, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1, stream=True, n=2
    )
    joined, tokens = {0: "", 1: ""}, {0: 0, 1: 0}
    for chunk in chunks:
        for c in chunk.choices:
            joined[c.index] += c.text
            tokens[c.index] += len(c.logprobs.tokens)
    assert joined == {0: text.choices[0].text, 1: text.choices[0].text}  # greedy: both choices alike
    assert tokens == {0: text.usage.prompt_tokens + 3, 1: text.usage.prompt_tokens + 3}


def test_echo_with_max_tokens_0_gives_the_prompt_alone(llm, served, client):
    """``max_tokens=0`` with ``echo`` (OpenAI's legacy API, vLLM): the prompt and its log-probabilities, no
    completion (the token computed after the prompt is left out), finish reason ``length``, no completion
    tokens in the usage; streamed too. Without ``echo``, or with ``min_tokens``, it is a 400 that says so."""
    url, _ = served
    ids = llm.tokenizer(PROMPT)["input_ids"]
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    prompt_want = [e[t].logprob for t, e in zip(ids[1:], want.prompt_logprobs[1:])]
    got = client.completions.create(model=None, prompt=[ids], max_tokens=0, echo=True, logprobs=2)
    choice, lp = got.choices[0], got.choices[0].logprobs
    assert choice.text == llm.tokenizer.decode(ids) and choice.finish_reason == "length"
    assert lp.tokens[0] == llm.tokenizer.decode([ids[0]]) and "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1:] == pytest.approx(prompt_want, abs=1e-5)
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), 0)
    text = client.completions.create(model=None, prompt=[PROMPT, "hello"], max_tokens=0, echo=True)
    assert [c.text for c in text.choices] == [PROMPT, "hello"] and text.choices[0].logprobs is None
    chunks = client.completions.create(
        model=None,
        prompt=PROMPT,
        max_tokens=0,
        echo=True,
        logprobs=1,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    joined, tokens, finish, used = {0: "", 1: ""}, {0: 0, 1: 0}, {}, None
    for chunk in chunks:
        used = chunk.usage or used
        for c in chunk.choices:
            joined[c.index] += c.text
            tokens[c.index] += len(c.logprobs.tokens)
            finish[c.index] = c.finish_reason or finish.get(c.index)
    prompt_tokens = len(llm.tokenizer(PROMPT)["input_ids"])
    assert joined == {0: PROMPT, 1: PROMPT} and tokens == {0: prompt_tokens, 1: prompt_tokens}
    assert finish == {0: "length", 1: "length"} and (used.prompt_tokens, used.completion_tokens) == (prompt_tokens, 0)
    for body, param, words in (
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens", "0 with echo=true"),
        ({"prompt": PROMPT, "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens", "expected min_tokens 0"),
    ):
        status, payload, _ = request(url + "/v1/completions", "POST", body)
        assert status == 400 and payload["error"]["param"] == param and words in payload["error"]["message"], payload
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    assert request(url + "/v1/chat/completions", "POST", chat)[0] == 400


def test_context_length_errors_have_one_wording(served, client):
    url, app = served
    max_len = app.state.server.max_model_len
    long_ids = list(range(10, 10 + max_len))
    cases = [
        ("/v1/completions", {"prompt": long_ids}, "prompt", f"{max_len + 16} tokens ({max_len} in the prompt, 16"),
        ("/v1/completions", {"prompt": [5, 6], "max_tokens": max_len}, "max_tokens", f"{max_len + 2} tokens (2 in"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * max_len}]}, "messages", "in the"),
    ]
    for path, body, param, words in cases:
        status, payload, _ = request(url + path, "POST", body)
        error = payload["error"]
        assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == param, error
        assert error["message"].startswith(f"This model's maximum context length is {max_len} tokens (--max-model-len)")
        assert words in error["message"] and "max_len" not in error["message"].replace("max-model-len", "")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=None, prompt=long_ids, max_tokens=1)


def test_token_id_prompts_are_checked_on_the_event_loop(served, llm, monkeypatch):
    """Completions of token ids (one or several prompts, no echo) are checked where they are parsed, without the
    preprocessing thread, with the same answers and the same errors (400 on ``prompt``); text prompts and echo
    still go through the thread."""
    from portattn.server.preprocess import Preprocessor

    url, _ = served
    hops = []
    run = Preprocessor.run

    async def counted(self, param, fn, *args, **kwargs):
        hops.append(fn.__name__)
        return await run(self, param, fn, *args, **kwargs)

    monkeypatch.setattr(Preprocessor, "run", counted)
    ids = llm.tokenizer(PROMPT)["input_ids"]
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].text
    for prompt in (ids, [ids, ids[:-1]]):
        status, payload, _ = request(
            url + "/v1/completions", "POST", {"prompt": prompt, "max_tokens": 4, "temperature": 0}
        )
        assert status == 200 and payload["choices"][0]["text"] == want, payload
    assert hops == []
    vocab = llm.engine.vocab_size
    status, payload, _ = request(url + "/v1/completions", "POST", {"prompt": [5, vocab], "max_tokens": 2})
    assert status == 400 and payload["error"]["param"] == "prompt" and str(vocab) in payload["error"]["message"]
    assert hops == []
    request(url + "/v1/completions", "POST", {"prompt": PROMPT, "max_tokens": 2})
    request(url + "/v1/completions", "POST", {"prompt": ids, "max_tokens": 2, "echo": True})
    assert hops == ["completion_prompts", "completion_prompts"]


def test_tokenize_detokenize_version_ping_and_the_model_by_id(served, llm):
    url, app = served
    tok = llm.tokenizer
    status, payload, _ = request(url + "/tokenize", "POST", {"prompt": PROMPT, "return_token_strs": True})
    assert status == 200 and payload["tokens"] == tok(PROMPT)["input_ids"]
    assert payload["count"] == len(payload["tokens"])
    assert payload["max_model_len"] == app.state.server.max_model_len
    assert payload["token_strs"] == [tok.decode([t]) for t in payload["tokens"]]
    bare = request(url + "/tokenize", "POST", {"prompt": PROMPT, "add_special_tokens": False})[1]
    assert bare["tokens"] == payload["tokens"][1:]  # without the BOS
    messages = [{"role": "user", "content": "Hello"}]
    chat = request(url + "/tokenize", "POST", {"messages": messages})[1]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok(rendered, add_special_tokens=False)["input_ids"]
    status, payload, _ = request(url + "/detokenize", "POST", {"tokens": bare["tokens"]})
    assert status == 200 and payload == {"prompt": PROMPT}
    status, payload, _ = request(url + "/detokenize", "POST", {"tokens": [1, 10**6]})
    assert status == 400 and "10000" in payload["error"]["message"] and payload["error"]["param"] == "tokens"
    assert request(url + "/tokenize", "POST", {"prompt": "a", "messages": messages})[0] == 400
    assert request(url + "/version")[1] == {"version": portattn.__version__}
    assert request(url + "/ping")[0] == 200 and request(url + "/ping", "POST", {})[0] == 200
    name = app.state.server.model_name  # a path: slashes in the id
    status, card, _ = request(f"{url}/v1/models/{name}")
    assert status == 200 and card["id"] == name and card["max_model_len"] == app.state.server.max_model_len
    status, payload, _ = request(url + "/v1/models/gpt-4")
    assert status == 404 and payload["error"]["code"] == "model_not_found"


def png_data_url(seed: int, size: tuple[int, int] = (34, 30)) -> tuple[str, object]:
    """A random RGB image as a PNG data URL, and the image."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode(), pixels


def test_chat_with_images_for_the_vision_family(tmp_path_factory):
    pytest.importorskip("PIL")
    from portattn.testing.chat import save_tiny_vision_chat_checkpoint

    path = save_tiny_vision_chat_checkpoint(tmp_path_factory.mktemp("vl") / "ckpt")
    engine = dict(page_size=4, num_pages=256, max_model_len=256)
    vl = LLM(path, **engine)
    (url1, pixels1), (url2, pixels2) = png_data_url(1), png_data_url(2, (20, 44))
    content = [
        {"type": "text", "text": "The cat"},
        {"type": "image_url", "image_url": {"url": url1}},
        {"type": "text", "text": "and the dog"},
        {"type": "image_url", "image_url": {"url": url2}},
    ]
    messages = [{"role": "user", "content": content}]
    # The template writes one placeholder per image; the processor widens each to its patch count.
    parts = [{"type": "text", "text": "The cat"}, {"type": "image"}, {"type": "text", "text": "and the dog"}]
    text = vl.tokenizer.apply_chat_template(
        [{"role": "user", "content": [*parts, {"type": "image"}]}], tokenize=False, add_generation_prompt=True
    )
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    ids = vl.tokenizer(text, add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    want = vl.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [pixels1, pixels2]}}, params)[0]
    assert vl.chat(messages, params, use_tqdm=False)[0].token_ids == want.token_ids
    want_logprobs = [e[t].logprob for t, e in zip(want.token_ids, want.outputs[0].logprobs)]
    with running_server(path, served_model_name="vl", **engine) as (url, _):
        status, payload, _ = request(
            url + "/v1/chat/completions",
            "POST",
            {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True},
        )
        assert status == 200, payload
        assert payload["usage"]["prompt_tokens"] == len(want.prompt_token_ids) > len(ids)  # widened placeholders
        got = [e["logprob"] for e in payload["choices"][0]["logprobs"]["content"]]
        assert got == pytest.approx(want_logprobs, abs=1e-5)
        assert payload["choices"][0]["message"]["content"] == want.text
        count = request(url + "/tokenize", "POST", {"messages": messages})[1]["count"]
        assert count == len(want.prompt_token_ids)
        bad = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
        status, payload, _ = request(
            url + "/v1/chat/completions", "POST", {"messages": [{"role": "user", "content": [bad]}]}
        )
        assert status == 400 and "data URL" in payload["error"]["message"] and payload["error"]["param"] == "messages"
        broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
        status, payload, _ = request(
            url + "/v1/chat/completions", "POST", {"messages": [{"role": "user", "content": [broken]}]}
        )
        assert status == 400 and "pillow" in payload["error"]["message"]
