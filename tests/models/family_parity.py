"""The parity matrix that test_parity runs for every family (DeepSeek V3 and Qwen2.5-VL run variants of
it in their own modules): greedy tokens and logits of the engine equal transformers' own at page sizes 1, 7
and 16, with and without prefix caching and chunked prefill.

The tiny checkpoints' windows are 8 to 12 tokens: the prompts (1 to 37 tokens) and their 20 decoded
tokens cross them, and the chunks of 8 tokens cross them while prefilling.
"""

from __future__ import annotations

import pytest

from portattn.engine.llm import LLM
from tiny_models import ENGINE_DEVICE, random_prompts, worst_error_against_transformers

MAX_NEW = 20
PROMPTS = random_prompts([1, 5, 13, 30, 37])
# Second wave: repeats and extensions of the first wave's prompts, which hit the prefix cache.
SHARED = [PROMPTS[3], [*PROMPTS[4][:20], 7, 8, 9], [*PROMPTS[2], *range(1, 12)]]
TOL = 1e-4

MATRIX = pytest.mark.parametrize(
    "page_size, prefix, chunked",
    [
        pytest.param(p, prefix, chunked, id=f"p{p}-{('noprefix', 'prefix')[prefix]}-{('whole', 'chunked8')[chunked]}")
        for p in (1, 7, 16)
        for prefix in (False, True)
        for chunked in (False, True)
    ],
)


def make_llm(path: str, page_size: int, prefix: bool, chunked: bool, max_model_len: int = 256) -> LLM:
    return LLM(
        path,
        page_size=page_size,
        num_pages=-(-800 // page_size),
        max_model_len=max_model_len,
        max_num_seqs=8,
        enable_prefix_caching=prefix,
        chunked_prefill_size=8 if chunked else None,
        device=ENGINE_DEVICE,
    )


def assert_matches_transformers(path: str, page_size: int, prefix: bool, chunked: bool, max_model_len: int = 256):
    """Both waves of prompts: tokens equal, logits within ``TOL``; afterwards every page is back in
    the pool or held by the prefix cache alone. Returns the engine."""
    llm = make_llm(path, page_size, prefix, chunked, max_model_len)
    err = worst_error_against_transformers(llm, path, PROMPTS, MAX_NEW, prompt_logits=True)
    err = max(err, worst_error_against_transformers(llm, path, SHARED, MAX_NEW, prompt_logits=False))
    assert err < TOL
    cached = llm.engine.pages.num_cached_tokens
    if prefix:
        assert cached >= page_size * (len(PROMPTS[3]) // page_size)  # at least the repeated prompt's full pages
    else:
        assert cached == 0
    allocator = llm.engine.allocator
    assert allocator.num_used == len(llm.engine.pages.cache)
    assert all(allocator.ref_count(page) == 1 for page in llm.engine.pages.cache.values())
    return llm
