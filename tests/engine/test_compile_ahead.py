"""The warm-up's rehearsal that compiles Triton kernels in parallel (``kernels/triton/compile_ahead.py``,
``Engine._compile_ahead``).

On every device: the rehearsal's steps leave the engine as it was (no page of a throw-away prompt kept
in the prefix cache, the same tokens and logits after it), and the shapes it rehearses are those a
start-up records. On a CUDA GPU, in fresh processes on an empty Triton cache: the rehearsal compiles
the warm-up's kernels, so the warm-up after it compiles none, and an engine built with it generates
what one built without it does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from portattn.engine.graphs import SHORT
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from tiny_models import ENGINE_DEVICE, checkpoint, random_prompts

PROMPTS = random_prompts([3, 17, 40], seed=5)
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, return_logits=True)


def llm_with_static_graphs(path: str, lazy: bool = False) -> LLM:
    llm = LLM(path, device=ENGINE_DEVICE, dtype="float32", page_size=7, num_pages=80, max_model_len=128, max_num_seqs=4)
    llm.engine.runner.enable_graphs((1, 2, 4), capture=False, lazy=lazy).capture_all()
    return llm


def test_the_rehearsal_leaves_the_engine_as_it_was(ckpt_root):
    path = checkpoint("llama", ckpt_root)
    plain, rehearsed = llm_with_static_graphs(path), llm_with_static_graphs(path)
    engine = rehearsed.engine
    free = engine.allocator.num_free
    engine.runner.graphs.rehearse(engine.runner.graphs.start_shapes())
    for i, length in enumerate((30, 16, 1)):
        engine._warm_up_prompt(i, length, max_tokens=1)
    assert engine.allocator.num_free == free and not engine.pages.cache  # no rehearsed page is kept
    assert not engine.scheduler.has_unfinished()
    want = plain.generate(PROMPTS, PARAMS, use_tqdm=False)
    got = rehearsed.generate(PROMPTS, PARAMS, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        torch.testing.assert_close(g.outputs[0].logits, w.outputs[0].logits, rtol=0, atol=1e-5)


def test_the_rehearsal_records_no_graph(ckpt_root, monkeypatch):
    """A graph recorded inside the rehearsal would hold none of the Triton kernels (they are compiled,
    not launched) and, with graphs captured when first used, be replayed for good: the warm-up's
    one-token prompt is a batch-1 decode step, which must run eagerly there. Here the rehearsal is
    entered on any device (compile_ahead replaced by a context that says it is on) with graphs that
    record (capture forced on, recording made to fail)."""
    import contextlib

    from portattn.kernels.triton import compile_ahead as module

    monkeypatch.setattr(module, "compile_ahead", contextlib.contextmanager(lambda device: (yield True)))
    llm = llm_with_static_graphs(checkpoint("llama", ckpt_root), lazy=True)
    engine, graphs = llm.engine, llm.engine.runner.graphs
    graphs.capture = True

    def record(*args):
        raise AssertionError("a graph was recorded during the rehearsal")

    monkeypatch.setattr(graphs, "_record", record)
    assert engine._compile_ahead(graphs, [30, 16, 1]) is not None
    assert not graphs.graphs and not graphs.rehearsing
    assert graphs.replays > 0  # the one-token prompt's step went through the graphs' static buffers


@pytest.mark.parametrize("num_pages", [80, 20])
def test_the_rehearsal_runs_the_mixed_steps_that_fit_and_gives_back_their_pages(num_pages, ckpt_root, monkeypatch):
    """Mixed steps (decodes first, then a prompt chunk) of the counts, contexts and chunks the request
    slots, max_model_len and the pool allow (4 slots, 128 tokens: 1 and 3 decodes of 64 keys before a
    chunk of 16, then chunks of 16, 8 and 4 new tokens after a decode; 20 pages of 7 tokens do not hold
    the 3 decodes), every page and slot given back and the engine generating as one that never ran them."""
    path = checkpoint("llama", ckpt_root)
    plain = LLM(path, device=ENGINE_DEVICE, dtype="float32", page_size=7, num_pages=num_pages, max_model_len=128,
                max_num_seqs=4)  # fmt: skip
    rehearsed = LLM(path, device=ENGINE_DEVICE, dtype="float32", page_size=7, num_pages=num_pages,
                    max_model_len=128, max_num_seqs=4)  # fmt: skip
    engine = rehearsed.engine
    free, rows = engine.allocator.num_free, engine.pages.req_pool.num_free
    steps, forward = [], engine.runner.forward

    def record(scheduled, rows, cascade=None):
        steps.append([(seq.num_computed, n) for seq, n in scheduled])
        return forward(scheduled, rows, cascade)

    monkeypatch.setattr(engine.runner, "forward", record)
    engine._rehearse_mixed_steps()
    decodes = [[(63, 1), (0, 16)], [(63, 1)] * 3 + [(0, 16)]]  # 1 and 3 decodes, then a chunk of 16
    chunks = [[(63, 1), (0, n)] for n in (16, 8, 4)]  # the chunks with no cached tokens that fit in 128
    assert steps == (decodes if num_pages == 80 else decodes[:1]) + chunks
    assert engine.allocator.num_free == free and engine.pages.req_pool.num_free == rows and not engine.pages.cache
    monkeypatch.undo()
    got, expected = rehearsed.generate(PROMPTS, PARAMS, use_tqdm=False), plain.generate(PROMPTS, PARAMS, use_tqdm=False)
    for g, w in zip(got, expected, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        torch.testing.assert_close(g.outputs[0].logits, w.outputs[0].logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("lazy", [False, True])
def test_the_rehearsed_shapes_are_those_a_start_up_records(lazy, ckpt_root):
    graphs = llm_with_static_graphs(checkpoint("llama", ckpt_root), lazy=lazy).engine.runner.graphs
    shapes = graphs.start_shapes()
    base = [s for s in shapes if s[2:] != (SHORT,)]
    assert base == ([(1, 1)] if lazy else [(4, 1), (2, 1), (1, 1)])  # largest first, as capture_all
    for s in shapes:
        if s[2:] == (SHORT,):  # a short shape follows its own, where it is planned apart
            assert shapes[shapes.index(s) - 1] == s[:2] and graphs.short_plans.get(s[:2])


# A fresh process on an empty Triton cache: builds an engine, counting the Triton compiles (JIT cache
# misses) inside the rehearsal and after it, then generates; prints one JSON line.
CHILD = r"""
import contextlib, json, sys
from triton import knobs
misses = [0]
def missed(*args, **kwargs):
    misses[0] += 1
    return False
