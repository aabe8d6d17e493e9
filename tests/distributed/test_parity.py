"""Tensor parallelism over 2 CPU processes (gloo) computes what one process computes: greedy tokens
equal and logits within 1e-4 (relative to their largest) for every family, through chunked
prefill (chunks of 8 that cut prompts and an image), prefix caching and preemption (a pool too
small for the batch); and through the static decode path of captured graphs."""

from __future__ import annotations

import pytest

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.testing import save_tiny_fp8_checkpoint, save_tiny_mxfp4_checkpoint
from tiny_models import checkpoint, rel_err

from .conftest import DEVICE, FAMILIES, alive, generate, prompts, rank_pids
from .static_decode import (
    cascade_from_two_sequences,
    enable_static_decode,
    fewest_cascade_steps,
    graph_samples,
    static_replays,
)

MAX_NEW = 8
TOL = 1e-4
# quantization="fp8" against the unquantized model, worst relative error of the prompt logits (tiny llama,
# random weights): one process 0.42, two ranks 0.38 (two ranks against one: 0.18).
FP8_TP_FACTOR = 1.5


def make_llm(path: str, tp: int) -> LLM:
    # 7-token pages, 8 of them: the four sequences (2 + 2 + 3 + 6 pages at their ends) do not fit at once.
    return LLM(
        path,
        page_size=7,
        num_pages=8,
        max_model_len=56,
        max_num_seqs=4,
        chunked_prefill_size=8,
        enable_prefix_caching=True,
        tensor_parallel_size=tp,
        device=DEVICE,
    )


def run(llm: LLM, family: str):
    first = prompts(family)
    second = [first[3], [*first[3][:20], 3, 1, 4]]  # a repeat and an extension: prefix-cache hits
    return generate(llm, first, MAX_NEW, prompt_logits=True) + generate(llm, second, MAX_NEW, prompt_logits=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_equals_tp1(family, ckpt_root):
    path = checkpoint(family, ckpt_root)
    one = make_llm(path, 1)
    want = run(one, family)
    with make_llm(path, 2) as two:
        pids = rank_pids(two)
        got = run(two, family)
        engine = two.engine
        assert engine.scheduler.num_preemptions > 0
        assert engine.pages.num_cached_tokens > 0
        assert engine.scheduler.num_preemptions == one.engine.scheduler.num_preemptions
    assert not any(alive(pid) for pid in pids)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert rel_err(g.logits, w.logits) < TOL
        if w.prompt_logits is not None:
            assert rel_err(g.prompt_logits, w.prompt_logits) < TOL


@pytest.mark.parametrize("intermediate", [32, 64], ids=["down-cuts-groups", "down-whole-groups"])
def test_tp2_mxfp4_experts_equal_tp1(intermediate, tmp_path):
    path = save_tiny_mxfp4_checkpoint(tmp_path / "ckpt", intermediate_size=intermediate)
    want = run(make_llm(path, 1), "gpt_oss")
    with make_llm(path, 2) as two:
        got = run(two, "gpt_oss")
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert rel_err(g.logits, w.logits) < TOL


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "qwen3_moe"])
def test_tp2_fp8_weights_equal_tp1(family, tmp_path):
    """Each rank dequantizes only its rows or columns, with the scale blocks they fall in (blocks of
    16 x 24: a rank's 32 columns start inside a block)."""
    fp8, _ = save_tiny_fp8_checkpoint(family, tmp_path, block=(16, 24))
    want = run(make_llm(fp8, 1), family)
    with make_llm(fp8, 2) as two:
        got = run(two, family)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert rel_err(g.logits, w.logits) < TOL


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "gpt_oss", "gemma2"])
def test_tp2_static_decode_equals_tp1(family, ckpt_root):
    """Decode through the static buffers that captured graphs replay (run eagerly here), on every rank."""
    path = checkpoint(family, ckpt_root)
    one = make_llm(path, 1)
    one.engine.call(enable_static_decode)
    want = run(one, family)
    with make_llm(path, 2) as two:
        two.engine.call(enable_static_decode)
        got = run(two, family)
        assert two.engine.call(static_replays) > 0
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert rel_err(g.logits, w.logits) < TOL


