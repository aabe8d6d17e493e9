"""How the engine uses a backend: chosen by argument > env var > auto, planned once per forward,
called once per layer, never through the validating functional op."""

from __future__ import annotations

import pytest

import portattn.ops
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from tiny_models import checkpoint, hf_reference, random_prompts


def test_argument_beats_env_var_beats_auto(ckpt_root, monkeypatch):
    path = checkpoint("llama", ckpt_root)
    monkeypatch.setenv("PORTATTN_ATTENTION_BACKEND", "no-such-backend")
    with pytest.raises(ValueError, match="expected an attention backend in"):
        LLM(path, num_pages=8, max_model_len=128)
    assert LLM(path, num_pages=8, max_model_len=128, attention_backend="torch").engine.backend.name == "torch"
    monkeypatch.setenv("PORTATTN_ATTENTION_BACKEND", "torch")
    assert LLM(path, num_pages=8, max_model_len=128).engine.backend.name == "torch"


def test_plan_once_per_forward_and_forward_once_per_layer(ckpt_root, monkeypatch):
    path = checkpoint("llama4", ckpt_root)
    llm = LLM(path, page_size=5, num_pages=64, max_model_len=320, chunked_prefill_size=12)
    backend = llm.engine.backend
    calls = {"plan": 0, "forward": 0, "steps": 0}
    plan, forward, step = backend.plan, backend.forward, llm.engine.step

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(backend, "plan", count("plan", plan))
    monkeypatch.setattr(backend, "forward", count("forward", forward))
    monkeypatch.setattr(llm.engine, "step", count("steps", step))
    monkeypatch.setattr(portattn.ops, "paged_attention", None)  # the engine must not go through it
    prompts = random_prompts([7, 30], seed=9)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert calls["plan"] == calls["steps"] > 0
    assert calls["forward"] == 4 * calls["steps"]  # four attention layers
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_reference(path, tuple(prompt), 10)[0]
