"""Captured decode's static-buffer path, run eagerly (no capture) on the CPU: the same buffers, per-bucket
plans, padding rows and scratch page as a graph replay, compared token for token and logit for logit
with the plain eager engine for every family, at page sizes 1, 7 and 16, for batches between buckets,
after preemption and with prefix caching. (``scripts/gpu.sh "test engine"`` runs the captured graphs on a GPU.)"""

from __future__ import annotations

import ast
import functools
import logging
from pathlib import Path

import pytest
import torch

import portattn.engine
from portattn.device import is_triton_interpreter
from portattn.engine.config import EngineConfig
from portattn.engine.graphs import DecodeGraphs, batch_size_buckets
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.models.layers.moe import FusedMoE
from portattn.testing import engine_families, image_prompts, no_host_sync
from portattn.testing.checkpoints import save_tiny_checkpoint
from tiny_models import checkpoint, random_prompts

BUCKETS = (1, 2, 4)  # 3 sequences pad to 4; 5 or more run eagerly
# Lengths 1 (a one-token prompt decodes at once), short, around a 16-token page and the Llama 4
# chunk of 32; each request stops at its own length, so decode batches shrink through 6, 5, ..., 1.
PROMPTS = random_prompts([1, 5, 15, 17, 30, 37], seed=11)
MAX_TOKENS = [24, 5, 9, 13, 30, 18]
TOL = 1e-5


def static_llm(path: str, buckets=BUCKETS, **kwargs) -> LLM:
    llm = LLM(path, enforce_eager=True, **kwargs)
    llm.engine.runner.enable_graphs(buckets, capture=False).capture_all()
    return llm


def generate(llm: LLM, prompts, max_tokens) -> list:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, return_logits=True) for n in max_tokens]
    return llm.generate(prompts, params, use_tqdm=False)


