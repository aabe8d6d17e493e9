"""Captured decode graphs on a GPU against the eager engine on the same GPU (skipped where torch has no
graphs for the device): every family, page sizes 1 and 16, batches between buckets, after preemption
and with prefix caching. float32: equal greedy tokens and logits within 1e-4; bfloat16: logits within
bf16 tolerance and equal greedy tokens up to a near tie of the eager logits (where the two may round
differently: a graph plan fixes the split-KV count per bucket, an eager one per step). Models that route
each token to experts, in bfloat16: each greedy token among the other side's five most likely up to
the first difference, since a rounding difference that flips one expert choice moves the logits beyond
bf16's tolerance (qwen3_moe: 5.9e-2 with the same tokens, where the same buffers run eagerly on the CPU
give equal logits and float32 on the GPU agrees within 1e-4).

Run by ``scripts/gpu.sh "test engine"`` (``PORTATTN_TEST_ENGINE_DEVICE=cuda``), in three parts that each fit
150 s on one H200 with 8 workers (the ids of the family cells carry their group, :data:`GROUPS`)::

    bash scripts/gpu.sh "test engine -- -k 'graphs_gpu and dense'" \\
        "test engine -- -k 'graphs_gpu and moe'" "test engine -- -k 'graphs_gpu and not dense and not moe'"

Page sizes 1 and 16 run in float32 for one family of each attention kind; the other cells run at page
16 (the CPU tests run every family at pages 1, 7 and 16 through the same static buffers)."""

from __future__ import annotations

import pytest
import torch

from portattn.device import graph_support
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.testing import image_prompts
from tiny_models import ENGINE_DEVICE, checkpoint, random_prompts

pytestmark = pytest.mark.skipif(
    graph_support(ENGINE_DEVICE) is None,
    reason=f"torch has no graphs for {ENGINE_DEVICE} (set PORTATTN_TEST_ENGINE_DEVICE=cuda on a GPU)",
)

# Lengths around pages and the Llama 4 chunk (32); each request stops at its own length, so decode
# batches shrink through 7, 6, ..., 1 (buckets 1, 2, 4, 8: 3, 5, 6 and 7 are padded).
PROMPTS = random_prompts([1, 5, 15, 17, 30, 37, 44], seed=11)
MAX_TOKENS = [24, 5, 9, 13, 30, 18, 40]
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def generate(llm: LLM, prompts, max_tokens) -> list:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, return_logits=True) for n in max_tokens]
    return llm.generate(prompts, params, use_tqdm=False)


def compare(got: list, want: list, dtype: torch.dtype, routed: bool = False) -> None:
    """Equal tokens (bf16: until a near tie of the eager logits), logits within the dtype's tolerance;
    ``routed`` (experts chosen per token) in bf16: each token among the other's top 5 until they differ."""
    tol = TOL[dtype]
    for g, w in zip(got, want, strict=True):
        scale = float(w.logits.abs().max())
        for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
            if routed and dtype != torch.float32:
                assert a in w.logits[i].topk(5).indices and b in g.logits[i].topk(5).indices, f"token {i}: {a}, {b}"
                if a != b:
                    break
                continue
            err = float((g.logits[i] - w.logits[i]).abs().max()) / scale
            assert err < tol, f"token {i}: logit error {err:.2e}"
            if a != b:
                gap = float(w.logits[i, b] - w.logits[i, a]) / scale
                assert dtype != torch.float32 and gap < 2 * tol, f"token {i}: {a} != {b} (eager gap {gap:.2e})"
                break  # the continuations differ from here on


def engines(path: str, dtype: torch.dtype, **kwargs) -> tuple[LLM, LLM]:
    kwargs = dict(device=ENGINE_DEVICE, dtype=str(dtype).removeprefix("torch."), **kwargs)
    graphs = LLM(path, **kwargs)
    assert graphs.engine.runner.graphs is not None and graphs.engine.runner.graphs.capture
    return graphs, LLM(path, enforce_eager=True, **kwargs)


