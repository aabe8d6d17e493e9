"""Randomized load with speculation: many requests with shared prefixes and mixed sampling through a
pool too small for them (admissions wait, decodes preempt, the prefix cache evicts, prompts are
chunked by the token budget, requests are aborted midway). The target's and the draft's pools stay
consistent after every step, nothing is held once the requests are gone, and each finished request
equals the same request run alone without speculation (every request with point-mass proposals, here
an oracle's that are right, partly right or wrong; the greedy ones with a draft model)."""

from __future__ import annotations

import random

import pytest

from portattn.engine.llm import LLM
from portattn.engine.page_manager import sequence_page_key
from tiny_models import checkpoint

from ..test_interrupted_bookkeeping import assert_pools_consistent
from ..test_randomized_load import workload
from .helpers import OracleProposer, assert_draft_pools_consistent

SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 3}, "draft_model": {"num_speculative_tokens": 2}}


def assert_cached_pages_verified(engine) -> None:
    """Every page a running sequence committed to the prefix cache holds its verified tokens: its key
    is the chain over the tokens the sequence has now, and its tokens are computed."""
    size = engine.pages.page_size
    for seq in engine.scheduler.running:
        assert len(seq.page_hashes) * size <= seq.num_computed
        parent = b""
        for p, key in enumerate(seq.page_hashes):
            parent = sequence_page_key(seq, parent, p, size)
            assert key == parent


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_randomized_load_with_aborts_leaks_nothing(method, ckpt_root):
    path = checkpoint("llama", ckpt_root)
    requests = workload(6)
    alone = LLM(path, page_size=4, num_pages=10, max_model_len=40, max_num_seqs=1)
    want = [alone.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in requests]
    spec = SPECS[method] | ({"model": path} if method == "draft_model" else {})
    llm = LLM(
        path,
        page_size=3,
        num_pages=14,
        max_model_len=40,
        max_num_seqs=6,
        chunked_prefill_size=12,
        enable_prefix_caching=True,
        speculative_config=spec,
    )
    engine = llm.engine
    draft = engine.speculator.proposer if method == "draft_model" else None
    rng = random.Random(3)
    aborts = {rng.randint(1, 15): rng.randrange(len(requests)) for _ in range(3)}
    seqs = [engine.add_request(p, sp) for p, sp in requests]
    if draft is None:
        by_id = {seq.request_id: w for seq, w in zip(seqs, want)}
        engine.speculator.proposer = OracleProposer(by_id, engine.vocab_size, key=lambda seq: seq.request_id)
    step = 0
    while engine.has_unfinished():
        victim = seqs[aborts[step]] if step in aborts else None
        if victim is not None and victim.request_id in engine.requests:
            engine.abort(victim.request_id)
        engine.step()
        assert_pools_consistent(engine)
        assert_cached_pages_verified(engine)
        if draft is not None:
            assert_draft_pools_consistent(draft)
            assert set(draft.shadows) <= {seq.request_id for seq in engine.scheduler.running}
        step += 1
    assert engine.scheduler.num_preemptions > 0
    stats = engine.speculator.stats
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    if draft is None:
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # the oracle is wrong at times
    aborted = [s.finish_reason == "abort" for s in seqs]
    assert 0 < sum(aborted) <= 3
    for i, (seq, (_, params), w) in enumerate(zip(seqs, requests, want)):
        if not aborted[i] and (method == "ngram" or params.greedy):
            assert seq.output_token_ids == w, f"request {i}"
        assert not seq.num_draft_tokens and len(seq.output_token_ids) <= params.max_tokens
    engine.speculator.paused = True  # plain decoding over the pages the speculative run cached
    assert engine.pages.cache
    again = [llm.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in requests if sp.greedy]
    assert again == [w for (_, sp), w in zip(requests, want) if sp.greedy]
    engine.pages.clear_cache()
    assert engine.allocator.num_free == engine.allocator.num_pages
    if draft is not None:
        assert not draft.shadows
        draft.pages.clear_cache()
        assert draft.allocator.num_free == draft.allocator.num_pages
