"""Uniform steps of q new tokens per sequence (q = k + 1 when speculative decoding verifies k drafted
tokens) through the static buffers and per-shape plans of captured decode, run eagerly on the CPU,
against the plain forward (eager, planned per step) of the same step: hidden states of every new
token at q = 1, 2 and 5, for MHA families with a chunk (Llama 4), a window and sinks (gpt-oss), and
for DeepSeek V3 (MLA: the captured plan attends every new token in the absorbed form, and so does
the plain plan; both are checked against the expanded form). The cache is NaN except where tokens
were written, the unused tail of every req_to_token row points at a NaN page, and the replayed
forward runs under a guard that fails on any device-to-host read."""

from __future__ import annotations

import pytest
import torch

from portattn.engine.graphs import uniform_q_len
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.testing import no_host_sync
from tiny_models import checkpoint, random_prompts, rel_err

PAGE_SIZE = 4
BUCKETS = (1, 2, 4)  # 3 sequences run padded to 4
# Around Llama 4's 32-token chunk and past gpt-oss's 8-token window, so that new tokens cross both.
PROMPTS = random_prompts([3, 9, 29, 14], seed=5)
ROUNDS = 3  # uniform steps per test; one sequence is aborted after the first
TOL = 1e-5


def poison(pool) -> None:
    for cache in [*getattr(pool, "k", []), *getattr(pool, "v", []), *getattr(pool, "latent", [])]:
        cache.fill_(float("nan"))


def point_tails_at(engine, seqs, junk_page: int) -> None:
    """Every req_to_token column past a sequence's pages: a slot of ``junk_page`` (NaN, never allocated)."""
    req_to_token, page_size = engine.req_pool.req_to_token, engine.kv_pool.page_size
    for seq in seqs:
        start = len(seq.pages) * page_size
        columns = torch.arange(start, req_to_token.shape[1], dtype=torch.int32)
        req_to_token[seq.req_pool_idx, start:] = junk_page * page_size + columns % page_size


@pytest.mark.parametrize("q_len", [1, 2, 5])
@pytest.mark.parametrize("family", ["llama4", "gpt_oss", "deepseek_v3"])
def test_uniform_steps_through_the_buffers_equal_the_plain_forward(family, q_len, ckpt_root):
    llm = LLM(checkpoint(family, ckpt_root), enforce_eager=True, page_size=PAGE_SIZE, num_pages=80, max_model_len=128)
    engine = llm.engine
    runner = engine.runner
    runner.uniform_q_lens = tuple(sorted({1, q_len}))  # what an engine that speculates k = q_len - 1 tokens sets
    poison(engine.kv_pool)
    graphs = runner.enable_graphs(BUCKETS, capture=False)
    graphs.capture_all()
    assert set(graphs.contexts) == {(b, q) for b in BUCKETS for q in runner.uniform_q_lens}
    replayed = graphs._forward

    def guarded(shape):
        with no_host_sync():
            return replayed(shape)

    graphs._forward = guarded
    junk_page = engine.allocator.num_pages - 1  # pages go out lowest first: this one never does here
    seqs = [engine.add_request(p, SamplingParams(max_tokens=64, ignore_eos=True)) for p in PROMPTS]
    while any(seq.num_computed < seq.num_prompt_tokens for seq in seqs):
        engine.step()
    gen = torch.Generator().manual_seed(q_len)
    for step in range(ROUNDS):
        running = list(engine.scheduler.running)
        for seq in running:  # drafted tokens: the step verifies q_len new tokens per sequence
            pending = seq.num_tokens - seq.num_computed
            seq.token_ids += torch.randint(0, engine.vocab_size, (q_len - pending,), generator=gen).tolist()
        scheduled = engine.scheduler.schedule()
        assert uniform_q_len(scheduled) == q_len and graphs.can_run(scheduled)
        point_tails_at(engine, running, junk_page)
        rows = list(range(len(scheduled) * q_len))

        batch, ctx = runner.plan(scheduled)
        want = runner.model(batch.input_ids, batch.positions, ctx)  # [n * q, H], planned per step
        if family == "deepseek_v3" and q_len > 1:  # the expanded form of the same attention
            assert ctx.cache_plan.varlen is None  # the plain plan absorbs decodes of q_len tokens too
            expanded = engine.kv_pool.plan(engine.backend, ctx.metadata, num_heads=runner.num_heads)
            assert expanded.decode is None
            ctx = type(ctx)(ctx.backend, ctx.metadata, ctx.kv_pool, expanded)
            assert rel_err(runner.model(batch.input_ids, batch.positions, ctx), want) < 1e-4
        replays = graphs.replays
        got = runner.forward(scheduled, rows)  # the logits of every new token, through the buffers
        assert graphs.replays == replays + 1
        assert not got.isnan().any()
        assert rel_err(got, runner.logits(want, rows)) < TOL
        for seq, n in scheduled:
            seq.num_computed += n
            engine.pages.commit(seq)
        if step == 0:
            engine.abort(seqs[1].request_id)  # 3 sequences: padded to the bucket of 4
    assert graphs.padded[3] == ROUNDS - 1
    assert junk_page in engine.allocator._free  # never handed out: its slots stayed NaN
    for seq in list(engine.scheduler.running):
        engine.abort(seq.request_id)


def test_a_step_of_mixed_lengths_or_an_uncaptured_length_runs_eagerly(ckpt_root):
    llm = LLM(checkpoint("llama", ckpt_root), enforce_eager=True, page_size=PAGE_SIZE, num_pages=60, max_model_len=128)
    runner = llm.engine.runner
    runner.uniform_q_lens = (1, 3)
    graphs = runner.enable_graphs((1, 2), capture=False)
    seqs = [llm.engine.add_request(p, SamplingParams(max_tokens=8)) for p in PROMPTS[:3]]
    assert graphs.can_run([(seqs[0], 3), (seqs[1], 3)]) and graphs.can_run([(seqs[0], 1)])
    assert not graphs.can_run([(seqs[0], 3), (seqs[1], 1)])  # not uniform
    assert not graphs.can_run([(seqs[0], 2), (seqs[1], 2)])  # 2 not captured
    assert not graphs.can_run([(seq, 1) for seq in seqs])  # more sequences than the largest bucket
    assert not graphs.can_run([])
    with pytest.raises(ValueError, match=r"expected uniform_q_lens of positive ints, got \(0,\)"):
        type(runner)(runner.model, runner.kv_pool, runner.req_pool, runner.backend, uniform_q_lens=(0,))
