"""Speculative decoding under tensor parallelism (2 CPU processes, gloo): rank 0 proposes (prompt
lookup, or a draft model run unsharded on rank 0) and verifies; every rank runs the k + 1 tokens
of each verification. Greedy tokens equal one process's plain decoding, through chunked prefill,
prefix caching and preemption."""

from __future__ import annotations

import pytest

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from tiny_models import checkpoint

from .conftest import DEVICE, alive, rank_pids

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6] * 2, [7, 7, 7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]
ENGINE = dict(page_size=5, num_pages=8, max_model_len=40, max_num_seqs=3, chunked_prefill_size=8)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tp2_speculation_equals_plain_decoding(method, ckpt_root):
    path = checkpoint("qwen3_moe", ckpt_root)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in LLM(path, **ENGINE).generate(PROMPTS, params, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method == "draft_model":
        spec = {"model": path, "num_speculative_tokens": 3}
    with LLM(
        path, tensor_parallel_size=2, device=DEVICE, enable_prefix_caching=True, speculative_config=spec, **ENGINE
    ) as llm:
        pids = rank_pids(llm)
        assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want
        assert llm.engine.scheduler.num_preemptions > 0
        for _ in range(2):  # the second time from the prefix cache
            assert llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].token_ids == want[0]
        assert llm.engine.pages.num_cached_tokens > 0
        assert llm.engine.speculator.stats.num_accepted_tokens > 0
    assert not any(alive(pid) for pid in pids)
