"""Sampling defaults of the OpenAI server: fields a client leaves out take the checkpoint's
``generation_config.json`` values (vLLM's defaults with ``generation_config="vllm"``), and ``best_of``."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams

from .conftest import ENGINE, request, running_server, tiny_checkpoint

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def greedy_checkpoint(model_root, tmp_path_factory) -> str:
    """The tiny chat checkpoint whose generation_config.json asks for greedy sampling and top_p 0.5."""
    path = tmp_path_factory.mktemp("greedy") / "ckpt"
    shutil.copytree(tiny_checkpoint(model_root), path)
    file = path / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "temperature": 0.0, "top_p": 0.5}))
    return str(path)


def completion(url: str, **body) -> dict:
    status, payload, _ = request(url + "/v1/completions", "POST", {"prompt": PROMPT, "max_tokens": 10, **body})
    assert status == 200, payload
    return payload


def test_fields_left_out_take_the_generation_config(greedy_checkpoint):
    llm = LLM(greedy_checkpoint, **ENGINE)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    seeded = SamplingParams(temperature=1.0, top_p=1.0, seed=4, max_tokens=10, ignore_eos=True)
    sampled = llm.generate(PROMPT, seeded, use_tqdm=False)[0].text
    assert sampled != greedy[0].text
    with running_server(greedy_checkpoint) as (url, app):
        engine = app.state.server.engine.engine
        assert engine.sampling_defaults == {"temperature": 0.0, "top_p": 0.5}
        assert completion(url, ignore_eos=True)["choices"][0]["text"] == greedy[0].text  # no temperature: greedy
        got = completion(url, ignore_eos=True, temperature=1.0, top_p=1.0, seed=4)["choices"][0]["text"]
        assert got == sampled  # what the client sets, it keeps
        status, payload, _ = request(
            url + "/v1/chat/completions",
            "POST",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "ignore_eos": True},
        )
        want = llm.chat(
            [{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        )
        assert status == 200 and payload["choices"][0]["message"]["content"] == want[0].text
    with running_server(greedy_checkpoint, generation_config="vllm") as (url, app):
        assert app.state.server.engine.engine.sampling_defaults == {}
        assert completion(url, ignore_eos=True, seed=4)["choices"][0]["text"] == sampled  # OpenAI's temperature 1


def test_best_of_returns_the_likeliest(served):
    url, _ = served
    every = completion(url, n=4, seed=9, temperature=1.0, logprobs=0, ignore_eos=True)["choices"]
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in every]
    best = completion(url, n=1, best_of=4, seed=9, temperature=1.0, ignore_eos=True)["choices"]
    assert [c["text"] for c in best] == [every[scores.index(max(scores))]["text"]] and best[0]["index"] == 0
    for body, param in (({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 2, "stream": True}, "best_of")):
        status, payload, _ = request(url + "/v1/completions", "POST", {"prompt": PROMPT, **body})
        assert status == 400 and payload["error"]["param"] == param, payload
