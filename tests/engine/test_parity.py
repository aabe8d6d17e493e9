"""Greedy tokens and logits of the engine equal transformers' own, for every family, at page sizes
1, 7 and 16, with and without prefix caching and chunked prefill."""

from __future__ import annotations

import pytest

from portattn.engine.llm import LLM

from .conftest import ENGINE_DEVICE, FAMILIES, checkpoint, random_prompts, worst_error_against_transformers

MAX_NEW = 20
# Lengths 1, short, just below the Llama 4 chunk (32) and past it; decodes cross the chunk boundary.
PROMPTS = random_prompts([1, 5, 13, 30, 37])
# Second wave: repeats and extensions of the first wave's prompts, which hit the prefix cache.
SHARED = [PROMPTS[3], [*PROMPTS[4][:20], 7, 8, 9], [*PROMPTS[2], *range(1, 12)]]
TOL = 1e-4


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked8"])
@pytest.mark.parametrize("prefix", [False, True], ids=["noprefix", "prefix"])
@pytest.mark.parametrize("page_size", [1, 7, 16])
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers(family, page_size, prefix, chunked, ckpt_root):
    path = checkpoint(family, ckpt_root)
    llm = LLM(
        path,
        page_size=page_size,
        num_pages=-(-800 // page_size),
        max_model_len=800,
        max_num_seqs=8,
        enable_prefix_caching=prefix,
        chunked_prefill_size=8 if chunked else None,
        device=ENGINE_DEVICE,
    )
    err = worst_error_against_transformers(llm, path, PROMPTS, MAX_NEW, prompt_logits=True)
    err = max(err, worst_error_against_transformers(llm, path, SHARED, MAX_NEW, prompt_logits=False))
    assert err < TOL
    cached = llm.engine.pages.num_cached_tokens
    if prefix:
        assert cached >= page_size * (len(PROMPTS[3]) // page_size)  # at least the repeated prompt's full pages
    else:
        assert cached == 0
    # Every page is back in the pool, or held by the prefix cache alone.
    allocator = llm.engine.allocator
    assert allocator.num_used == len(llm.engine.pages.cache)
    assert all(allocator.ref_count(page) == 1 for page in llm.engine.pages.cache.values())