GROUPS = {
    "dense": ("llama", "qwen2", "qwen3", "mistral", "phi3"),
    "moe": ("llama4", "mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3"),
    "special": ("gemma2", "gemma3", "gpt_oss"),  # softcaps, per-layer rotary, sinks
}
PAGE_ONE = ("llama", "qwen3", "llama4", "deepseek_v3")  # full, window, chunk, latent attention
ROUTED = (*GROUPS["moe"], "gpt_oss")  # experts chosen per token
NOT_GROUPED = {"qwen2_5_vl": "its graphs run with image prompts in test_vision_language_model_graphs"}


def family_cells() -> list:
    cells = []
    for group, families in GROUPS.items():
        for family in families:
            for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                pages = (1, 16) if family in PAGE_ONE and dtype == torch.float32 else (16,)
                cells += [pytest.param(family, p, dtype, id=f"{group}-{family}-{p}-{name}") for p in pages]
    return cells


@pytest.mark.parametrize("family,page_size,dtype", family_cells())
def test_graphs_equal_eager(family, page_size, dtype, ckpt_root):
    path = checkpoint(family, ckpt_root)
    graphs, eager = engines(
        path, dtype, page_size=page_size, num_pages=-(-1200 // page_size), max_model_len=256, max_num_seqs=8
    )
    compare(generate(graphs, PROMPTS, MAX_TOKENS), generate(eager, PROMPTS, MAX_TOKENS), dtype, family in ROUTED)
    runner = graphs.engine.runner.graphs
    assert runner.replays > 0 and runner.padded


@pytest.mark.parametrize(
    "family,page_size,dtype",
    [(f, 16, d) for f in ("qwen3", "llama4") for d in (torch.float32, torch.bfloat16)] + [("llama4", 1, torch.float32)],
)
def test_triton_graphs_equal_eager(family, page_size, dtype, ckpt_root):
    """The tiny checkpoints at head dim 64, where the Triton kernels run (a sliding window; chunks)."""
    from .test_graphs import wide_head_checkpoint

    path = wide_head_checkpoint(family, ckpt_root)
    kwargs = dict(
        page_size=page_size,
        num_pages=-(-1200 // page_size),
        max_model_len=256,
        max_num_seqs=8,
        attention_backend="triton",
    )
    graphs, eager = engines(path, dtype, **kwargs)
    compare(generate(graphs, PROMPTS, MAX_TOKENS), generate(eager, PROMPTS, MAX_TOKENS), dtype, family in ROUTED)
    assert graphs.engine.runner.graphs.padded


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_graphs_after_preemption_and_with_prefix_caching(backend, ckpt_root):
    from .test_graphs import wide_head_checkpoint

    path = wide_head_checkpoint("llama4", ckpt_root)
    kwargs = dict(
        page_size=8,
        num_pages=14,
        max_model_len=112,
        max_num_seqs=8,
        enable_prefix_caching=True,
        attention_backend=backend,
    )
    graphs, eager = engines(path, torch.float32, **kwargs)
    # The longest request of the first round finishes last: its pages are the ones the 14-page pool
    # still caches when the second round extends its prompt (40 tokens served from the cache).
    shared = [*PROMPTS[6], 3, 1, 4]
    for prompts, max_tokens in ((PROMPTS, MAX_TOKENS), ([shared, PROMPTS[5]], [20, 20])):
        compare(generate(graphs, prompts, max_tokens), generate(eager, prompts, max_tokens), torch.float32)
    assert graphs.engine.scheduler.num_preemptions > 0
    assert graphs.engine.pages.num_cached_tokens == eager.engine.pages.num_cached_tokens == 40


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vision_language_model_graphs(dtype, ckpt_root):
    path = checkpoint("qwen2_5_vl", ckpt_root)
    prompts = [*image_prompts(random_prompts([5, 9], seed=4)), list(range(3, 12))]
    graphs, eager = engines(path, dtype, page_size=16, num_pages=60, max_model_len=256, max_num_seqs=4)
    compare(generate(graphs, prompts, [10, 12, 14]), generate(eager, prompts, [10, 12, 14]), dtype)
    assert graphs.engine.runner.graphs.replays > 0


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_graphs_sample_as_eager(family, ckpt_root):
    """Decode steps that sample inside their graphs (the LM head, argmax and draw recorded), captured
    lazily: seeded tokens with every filter equal the eager engine's (float32)."""
    from .test_graph_sampling import MIXED

    path = checkpoint(family, ckpt_root)
    kwargs = dict(device=ENGINE_DEVICE, dtype="float32", page_size=16, num_pages=80, max_model_len=256, max_num_seqs=8)
    graphs = LLM(path, lazy_graph_capture=True, **kwargs)
    eager = LLM(path, enforce_eager=True, **kwargs)
    assert graphs.engine.runner.graphs.num_captured <= 1  # the warm-up's one-sequence decode, at most
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **k) for n, k in zip(MAX_TOKENS, [*MIXED, MIXED[5]])]
    got = [o.token_ids for o in graphs.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [o.token_ids for o in eager.generate(PROMPTS, params, use_tqdm=False)]
    runner = graphs.engine.runner.graphs
    assert runner.sampled > 0 and runner.draw_graphs and runner.padded


@pytest.mark.parametrize("lazy", [False, True], ids=["at_start", "lazy"])
def test_async_scheduling_replays_as_synchronous(lazy, ckpt_root):
    """Decode steps launched before the previous step's ids are read (their input ids gathered inside
    the graph), the default where graphs are captured: greedy and seeded tokens equal the synchronous
    engine's (float32), graphs captured at start or lazily (a step that records its graph reads its ids
    from the host). Eager steps (the prompts) are launched before their tokens are read too: the host's
    copy of the tokens goes through pinned memory behind an event."""
    from .test_graph_sampling import MIXED

    path = checkpoint("qwen3", ckpt_root)
    kwargs = dict(device=ENGINE_DEVICE, dtype="float32", page_size=16, num_pages=80, max_model_len=256, max_num_seqs=8)
    fast = LLM(path, lazy_graph_capture=lazy, **kwargs)
    plain = LLM(path, async_scheduling=False, **kwargs)
    assert fast.engine.run_ahead is not None and plain.engine.run_ahead is None
    assert LLM(path, enforce_eager=True, **kwargs).engine.run_ahead is None
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **k) for n, k in zip(MAX_TOKENS, [*MIXED, MIXED[5]])]
    got = [o.token_ids for o in fast.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [o.token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert fast.engine.run_ahead.steps_ahead > 0 and fast.engine.run_ahead.eager_ahead > 0


@pytest.mark.parametrize("family,backend", [("llama", "triton"), ("gemma2", "triton"), ("llama", "torch")])
def test_cascade_shapes_captured_equal_eager(family, backend, ckpt_root):
    """Decode steps whose sequences share a prefix replay the graphs' cascade shape (captured when first
    used; the shared length a static input): tokens and logits equal the eager engine's plain
    attention (float32; Gemma 2's windowed layers attend plainly inside the cascade step)."""
    import dataclasses

    from .test_cascade_steps import PREFIX, TAILS

    path = checkpoint(family, ckpt_root)
    kwargs = dict(
        device=ENGINE_DEVICE, dtype="float32", page_size=16, num_pages=120, max_model_len=256, max_num_seqs=8,
        attention_backend=backend,
    )  # fmt: skip
    graphs = LLM(path, enable_cascade_attn=True, **kwargs)
    runner = graphs.engine.runner
    runner.cascade_rule = dataclasses.replace(
        runner.cascade_rule, min_batch=2, min_shared_tokens=1, graph_min_saved_bytes=0
    )
    eager = LLM(path, enforce_eager=True, **kwargs)
    prompts = [PREFIX + tail for tail in TAILS]
    for llm in (graphs, eager):
        generate(llm, [PREFIX], [1])  # the prefix's pages enter the cache
    compare(generate(graphs, prompts, [12] * 6), generate(eager, prompts, [12] * 6), torch.float32)
    assert runner.cascade_steps == 11 and (8, 1, "cascade") in runner.graphs.graphs