knobs.runtime.jit_cache_hook = missed
from portattn.kernels.triton import compile_ahead as module
counts = {"rehearsal": None, "after": None}
real = module.compile_ahead
@contextlib.contextmanager
def counted(*args, **kwargs):
    with real(*args, **kwargs) as on:
        before = misses[0]
        yield on
    counts["rehearsal"] = misses[0] - before if on else None
    counts["end"] = misses[0]
module.compile_ahead = counted
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
llm = LLM(sys.argv[1], device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=256, num_pages=64)
counts["after"] = misses[0] - counts.pop("end", misses[0])
params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
outs = llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)
counts["tokens"] = [o.outputs[0].token_ids for o in outs]
print(json.dumps(counts))
"""


def cold_build(path: str, cache: Path, ahead: bool) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), PORTATTN_COMPILE_AHEAD="1" if ahead else "0")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2] / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", CHILD, path, json.dumps(PROMPTS)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(ENGINE_DEVICE != "cuda", reason="compiles Triton kernels for a CUDA GPU")
def test_the_warm_up_compiles_nothing_after_the_rehearsal(ckpt_root, tmp_path):
    import triton

    if not hasattr(triton, "AsyncCompileMode") or not hasattr(triton.knobs.runtime, "jit_cache_hook"):
        pytest.skip(f"triton {triton.__version__} has no AsyncCompileMode or jit_cache_hook")
    path = checkpoint("llama", ckpt_root)
    ahead = cold_build(path, tmp_path / "ahead", ahead=True)
    plain = cold_build(path, tmp_path / "plain", ahead=False)
    assert ahead["rehearsal"] > 0 and ahead["after"] == 0, ahead  # every kernel of the warm-up compiled ahead
    assert plain["rehearsal"] is None and plain["after"] > 0, plain
    assert ahead["tokens"] == plain["tokens"]


def test_compiles_after_the_warm_up_are_logged_once_each(monkeypatch, caplog):
    """Triton's listener, set after a warm-up, logs each compile (not a cache hit) with its kernel and
    seconds, calls a listener set before it, and is not set twice."""
    knobs = pytest.importorskip("triton").knobs
    from portattn.kernels.triton import compile_ahead as module
    from portattn.kernels.triton.compile_ahead import log_late_compiles

    monkeypatch.setattr(module, "_logging", [False])  # as in a process that has not logged yet
    seen = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kwargs: seen.append(kwargs["cache_hit"]))
    log_late_compiles()
    log_late_compiles()  # already set: not chained to itself
    times = knobs.CompileTimes(ir_initialization=1_000_000, lowering_stages=[("ptx", 500_000)], store_results=0)
    with caplog.at_level("INFO", logger="portattn"):
        for hit in (False, True):
            knobs.compilation.listener(src=None, metadata={"name": "attention_fwd_kernel"}, metadata_group={},
                                       times=times, cache_hit=hit)  # fmt: skip
    assert seen == [False, True]
    late = [r.getMessage() for r in caplog.records if "after the warm-up" in r.getMessage()]
    assert len(late) == 1 and late[0].startswith("Triton compiled attention_fwd_kernel in 1.5 s after the warm-up (")


def test_a_late_variant_is_described_by_its_constexprs_and_specialized_arguments():
    """The debug line after a late compile names what made the variant: constexpr values and the
    arguments Triton specialized, by name (a source without those attributes: its repr)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.compiler.compiler import ASTSource

    from portattn.kernels.triton.compile_ahead import variant

    @triton.jit
    def kernel(x_ptr, n, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.float32), mask=tl.arange(0, BLOCK) < n)

    signature = {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    src = ASTSource(kernel, signature, constexprs={"BLOCK": 64}, attrs={(0,): [["tt.divisibility", 16]]})
    assert variant(src) == "constexprs BLOCK=64; specialized: x_ptr [['tt.divisibility', 16]]"
    assert variant(None) == "None"


def test_the_compiled_kernels_are_loaded_one_after_another_on_the_calling_thread(monkeypatch):
    """Triton 3.6 gave kernels each other's launchers when several threads built them at once (6 of 7 start-ups
    on an H200 at a 0.1 ms switch interval); the rehearsal's kernels are loaded in turn, on the thread that
    leaves it, each once, after every compile has finished. Stand-ins for the launch and the load: no GPU needed."""
    import threading

    triton = pytest.importorskip("triton")
    if not hasattr(triton, "AsyncCompileMode"):
        pytest.skip(f"triton {triton.__version__} has no AsyncCompileMode")
    from triton.runtime.jit import JITFunction

    from portattn.kernels.triton import compile_ahead as module

    class Kernel:
        pass

    kernels = [Kernel(), Kernel(), Kernel()]
    launches = iter([kernels[0], kernels[1], kernels[0], kernels[2]])  # kernel 0 launched twice
    monkeypatch.setattr(module, "available", lambda: True)
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kwargs: next(launches))
    loads, active = [], [0]

    def load(kernel, index):
        active[0] += 1
        loads.append((kernels.index(kernel), index, threading.get_ident(), active[0]))
        active[0] -= 1

    monkeypatch.setattr(module, "_load", load)
    with module.compile_ahead(torch.device("cuda", 3)) as ahead:
        assert ahead
        for _ in range(4):
            JITFunction.run(None, grid=(1,), warmup=False)
    me = threading.get_ident()
    assert loads == [(0, 3, me, 1), (1, 3, me, 1), (2, 3, me, 1)]


