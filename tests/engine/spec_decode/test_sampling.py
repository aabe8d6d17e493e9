"""Sampled decoding with point-mass proposals (prompt lookup) emits plain sampled decoding's tokens:
a proposal is accepted iff the plain sampler, with the request's seed, draws it at that position, so
a seeded request gives the same tokens, log-probabilities and logits with and without speculation,
through every part of the sampler's processing (temperature, top-k, top-p, min-p, penalties,
allowed_token_ids, min_tokens bans, logits processors) and with n > 1 and best_of."""

from __future__ import annotations

import pytest
import torch

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from tiny_models import checkpoint, random_prompts, rel_err

from ..test_interrupted_bookkeeping import assert_pools_consistent
from .helpers import NGRAM, use_oracle

ALLOWED = tuple(random_prompts([40], seed=9)[0])


def late_bias(output_ids, logits):
    """A logits processor that depends on the output so far: favours token 7 after 4 tokens."""
    if len(output_ids) >= 4:
        logits = logits.clone()
        logits[7] += 3.0
    return logits


PARAMS = [
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=1, logprobs=3, max_tokens=10),
    SamplingParams(temperature=1.2, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, seed=2),
    SamplingParams(temperature=1.0, allowed_token_ids=ALLOWED, seed=3, logprobs=0, max_tokens=12),
    SamplingParams(temperature=0.7, logits_processors=[late_bias], min_tokens=6, stop_token_ids=[7], seed=4),
    SamplingParams(temperature=0.9, n=2, best_of=3, seed=5, max_tokens=8),
    SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=11, logprobs=2),
    SamplingParams(temperature=1.0, top_p=0.5, seed=6, max_tokens=12),  # the nucleus draw (no top_k)
]
PROMPTS = random_prompts([3, 8, 5, 12, 6, 9, 7], seed=6)
ENGINE = dict(page_size=4, num_pages=120, max_model_len=64, enable_prefix_caching=False)


def run(llm):
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason) for o in outs for c in o.outputs]


def test_seeded_sampling_with_point_mass_proposals_equals_plain_sampling(ckpt_root):
    # Without the prefix cache: every run computes the same forwards, so its floats repeat exactly.
    llm = LLM(checkpoint("llama", ckpt_root), **ENGINE, speculative_config=NGRAM)
    spec = llm.engine.speculator
    spec.paused = True
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    want = run(llm)
    assert want == [(c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason) for o in outs for c in o.outputs]
    spec.paused = False
    use_oracle(llm, PROMPTS, outs)  # n = 2 / best_of: the oracle knows the first choice's tokens only
    got = run(llm)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[3] for g in got] == [w[3] for w in want]
    for (_, g_lp, g_cum, _), (_, w_lp, w_cum, _) in zip(got, want):
        assert (g_lp is None) == (w_lp is None) and (g_cum is None) == (w_cum is None)
        if w_cum is not None:
            assert g_cum == pytest.approx(w_cum, abs=1e-4)
        for g_pos, w_pos in zip(g_lp or [], w_lp or [], strict=True):
            assert list(g_pos) == list(w_pos)  # the chosen token, then the top k, in order
            assert [v.rank for v in g_pos.values()] == [v.rank for v in w_pos.values()]
            assert [v.logprob for v in g_pos.values()] == pytest.approx([v.logprob for v in w_pos.values()], abs=1e-4)
    stats = spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_pools_consistent(llm.engine)


def test_seeded_sampling_is_reproducible_with_the_ngram_proposer(ckpt_root):
    llm = LLM(checkpoint("qwen3", ckpt_root), **ENGINE | {"page_size": 3}, speculative_config=NGRAM)
    prompts = [[5, 6, 7, 8] * 4, [9, 9, 9, 9, 9]]  # prompt lookup finds these
    params = SamplingParams(temperature=0.6, top_k=5, seed=11, max_tokens=16, ignore_eos=True, return_logits=True)
    first, second = (llm.generate(prompts, params, use_tqdm=False) for _ in range(2))
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert llm.engine.speculator.stats.num_accepted_tokens > 0
    llm.engine.speculator.paused = True
    plain = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in plain] == [o.token_ids for o in first]
    for p, f in zip(plain, first):
        assert p.logits.shape == f.logits.shape and rel_err(f.logits, p.logits) < 1e-4
    assert torch.equal(first[0].logits, second[0].logits)
    metrics = {m.name: m for m in llm.get_metrics()}
    stats = llm.engine.speculator.stats
    assert type(metrics["portattn:spec_decode_num_drafts"]).__name__ == "Counter"
    assert metrics["portattn:spec_decode_num_drafts"].value == stats.num_drafts > 0
    assert metrics["portattn:spec_decode_num_draft_tokens"].value == stats.num_draft_tokens
    assert metrics["portattn:spec_decode_num_accepted_tokens"].value == stats.num_accepted_tokens
    assert metrics["portattn:spec_decode_num_accepted_tokens_per_pos"].values == stats.accepted_per_pos
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert metrics["portattn:generation_tokens"].value == 3 * 2 * 16  # tokens emitted, not forwards run
