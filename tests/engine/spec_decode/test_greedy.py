"""Greedy decoding with speculation emits exactly plain greedy decoding's tokens, for every family at
page sizes 1 and 16: proposals that are right, wrong at one position or wrong at the first (an oracle
of the plain run), verified by forwards of k + 1 tokens per sequence, with logits within 1e-4 of the
plain decode's; rejected tokens' pages go back to the pool."""

from __future__ import annotations

import pytest

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.testing import engine_families, image_prompts
from tiny_models import checkpoint, random_prompts, rel_err

from ..test_interrupted_bookkeeping import assert_pools_consistent
from .helpers import NGRAM, use_oracle

MAX_TOKENS = 9
TOL = 1e-4


def prompts_for(family: str) -> list:
    prompts = random_prompts([2, 7, 19], seed=4, vocab=248)
    return [prompts[0], *image_prompts([prompts[1]]), prompts[2]] if family == "qwen2_5_vl" else prompts


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("family", engine_families())
def test_greedy_speculation_equals_plain_decoding(family, page_size, ckpt_root):
    llm = LLM(
        checkpoint(family, ckpt_root),
        page_size=page_size,
        num_pages=-(-200 // page_size),
        max_model_len=64,
        max_num_seqs=4,
        speculative_config=NGRAM,
    )
    spec = llm.engine.speculator
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, return_logits=True)
    prompts = prompts_for(family)
    spec.paused = True  # plain decoding, in the same engine
    want = llm.generate(prompts, params, use_tqdm=False)
    assert spec.stats.num_drafts == 0
    spec.paused = False
    oracle = use_oracle(llm, prompts, want)
    got = llm.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert rel_err(g.logits, w.logits) < TOL
    stats = spec.stats
    assert oracle.proposals == stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some runs accepted whole, some cut
    assert stats.accepted_per_pos[-1] > 0
    assert_pools_consistent(llm.engine)
    llm.engine.pages.clear_cache()  # (prefix caching is on by default)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages
