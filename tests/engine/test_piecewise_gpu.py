"""Captured pieces on a GPU (``engine/piecewise.py``, ``piecewise_graphs=True``): prompt chunks and
mixed steps of up to 64 tokens (and, with ``piecewise_max_tokens``, of 1024 and 2048) replay one graph per
layer boundary with attention launched between them, against the same requests without pieces: greedy
tokens equal, logits close (float32, so that the padded steps' projections round alike). And an eager step
launched ahead (async scheduling) waits for nothing on the device. Needs ``PORTATTN_TEST_ENGINE_DEVICE=cuda``."""

from __future__ import annotations

import pytest
import torch

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from tiny_models import ENGINE_DEVICE, checkpoint, random_prompts, rel_err, scheduled_token_counts

pytestmark = pytest.mark.skipif(
    ENGINE_DEVICE != "cuda" or not torch.cuda.is_available(),
    reason="captures CUDA graphs (PORTATTN_TEST_ENGINE_DEVICE=cuda)",
)

PROMPTS = random_prompts([1, 31, 32, 33, 70, 100], seed=4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_captured_pieces_equal_plain_steps(family, ckpt_root):
    path = checkpoint(family, ckpt_root)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, return_logits=True)
    outs, engines = {}, {}
    for piecewise in (False, True):
        llm = LLM(path, device="cuda", dtype="float32", page_size=16, max_model_len=256, max_num_seqs=8,
                  num_pages=200, max_num_batched_tokens=64, piecewise_graphs=piecewise)  # fmt: skip
        outs[piecewise] = llm.generate(PROMPTS, params, use_tqdm=False)
        engines[piecewise] = llm.engine
    pieces = engines[True].runner.piecewise
    assert engines[False].runner.piecewise is None
    assert sorted(pieces.pieces) == [32, 64] and not pieces.skipped
    num_layers = len(engines[True].runner.model.attention_specs())
    for graphs, holes, _ in pieces.pieces.values():  # one graph before each layer's attention, one after the last
        assert len(graphs) == num_layers + 1 and len(holes) == num_layers
    assert pieces.steps >= 4
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert rel_err(a.outputs[0].logits, b.outputs[0].logits) < 1e-4


def test_captured_pieces_in_bfloat16_take_the_fused_rotary_write(ckpt_root):
    """bf16, where the Triton backend fuses the rotation with the cache write (the serving path): the
    first token's logits of each request within bf16 rounding of the plain steps' (the pieces' projections
    run over the padded bucket, so their rounding may differ; wrong rows or a stale plan differ wholly)."""
    path = checkpoint("llama", ckpt_root)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, return_logits=True)
    outs = {}
    for piecewise in (False, True):
        llm = LLM(path, device="cuda", dtype="bfloat16", page_size=16, max_model_len=256, max_num_seqs=8,
                  num_pages=200, max_num_batched_tokens=64, piecewise_graphs=piecewise)  # fmt: skip
        outs[piecewise] = llm.generate(PROMPTS, params, use_tqdm=False)
        if piecewise:
            assert llm.engine.runner.piecewise.steps >= 4
    for a, b in zip(outs[True], outs[False]):
        assert rel_err(a.outputs[0].logits.float(), b.outputs[0].logits.float()) < 2e-2