def test_tp2_decode_samples_in_the_graph_as_tp1(ckpt_root):
    """Decode steps whose requests only draw (greedy, seeded top-p) sample from the graph's logits, the
    LM head's gather among them, on every rank's static path: the tokens are one process's."""
    path = checkpoint("llama", ckpt_root)
    batch = prompts("llama")
    params = [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.8, top_p=0.9, seed=i) for i in range(3)]
    params.append(SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0))
    one = make_llm(path, 1)
    one.engine.call(enable_static_decode)
    want = [o.token_ids for o in one.generate(batch, params, use_tqdm=False)]
    with make_llm(path, 2) as two:
        two.engine.call(enable_static_decode)
        got = [o.token_ids for o in two.generate(batch, params, use_tqdm=False)]
        assert two.engine.call(graph_samples) > 0
    assert got == want


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_tp2_cascade_steps_equal_tp1_without(family, ckpt_root):
    """Rank 0 decides which steps cascade (the other ranks' mirrors hold no page lists) and every rank
    attends through the cascade it sends; the outputs are one process's plain ones."""
    path = checkpoint(family, ckpt_root)
    prefix = prompts(family)[3][:28]  # four whole 7-token pages
    batch = [[*prefix, 7], [*prefix, 5, 9], [*prefix, 2]]

    def shared_run(llm):
        generate(llm, [prefix], 1, prompt_logits=False)  # its pages enter the prefix cache
        return generate(llm, batch, MAX_NEW, prompt_logits=False)

    kwargs = dict(page_size=7, num_pages=40, max_model_len=56, max_num_seqs=4, device=DEVICE)
    want = shared_run(LLM(path, enable_cascade_attn=False, **kwargs))
    with LLM(path, tensor_parallel_size=2, enable_cascade_attn=True, **kwargs) as two:
        two.engine.call(cascade_from_two_sequences)
        got = shared_run(two)
        assert two.engine.call(fewest_cascade_steps) == MAX_NEW - 1
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert rel_err(g.logits, w.logits) < TOL


def test_tp2_fp8_linears_agree_with_tp1(ckpt_root):
    """``quantization="fp8"`` on two ranks: a column-parallel rank's rows carry the scales one process gives
    them, a row-parallel rank scales its columns and its part of each input on its own (no extra
    all-reduce), so the values differ from one process's within fp8's precision. Against the unquantized
    model, two ranks' prompt logits are as close as one process's (within a factor from a measurement,
    printed); a rank that read or scaled its shard wrong would be off by the logits' size."""
    path = checkpoint("llama", ckpt_root)

    def make(tp: int, quantization: str | None = "fp8") -> LLM:
        return LLM(path, page_size=7, num_pages=64, max_model_len=56, max_num_seqs=4, tensor_parallel_size=tp,
                   device=DEVICE, quantization=quantization)  # fmt: skip

    exact = generate(make(1, None), prompts("llama"), MAX_NEW, prompt_logits=True)
    one = generate(make(1), prompts("llama"), MAX_NEW, prompt_logits=True)
    with make(2) as two:
        assert two.engine.model.model.layers[0].mlp.down_proj.weight_scale is not None
        got = generate(two, prompts("llama"), MAX_NEW, prompt_logits=True)
    err_one = max(rel_err(o.prompt_logits, e.prompt_logits) for o, e in zip(one, exact))
    err_two = max(rel_err(g.prompt_logits, e.prompt_logits) for g, e in zip(got, exact))
    between = max(rel_err(g.prompt_logits, o.prompt_logits) for g, o in zip(got, one))
    print(f"fp8 prompt logits' worst relative error: tp1 {err_one:.4f}, tp2 {err_two:.4f}, tp2 vs tp1 {between:.4f}")
    assert err_two < FP8_TP_FACTOR * err_one and between > 0
