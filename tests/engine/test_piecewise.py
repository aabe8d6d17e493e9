"""Eager steps in pieces (``engine/piecewise.py``): steps of prompt chunks and of decodes beside a chunk,
run over static inputs padded to a token bucket with attention launched from each step's plan, against
the same requests run plainly: greedy tokens equal and logits within float32 rounding, for every
family whose forward reads the plan only inside attention (windows, softcap, sinks-free local layers,
page size 4, chunks and buckets of awkward sizes), with no read of a device value inside the forward
(a capture could not hold one). On the CPU the pieces run eagerly (no capture);
``test_piecewise_gpu.py`` captures them. A forward that reads more of the plan is refused per
bucket, and models that cannot run in pieces are named."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from portattn.device import is_triton_interpreter
from portattn.engine.llm import LLM
from portattn.engine.piecewise import NotPiecewise, unsupported
from portattn.engine.sampling_params import SamplingParams
from portattn.testing import no_host_sync
from tiny_models import checkpoint, random_prompts, rel_err

FAMILIES = ["llama", "qwen3", "mistral", "phi3", "gemma2", "gemma3"]
# Around the 4-token pages and the buckets: one token, a page, a bucket exactly, a bucket plus one.
PROMPTS = random_prompts([1, 4, 8, 9, 23, 30], seed=11)
BUCKETS = (4, 8, 16)  # steps of 17-20 tokens (the budget) run plainly


def generate(path: str, piecewise: bool, **kwargs) -> tuple[list, object]:
    llm = LLM(path, enforce_eager=True, page_size=4, num_pages=96, max_model_len=128, max_num_batched_tokens=20,
              max_num_seqs=4, **kwargs)  # fmt: skip
    pieces = None
    if piecewise:
        pieces = llm.engine.runner.enable_piecewise(capture=False, token_buckets=BUCKETS)
        pieces.capture_all()
        forward = pieces._forward

        def guarded(bucket, ctx):  # a capture could not hold a read of a device value
            with no_host_sync():
                return forward(bucket, ctx)

        pieces._forward = guarded
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, return_logits=True)
    return llm.generate(PROMPTS, params, use_tqdm=False), pieces


@pytest.mark.parametrize("family", FAMILIES)
def test_steps_in_pieces_equal_plain_steps(family, ckpt_root):
    path = checkpoint(family, ckpt_root)
    want, _ = generate(path, piecewise=False)
    got, pieces = generate(path, piecewise=True)
    assert sorted(pieces.pieces) == list(BUCKETS) and not pieces.skipped
    assert pieces.steps >= 10  # prompt chunks and mixed steps of up to 16 tokens went through the pieces
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert not a.outputs[0].logits.isnan().any()
        assert rel_err(a.outputs[0].logits, b.outputs[0].logits) < 1e-5


@pytest.mark.skipif(not is_triton_interpreter(), reason="the CPU engine runs Triton only under its interpreter")
def test_steps_in_pieces_equal_plain_steps_on_the_triton_backend(ckpt_root):
    """The GPU's backend: mixed steps launched in two parts, each layer's launch repeated from the plan."""
    path = checkpoint("llama", ckpt_root)
    want, _ = generate(path, piecewise=False, attention_backend="triton")
    got, pieces = generate(path, piecewise=True, attention_backend="triton")
    assert pieces.backend.name == "triton" and pieces.steps >= 10
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert rel_err(a.outputs[0].logits, b.outputs[0].logits) < 1e-5


def test_the_pieces_attend_only_the_steps_rows(ckpt_root, monkeypatch):
    """A hole given the bucket's padding rows too would attend them with a plan of fewer rows: the rows
    of a step are the first n of each hole (sabotage: the whole bucket fails)."""
    path = checkpoint("llama", ckpt_root)
    want, _ = generate(path, piecewise=False)
    from portattn.engine import piecewise as module

    real_write = module.PiecewiseGraphs._write

    def write_then_shift(self, bucket, batch=None):  # the step's ids one row late: row 0 is padding
        real_write(self, bucket, batch)
        if batch is not None:
            n = batch.input_ids.shape[0]
            self.inputs[:, 1 : n + 1] = self.inputs[:, :n].clone()

    monkeypatch.setattr(module.PiecewiseGraphs, "_write", write_then_shift)
    got, _ = generate(path, piecewise=True)
    assert any(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(got, want))


def test_a_forward_that_reads_the_plan_outside_attention_runs_eagerly(ckpt_root, caplog):
    llm = LLM(checkpoint("llama", ckpt_root), enforce_eager=True, page_size=4, num_pages=64, max_model_len=64)
    runner = llm.engine.runner
    model, forward = runner.model, runner.model.forward

    def reads_the_plan(ids, positions, ctx):
        ctx.metadata.max_seqlen_q  # noqa: B018 - a per-step host int: a graph would freeze it
        return forward(ids, positions, ctx)

    model.forward = reads_the_plan
    pieces = runner.enable_piecewise(capture=False, token_buckets=(8,))
    with caplog.at_level(logging.INFO, logger="portattn"):
        pieces.capture_all()
    assert pieces.pieces == {} and "max_seqlen_q" in pieces.skipped[8]
    assert any("steps of up to 8 tokens run eagerly" in r.getMessage() for r in caplog.records)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2 and pieces.steps == 0
    with pytest.raises(NotPiecewise, match="'q_lens' outside attention"):
        pieces._context(8).metadata.q_lens  # noqa: B018


def test_models_that_cannot_run_in_pieces_say_why(ckpt_root, caplog):
    llm = LLM(checkpoint("qwen2_moe", ckpt_root), enforce_eager=True, page_size=4, num_pages=64, max_model_len=64)
    assert unsupported(llm.engine.runner.model) == "routed experts"
    with pytest.raises(ValueError, match="got one with routed experts"):
        llm.engine.runner.enable_piecewise(capture=False)
    dense = LLM(checkpoint("llama", ckpt_root), enforce_eager=True, max_model_len=64)
    assert unsupported(dense.engine.runner.model) is None
    with caplog.at_level(logging.WARNING, logger="portattn"):
        LLM(checkpoint("llama", ckpt_root), max_model_len=64, piecewise_graphs=True)
    if not torch.cuda.is_available():
        said = "piecewise_graphs=True but eager steps run eagerly: torch has no graphs for device type 'cpu'"
        assert any(said in r.getMessage() for r in caplog.records)


def test_token_buckets_are_checked(ckpt_root):
    runner = LLM(checkpoint("llama", ckpt_root), enforce_eager=True, max_model_len=64).engine.runner
    for bad in ((), (0, 8), (8.0,)):
        with pytest.raises(ValueError, match="expected positive token buckets"):
            runner.enable_piecewise(capture=False, token_buckets=bad)


def test_buckets_follow_the_token_budget_and_their_memory_is_counted(ckpt_root):
    from portattn.engine.piecewise import TOKEN_BUCKETS, buckets_for, memory_estimate

    assert buckets_for(8192) == TOKEN_BUCKETS == buckets_for(512) and buckets_for(256) == (32, 64, 128, 256)
    # A budget between two buckets is the last one: no step up to the budget runs eagerly.
    assert buckets_for(192) == (32, 64, 128, 192) and buckets_for(100) == (32, 64, 100) and buckets_for(8) == (8,)
    # piecewise_max_tokens: doubling from 1024 up to it (or the budget, if smaller), then that bound itself.
    assert buckets_for(8192, 2048) == (*TOKEN_BUCKETS, 1024, 2048) and buckets_for(8192, 300) == (32, 64, 128, 256, 300)
    assert buckets_for(3000, 8192) == (*TOKEN_BUCKETS, 1024, 2048, 3000) and buckets_for(2048, 1500) == (
        *TOKEN_BUCKETS, 1024, 1500)  # fmt: skip
    model = LLM(checkpoint("llama", ckpt_root), enforce_eager=True, max_model_len=64).engine.runner.model
    specs = model.attention_specs()
    per_token = sum(s.num_heads * (s.head_dim + s.v_head_dim) for s in specs)  # a hole's q and out, per layer
    assert memory_estimate(model, (32, 64), 2, activations=1000, budget=128) == 96 * per_token * 2 + 500
    assert memory_estimate(model, (32,), 4, activations=1000, budget=16) == 32 * per_token * 4 + 1000


def test_the_engine_asks_before_its_pool_and_runner_exist(ckpt_root, monkeypatch):
    """The memory estimate is made before the KV pool and the runner exist: the reason must not need them."""
    import portattn.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "graph_support", lambda device: "cuda")  # as on a GPU
    for family, want in (("llama", None), ("qwen2_moe", "routed experts")):
        engine = LLM(checkpoint(family, ckpt_root), enforce_eager=True, max_model_len=64).engine
        monkeypatch.delattr(engine, "runner")
        monkeypatch.delattr(engine, "kv_pool")
        assert engine._piecewise_reason(None, kv_pool=False) == want
        assert engine._piecewise_reason("enforce_eager", kv_pool=False) == "enforce_eager"


def test_a_failed_capture_says_how_to_run_without_pieces(ckpt_root, monkeypatch):
    runner = LLM(checkpoint("llama", ckpt_root), enforce_eager=True, max_model_len=64).engine.runner
    pieces = runner.enable_piecewise(capture=False, token_buckets=(8,))
    pieces.capture = True  # as on a GPU, where a capture can fail on the device

    def failing(bucket):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(pieces, "_capture", failing)
    with pytest.raises(RuntimeError, match=r"8-token steps failed \(RuntimeError: operation not perm.*--piecewise"):
        pieces.capture_all()


def test_piecewise_max_tokens_takes_longer_steps_into_pieces(ckpt_root, monkeypatch):
    """``piecewise_max_tokens=1024`` with a budget of 2048: the engine's buckets run up to 1024 tokens, and a
    700-token prompt's step replays the 1024-token pieces (run eagerly on the CPU) with the plain engine's
    logits; a bad value is refused naming the flag."""
    import portattn.engine.engine as engine_module
    from portattn.engine.model_runner import ModelRunner
    from portattn.engine.piecewise import PiecewiseGraphs

    enable, run, ran = ModelRunner.enable_piecewise, PiecewiseGraphs.run, []

    def enabled(self, *, capture, token_buckets):  # as on a GPU, without the capture
        return enable(self, capture=False, token_buckets=token_buckets)

    def running(self, batch, ctx):
        ran.append(self.bucket(batch.input_ids.shape[0]))
        return run(self, batch, ctx)

    monkeypatch.setattr(ModelRunner, "enable_piecewise", enabled)
    monkeypatch.setattr(PiecewiseGraphs, "run", running)
    monkeypatch.setattr(engine_module.Engine, "_piecewise_reason", lambda self, reason, kv_pool=True: None)
    path = checkpoint("llama", ckpt_root)
    options = dict(max_model_len=1024, max_num_batched_tokens=2048, num_pages=128, page_size=16)
    llm = LLM(path, piecewise_graphs=True, piecewise_max_tokens=1024, **options)
    assert llm.engine.runner.piecewise.buckets == (32, 64, 128, 256, 512, 1024)
    prompt = random_prompts([700], seed=3)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, return_prompt_logits=True)
    ran.clear()
    got = llm.generate(prompt, params, use_tqdm=False)[0]
    assert ran == [1024]
    want = LLM(path, **options).generate(prompt, params, use_tqdm=False)[0]
    assert got.token_ids == want.token_ids
    assert float((got.prompt_logits - want.prompt_logits).abs().max()) <= 1e-5 * float(want.prompt_logits.abs().max())
    with pytest.raises(ValueError, match=r"piecewise_max_tokens \(--piecewise-max-tokens\) to be a positive int"):
        LLM(path, piecewise_graphs=True, piecewise_max_tokens=0, **options)
    with pytest.raises(ValueError, match=r"expected piecewise_graphs \(--piecewise-graphs\) with piecewise_max_tok"):
        LLM(path, piecewise_max_tokens=1024, **options)  # it would do nothing
    for config in (llm.engine.config, LLM(path, **options).engine.config):  # as tensor-parallel ranks remake it
        assert dataclasses.replace(config, device=config.device) == config