@pytest.mark.parametrize("piecewise", [False, True], ids=["eager", "pieces"])
def test_an_eager_step_is_launched_without_waiting_for_the_device(piecewise, ckpt_root):
    """``ModelRunner.launch`` (an eager step that async scheduling launches before its tokens are read)
    queues the forward, the sampling and the tokens' copy to the host without waiting for the device:
    behind a kernel that keeps the device busy for about a second, the launch returns with the copy's
    event still pending (a copy from pageable memory on the way, such as a list made a device tensor,
    would have waited for the kernel). The tokens read then equal a synchronous engine's."""
    path = checkpoint("llama", ckpt_root)
    kwargs = dict(device="cuda", dtype="float32", page_size=16, num_pages=80, max_model_len=256, max_num_seqs=8,
                  max_num_batched_tokens=64, piecewise_graphs=piecewise)  # fmt: skip
    prompts = random_prompts([5, 17, 30], seed=3)
    params = [
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=2),
    ]
    want = LLM(path, async_scheduling=False, **kwargs).generate(prompts, params, use_tqdm=False)
    engine = LLM(path, **kwargs).engine
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    scheduled = engine.scheduler.schedule()  # the three prompts in one eager step
    runner = engine.runner
    rows = runner.logit_rows(scheduled)
    assert len(scheduled) == 3 and runner.defers(rows)
    pieces_before = runner.piecewise.steps if piecewise else None
    torch.cuda._sleep(2_000_000_000)  # about a second of the device's clock
    started = runner.launch(scheduled, rows)
    pending = not started.copy.event.query()
    sampled = runner.sampled(started)
    assert pending, "the launch waited for the device"
    assert (runner.piecewise is None) != piecewise
    if piecewise:
        assert runner.piecewise.steps == pieces_before + 1  # the step ran through the pieces
    for seq, out in zip(seqs, want):
        tokens, logprobs = sampled[seq]
        assert tokens == out.outputs[0].token_ids
        assert (logprobs is None) == (out.outputs[0].logprobs is None)
        if logprobs is not None:  # the chosen token and the top two, as the synchronous engine reports them
            assert {logprobs[0].token_id, *logprobs[0].top_ids} == set(out.outputs[0].logprobs[0])


def test_captured_pieces_of_a_thousand_tokens_and_more_equal_plain_steps(ckpt_root):
    """``piecewise_max_tokens=2048`` (the burst's token budget): captured pieces of 1024 and 2048 tokens, a
    700-token prompt in the 1024-token pieces and two 900-token prompts together in the 2048-token ones, their
    prompt logits against the plain engine's (float32) and the greedy tokens equal."""
    path = checkpoint("llama", ckpt_root)
    options = dict(device="cuda", dtype="float32", page_size=16, max_model_len=1024, max_num_seqs=4, num_pages=256,
                   max_num_batched_tokens=2048)  # fmt: skip
    prompts = random_prompts([700, 900, 900], seed=5)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, return_prompt_logits=True)
    llm = LLM(path, piecewise_graphs=True, piecewise_max_tokens=2048, **options)
    pieces = llm.engine.runner.piecewise
    assert pieces.buckets[-2:] == (1024, 2048) and not pieces.skipped and {1024, 2048} <= set(pieces.pieces)
    got = [llm.generate(prompts[:1], params, use_tqdm=False)[0]]  # 700 tokens: the 1024-token pieces
    steps = pieces.steps
    got += llm.generate(prompts[1:], params, use_tqdm=False)  # 1800 tokens in one step: the 2048-token pieces
    assert pieces.steps > steps
    plain = LLM(path, **options)
    want = plain.generate(prompts[:1], params, use_tqdm=False) + plain.generate(prompts[1:], params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert rel_err(a.prompt_logits, b.prompt_logits) < 1e-4


def test_capped_prompt_chunks_through_pieces_ahead_equal_plain_steps(ckpt_root):
    """``long_prefill_token_threshold=8`` with captured pieces and asynchronous scheduling (prompts of up to 100
    tokens in chunks of 8 beside running decodes, launched ahead) gives the greedy tokens of a synchronous engine
    without pieces or a cap; no eager step computes more than 8 tokens of one prompt."""
    path = checkpoint("llama", ckpt_root)
    options = dict(device="cuda", dtype="float32", page_size=16, max_model_len=256, max_num_seqs=8, num_pages=200,
                   max_num_batched_tokens=64)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = LLM(path, async_scheduling=False, **options).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(path, piecewise_graphs=True, long_prefill_token_threshold=8, **options)
    with scheduled_token_counts() as chunks:
        got = llm.generate(PROMPTS, params, use_tqdm=False)
    engine = llm.engine
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert max(chunks) == 8 and engine.runner.piecewise.steps > 0
    assert engine.run_ahead is not None and engine.run_ahead.eager_ahead > 0