def assert_same(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        err = float((g.logits - w.logits).abs().max() / w.logits.abs().max())
        assert err < TOL, err


def replays(llm: LLM) -> int:
    return llm.engine.runner.graphs.replays


# Every registered text family at page 7; full, window, chunk and latent attention at pages 1 and 16 too.
# Qwen2.5-VL's static path runs with images below.
PAGE_EDGES = ("llama", "qwen2", "qwen3", "llama4", "deepseek_v3")


@pytest.mark.parametrize(
    "family,page_size",
    [(f, 7) for f in engine_families() if f != "qwen2_5_vl"] + [(f, p) for f in PAGE_EDGES for p in (1, 16)],
)
def test_static_decode_equals_eager(family, page_size, ckpt_root):
    path = checkpoint(family, ckpt_root)
    kwargs = dict(page_size=page_size, num_pages=-(-900 // page_size), max_model_len=256, max_num_seqs=8)
    want = generate(LLM(path, enforce_eager=True, **kwargs), PROMPTS, MAX_TOKENS)
    llm = static_llm(path, **kwargs)
    assert_same(generate(llm, PROMPTS, MAX_TOKENS), want)
    graphs = llm.engine.runner.graphs
    # Steps 10 to 30 (after the prefill and the requests of 5 and 9 tokens) have 4 or fewer decodes.
    assert graphs.replays == 21
    assert set(graphs.padded) == {3}  # 3 decodes ran padded to 4


def test_the_host_copies_the_inputs_and_the_replay_plans(ckpt_root):
    """A captured step's host part is the pinned inputs and one copy to the device; the plan (page
    table, key lengths, new-token slots) is the start of what the graph records, so the host launches
    none of its kernels."""
    llm = static_llm(checkpoint("llama", ckpt_root), page_size=4, num_pages=100, max_model_len=64, max_num_seqs=4)
    engine, graphs = llm.engine, llm.engine.runner.graphs
    for prompt in PROMPTS[1:4]:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    scheduled = [(seq, 1) for seq in engine.scheduler.running]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        shape = graphs.write_step(scheduled)
    assert [e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None] == ["aten::copy_"]
    graphs.buffers.seq_lens_k.zero_()
    graphs.buffers.page_table.fill_(-1)
    graphs._run_model(shape, len(scheduled))
    for row, (seq, _) in enumerate(scheduled):
        assert int(graphs.buffers.seq_lens_k[row]) == seq.num_computed + 1
        pages = engine.req_pool.req_to_token[seq.req_pool_idx, : seq.num_computed + 1 : 4] // 4
        assert graphs.buffers.page_table[row, : len(pages)].tolist() == pages.tolist()
    for seq, _ in scheduled:
        engine.abort(seq.request_id)


def test_static_decode_after_preemption_and_with_prefix_caching(ckpt_root):
    path = checkpoint("llama4", ckpt_root)
    # 12 pages of 8 tokens cannot hold six growing sequences: the newest are preempted and recomputed.
    kwargs = dict(page_size=8, num_pages=12, max_model_len=96, max_num_seqs=6, enable_prefix_caching=True)
    shared = [*PROMPTS[4], 3, 1, 4]  # extends a first-wave prompt: hits the prefix cache
    plain = LLM(path, enforce_eager=True, **kwargs)
    llm = static_llm(path, **kwargs)
    for prompts, max_tokens in ((PROMPTS, MAX_TOKENS), ([shared, PROMPTS[5]], [20, 20])):
        assert_same(generate(llm, prompts, max_tokens), generate(plain, prompts, max_tokens))
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.pages.num_cached_tokens > 0
    assert replays(llm) > 0


@functools.cache
def wide_head_checkpoint(family: str, root: str) -> str:
    """The family's tiny checkpoint at head dim 64 (a head dim of the Triton kernels)."""
    return save_tiny_checkpoint(family, f"{root}/{family}_head64", head_dim=64)


@pytest.mark.skipif(not is_triton_interpreter(), reason="the CPU engine runs Triton only under its interpreter")
def test_static_decode_on_triton_interpreter(ckpt_root):
    path = wide_head_checkpoint("qwen3", ckpt_root)  # a sliding-window layer
    kwargs = dict(page_size=16, num_pages=60, max_model_len=256, max_num_seqs=4, attention_backend="triton")
    prompts, max_tokens = PROMPTS[1:4], [3, 4, 5]
    want = generate(LLM(path, enforce_eager=True, **kwargs), prompts, max_tokens)
    llm = static_llm(path, **kwargs)
    assert_same(generate(llm, prompts, max_tokens), want)
    assert replays(llm) > 0


def test_vision_language_model_decodes_through_the_buffers(ckpt_root):
    path = checkpoint("qwen2_5_vl", ckpt_root)
    prompts = [*image_prompts(random_prompts([5, 9], seed=4)), list(range(3, 12))]
    kwargs = dict(page_size=4, num_pages=200, max_model_len=256, max_num_seqs=4, chunked_prefill_size=8)
    want = generate(LLM(path, enforce_eager=True, **kwargs), prompts, [10, 12, 14])
    llm = static_llm(path, **kwargs)
    assert_same(generate(llm, prompts, [10, 12, 14]), want)
    assert replays(llm) > 0


@pytest.mark.parametrize("family", ["llama", "qwen3", "llama4", "deepseek_v3", "gpt_oss", "gemma2", "qwen2_5_vl"])
def test_the_replayed_forward_does_not_sync(family, ckpt_root):
    """What a graph records (the model's forward over the static buffers) never reads the device: the
    Llama 4 MoE layers included, at a bucket above their default dense limit."""
    llm = static_llm(
        checkpoint(family, ckpt_root), buckets=(1, 24), page_size=4, num_pages=300, max_model_len=256, max_num_seqs=24
    )
    graphs = llm.engine.runner.graphs
    forward = graphs._forward

    def guarded(batch_size):
        with no_host_sync():
            return forward(batch_size)

    graphs._forward = guarded
    prompts = random_prompts([3] * 20, seed=6)
    inputs = image_prompts(prompts) if family == "qwen2_5_vl" else prompts
    llm.generate(inputs, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert graphs.padded[20] == 2  # 20 decodes ran padded to the bucket of 24, twice


def test_padding_rows_write_only_the_scratch_page(ckpt_root):
    path = checkpoint("llama", ckpt_root)
    llm = static_llm(path, page_size=4, num_pages=80, max_model_len=256, max_num_seqs=8)
    engine = llm.engine
    pool, scratch = engine.kv_pool, engine.runner.scratch_page
    assert scratch == engine.allocator.num_pages == pool.num_pages - 1  # never handed to a sequence
    for k in pool.k:
        k[scratch].fill_(float("nan"))
    generate(llm, PROMPTS[1:4], [4, 4, 4])  # three decodes padded to four
    graphs: DecodeGraphs = engine.runner.graphs
    buffers = graphs.buffers
    assert torch.equal(buffers.out_cache_loc[3] // 4, torch.tensor(scratch))
    assert bool((buffers.page_table[3] == scratch).all())
    assert int(buffers.seq_lens_k[3]) == 1
    assert not pool.k[0][scratch, 0].isnan().any()  # the padding row wrote its key there
    assert graphs.replays == 3


def test_buckets():
    assert batch_size_buckets(1) == (1,)
    assert batch_size_buckets(6) == (1, 2, 4, 6)
    assert batch_size_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert batch_size_buckets(100) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100)
    assert batch_size_buckets(128)[-3:] == (96, 112, 128)


def test_graph_plan_has_no_host_lengths(ckpt_root):
    llm = static_llm(checkpoint("llama", ckpt_root), page_size=16, num_pages=40, max_model_len=256)
    graphs = llm.engine.runner.graphs
    for (batch_size, q_len), ctx in graphs.contexts.items():
        assert q_len == 1  # the engine decodes one token per sequence
        meta = ctx.metadata
        assert meta.q_lens is None and meta.k_lens is None  # nothing per-step baked in as a Python value
        assert meta.batch_size == batch_size
        assert meta.page_table.shape == (batch_size, graphs.buffers.page_table.shape[1])  # full width
        assert meta.page_table.data_ptr() == graphs.buffers.page_table.data_ptr()


def test_moe_layers_stay_sync_free_up_to_the_largest_step(ckpt_root):
    llm = LLM(checkpoint("llama4", ckpt_root), enforce_eager=True, page_size=16, num_pages=40, max_model_len=256)
    llm.engine.runner.uniform_q_lens = (1, 3)
    llm.engine.runner.enable_graphs((1, 8, 24), capture=False)
    model = llm.engine.model
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moe and all(m.dense_max_tokens == 72 for m in moe)  # 24 sequences of 3 new tokens
    model.prepare_static(8)  # limits are only raised
    assert all(m.dense_max_tokens == 72 for m in moe)
    with pytest.raises(ValueError, match="expected max_tokens to be a positive int, got 0"):
        model.prepare_static(0)


def test_the_engine_names_no_cache_kind_and_no_layer():
    """A KV cache kind brings its plans (KVPool.plan, graph_plan) and layers their static limits
    (CausalLM.prepare_static): no engine module imports a layer or the MLA module, or compares a value
    with a kind's name."""
    root = Path(portattn.engine.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                assert "layers" not in module.split(".") and "mla" not in module.split("."), (path.name, module)
            if isinstance(node, ast.Compare):
                constants = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                assert not {"mha", "mla"} & set(constants), (path.name, node.lineno)


def test_cpu_and_enforce_eager_run_eagerly(ckpt_root, caplog):
    path = checkpoint("llama", ckpt_root)
    with caplog.at_level(logging.INFO, logger="portattn"):
        llm = LLM(path, page_size=16, num_pages=40, max_model_len=256)
    assert llm.engine.runner.graphs is None
    assert "decode runs eagerly (torch has no graphs for device type 'cpu')" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="portattn"):
        LLM(path, page_size=16, num_pages=40, max_model_len=256, enforce_eager=True)
    assert "decode runs eagerly (enforce_eager)" in caplog.text
    with pytest.raises(ValueError, match=r"expected enforce_eager \(--enforce-eager\) to be a bool, got 'yes'"):
        EngineConfig(model=path, device="cpu", dtype="float32", enforce_eager="yes")


class RecordedStep:
    """Stands in for a device graph on the CPU: replaying runs the recorded function again."""

    def __init__(self, graphs: DecodeGraphs, key, fn):
        self.graphs, self.key, self.fn = graphs, key, fn

    def replay(self) -> None:
        self.graphs.outputs[self.key] = self.fn()


@pytest.mark.parametrize("lazy", [False, True], ids=["at-start", "lazy"])
def test_graphs_are_captured_at_start_or_when_first_used(lazy, ckpt_root, monkeypatch):
    """Every decode shape at construction, or (lazy) each shape and each draw's filter set the first
    time a step needs it, and never twice; the tokens are the same either way."""
    path = checkpoint("llama", ckpt_root)
    llm = LLM(path, enforce_eager=True, page_size=16, num_pages=60, max_model_len=256, max_num_seqs=8)
    graphs = llm.engine.runner.enable_graphs(BUCKETS, capture=True, lazy=lazy)
    recorded = []

    def record(key, table, fn):
        recorded.append(key)
        fn()
        table[key] = RecordedStep(graphs, key, fn)
        graphs.outputs[key] = fn()

    monkeypatch.setattr(graphs, "_record", record)
    graphs.capture_all()
    assert recorded == ([] if lazy else [(4, 1), (2, 1), (1, 1)])
    prompts, max_tokens = PROMPTS[1:4], [4, 6, 8]  # 3, 2 and 1 decodes
    sampling = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8, seed=n) for n in max_tokens]
    want = LLM(path, enforce_eager=True, page_size=16, num_pages=60, max_model_len=256, max_num_seqs=8)
    expected = [o.token_ids for o in want.generate(prompts, sampling, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(prompts, sampling, use_tqdm=False)] == expected
    draws = [key for key in recorded if not isinstance(key[1], int)]
    assert sorted(k for k in recorded if k not in draws) == [(1, 1), (2, 1), (4, 1)]  # each once
    assert sorted(b for b, _ in draws) == [1, 2, 4]  # one filter set (temperature alone) per bucket
    assert graphs.num_captured == len(recorded) == 6


def test_the_gpu_graph_tests_cover_every_registered_family():
    """test_graphs_gpu.py groups the families by hand (to fit its parts' time budgets): every
    registered family is in a group or named with where its graphs are tested."""
    from .test_graphs_gpu import GROUPS, NOT_GROUPED

    grouped = [f for families in GROUPS.values() for f in families]
    assert sorted(grouped + list(NOT_GROUPED)) == sorted(engine_families())