def test_the_engine_allows_compile_workers_while_it_builds_and_ends_them_after(ckpt_root, monkeypatch):
    """The engine asks for compile workers before it loads (a share of the cores for each tensor-parallel rank)
    and ends them after its warm-up, and also when the build fails; workers it did not start (already
    allowed by someone else) it leaves alone."""
    from portattn.kernels.triton import compile_ahead as module

    calls = []
    allowed = [True]
    monkeypatch.setattr(module, "start_workers", lambda device, count: calls.append(("start", count)) or allowed[0])
    monkeypatch.setattr(module, "stop_workers", lambda: calls.append(("stop",)))
    path = checkpoint("llama", ckpt_root)
    LLM(path, device=ENGINE_DEVICE, dtype="float32", num_pages=32, max_model_len=64)
    cores = min(module.MAX_WORKERS, max(1, os.cpu_count() or 1))
    assert calls == [("start", cores), ("stop",)]
    calls.clear()
    with pytest.raises(ValueError, match="max_model_len"):  # the build fails (too few pages): they still end
        LLM(path, device=ENGINE_DEVICE, dtype="float32", num_pages=1, max_model_len=64)
    assert calls == [("start", cores), ("stop",)]
    calls.clear()
    allowed[0] = False  # not started by this engine: not ended by it
    LLM(path, device=ENGINE_DEVICE, dtype="float32", num_pages=32, max_model_len=64)
    assert calls == [("start", cores)]
