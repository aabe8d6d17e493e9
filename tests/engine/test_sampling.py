"""Sampling: filters against hand-computed sets, seeded determinism, frequencies, validation."""

from __future__ import annotations

import pytest
import torch

from portattn.engine.llm import LLM
from portattn.engine.sampler import filter_logits, sample
from portattn.engine.sampling_params import SamplingParams

from .conftest import checkpoint, hf_reference, random_prompts


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0, 1.0])
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_k=3)))
    assert kept.tolist() == [False, True, False, True, True]


def test_top_p_keeps_the_smallest_head_reaching_p():
    probs = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
    logits = probs.log()
    for top_p, want in [(0.4, [1]), (0.41, [1, 3]), (0.7, [1, 3]), (0.71, [1, 3, 4]), (1.0, [0, 1, 2, 3, 4])]:
        kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_p=top_p)))
        assert kept.nonzero().flatten().tolist() == want, top_p


def test_temperature_frequencies_follow_softmax():
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]]).repeat(4000, 1)
    params = [SamplingParams(temperature=2.0, seed=0)] * 4000
    gen = torch.Generator().manual_seed(0)
    tokens = torch.tensor(sample(logits, params, [gen] * 4000))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0] / 2.0, -1), atol=0.03)


def test_seeded_requests_do_not_depend_on_the_batch(ckpt_root):
    llm = LLM(checkpoint("qwen3", ckpt_root), page_size=16, num_pages=64)
    prompts = random_prompts([6, 11, 19], seed=3)
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    alone = llm.generate([prompts[1]], p, use_tqdm=False)[0].token_ids
    batched = llm.generate(prompts, [SamplingParams(max_tokens=5, temperature=1.0), p, p], use_tqdm=False)
    assert batched[1].token_ids == alone
    other = llm.generate([prompts[1]], SamplingParams(max_tokens=12, temperature=1.0, seed=124, ignore_eos=True))
    assert other[0].token_ids != alone
    greedy_k1 = llm.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=1.0, top_k=1, ignore_eos=True))
    assert greedy_k1[0].token_ids == hf_reference(llm.config.model, tuple(prompts[0]), 12)[0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=f"expected {match}"):
        SamplingParams(**kwargs)
