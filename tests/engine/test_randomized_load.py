"""Randomized load, CI-sized: many requests with shared prefixes and mixed sampling through a pool
too small for them (admissions wait, decodes preempt, the prefix cache evicts, prompts are chunked,
some requests are aborted midway). Every request that finishes must equal the same request run
alone, the pools must stay consistent after every step, and a second run must repeat the first."""

from __future__ import annotations

import random

import pytest

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from tiny_models import checkpoint

from .test_interrupted_bookkeeping import assert_pools_consistent


def workload(seed: int, vocab: int = 256) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    bases = [[rng.randrange(vocab) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    requests = []
    for _ in range(12):
        prompt = rng.choice(bases)[: rng.randint(1, 14)] + [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        if rng.random() < 0.5:
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 9), ignore_eos=True)
        else:
            params = SamplingParams(
                max_tokens=rng.randint(1, 9),
                ignore_eos=True,
                temperature=rng.choice([0.6, 1.0, 1.3]),
                top_k=rng.choice([-1, 5, 40]),
                top_p=rng.choice([1.0, 0.9]),
                seed=rng.randrange(2**64),
            )
        requests.append((prompt or [1], params))
    return requests


def run_loaded(llm: LLM, requests, aborts: dict[int, int]) -> list[list[int] | None]:
    """All requests at once; ``aborts`` maps a step to the index of a request aborted then."""
    engine = llm.engine
    seqs = [engine.add_request(p, sp) for p, sp in requests]
    step = 0
    while engine.has_unfinished():
        victim = seqs[aborts[step]] if step in aborts else None
        if victim is not None and victim.request_id in engine.requests:
            engine.abort(victim.request_id)
        engine.step()
        assert_pools_consistent(engine)
        step += 1
    return [None if s.finish_reason == "abort" else s.output_token_ids for s in seqs]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_randomized_load_matches_each_request_alone(family, seed, ckpt_root):
    path = checkpoint(family, ckpt_root)
    requests = workload(seed)
    alone = LLM(path, page_size=4, num_pages=10, max_model_len=40, max_num_seqs=1)
    want = [alone.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in requests]
    rng = random.Random(seed)
    page_size = rng.choice([1, 3, 4, 7])
    loaded = LLM(
        path,
        page_size=page_size,
        num_pages=-(-40 // page_size) + 1,  # one long request and a page: most of the batch waits
        max_model_len=40,
        max_num_seqs=6,
        chunked_prefill_size=rng.choice([5, 16, None]),
        enable_prefix_caching=True,
    )
    aborts = {rng.randint(1, 12): rng.randrange(len(requests)) for _ in range(2)}
    got = run_loaded(loaded, requests, aborts)
    assert sum(g is None for g in got) <= 2
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is None or g == w, f"request {i} (page size {page_size})"
    assert loaded.engine.scheduler.num_preemptions > 0
    again = run_loaded(loaded, requests, {})  # warm prefix cache this time: the same tokens
    assert again == want
    loaded.engine.pages.clear_cache()
    assert loaded.engine.allocator.num_free == loaded.engine.allocator.num_pages
