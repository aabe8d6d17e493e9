"""Compiling Triton kernels in worker processes (``kernels/triton/compile_workers.py``) for the warm-up's
compile-ahead (``compile_ahead._Compiles``), without a GPU: kernels compiled for sm_90 (ptxas included).

Under the interpreter (the suite's default) ``@triton.jit`` gives interpreted functions; the parent here
compiles a ``JITFunction`` made from the same Python function, and the workers (started without the
interpreter) import the module's kernel as Triton compiles it. What is checked: a worker's compile lands
in the parent's Triton cache, so that Triton's own compile in the parent, through the compile mode's
closure, is a cache hit; kernels the workers cannot import by name, and workers that died, leave the
compile to the parent, which still compiles it.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language
if not hasattr(triton, "AsyncCompileMode"):
    pytest.skip(f"triton {triton.__version__} has no AsyncCompileMode", allow_module_level=True)
if shutil.which("ptxas") is None and not hasattr(triton.knobs, "nvidia"):
    pytest.skip("no ptxas to compile for sm_90", allow_module_level=True)

from portattn.kernels.triton import compile_ahead  # noqa: E402
from portattn.kernels.triton.compile_workers import CompileWorkers  # noqa: E402


@triton.jit
def scale_kernel(X, Out, n, scale, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(Out + offsets, tl.load(X + offsets, mask=mask) * scale, mask=mask)


SIGNATURE = {"X": "*fp32", "Out": "*fp32", "n": "i32", "scale": "fp32", "BLOCK": "constexpr"}


def start_workers(count: int, monkeypatch) -> CompileWorkers:
    """Workers without the interpreter (they import the kernels as Triton compiles them); this process
    keeps it (its Triton was imported under it)."""
    interpret = os.environ.get("TRITON_INTERPRET")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    workers = CompileWorkers(count)
    if interpret is not None:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    return workers


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Triton cache and a listener that records each compile of this process: (kernel name,
    cache hit)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    compiled = []

    def listener(*, src, metadata, times, cache_hit, **kwargs):
        compiled.append((metadata["name"], cache_hit))

    monkeypatch.setattr(triton.knobs.compilation, "listener", listener)
    return compiled


def jit_function(python_function):
    """A compiling JITFunction of ``python_function`` (whatever ``@triton.jit`` gave under the
    interpreter), set up for sm_90 as its first launch on device 0 would (Triton's ``create_binder``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction

    fn = JITFunction(python_function)
    target = GPUTarget("cuda", 90, 32)
    fn.device_caches[0] = ({}, {}, target, make_backend(target), None)
    fn.compile, fn.ASTSource = triton.compile, ASTSource
    return fn


def compile_through_the_mode(fn, workers, block: int = 128):
    """Triton's ``_do_compile`` under ``AsyncCompileMode`` with compile-ahead's executor: the compiled kernel."""
    backend = fn.device_caches[0][3]
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    options = backend.parse_options({"num_warps": 4})
    with ThreadPoolExecutor(4) as pool, triton.AsyncCompileMode(compile_ahead._Compiles(pool, workers)):
        kernel = fn._do_compile(("key", block), SIGNATURE, 0, {"BLOCK": block}, options, attrs, warmup=True)
    return kernel.result()


def test_a_worker_compiles_into_the_cache_that_the_parent_then_reads(cache, monkeypatch):
    seen = []
    monkeypatch.setattr(compile_ahead, "_callbacks", [lambda name, seconds, src: seen.append((name, src.name))])
    workers = start_workers(2, monkeypatch)
    try:
        kernel = compile_through_the_mode(jit_function(scale_kernel.fn), workers)
    finally:
        workers.close()
    assert workers.num_compiled == 1
    assert cache == [("scale_kernel", True)]  # the parent's compile: a hit in the cache the worker wrote
    assert seen == [("scale_kernel", "scale_kernel")]  # on_compile's callbacks are told of the worker's compile
    assert "ld.global" in kernel.asm["ptx"] and kernel.metadata.name == "scale_kernel"


def test_a_kernel_the_workers_cannot_import_is_compiled_by_the_parent(cache, monkeypatch):
    def local_kernel(X, Out, n, scale, BLOCK: tl.constexpr):  # defined in a function: no module attribute
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Out + offsets, tl.load(X + offsets, mask=offsets < n) * scale, mask=offsets < n)

    workers = start_workers(1, monkeypatch)
    try:
        kernel = compile_through_the_mode(jit_function(local_kernel), workers)
    finally:
        workers.close()
    assert workers.num_compiled == 0 and workers.num_alive == 1
    assert cache == [("local_kernel", False)]  # compiled here, not found in the cache
    assert kernel.metadata.name == "local_kernel"


def test_a_dead_worker_is_dropped_and_the_others_or_the_parent_compile(cache, monkeypatch):
    workers = start_workers(2, monkeypatch)
    try:
        workers._procs[0].kill()
        workers._procs[0].wait()
        kernels = [compile_through_the_mode(jit_function(scale_kernel.fn), workers, block) for block in (64, 256)]
        alive_after_one_death = workers.num_alive
        workers._procs[1].kill()
        workers._procs[1].wait()
        last = compile_through_the_mode(jit_function(scale_kernel.fn), workers, 512)
    finally:
        workers.close()
    assert alive_after_one_death == 1 and workers.num_alive == 0
    assert workers.num_compiled == 2
    assert cache == [("scale_kernel", True), ("scale_kernel", True), ("scale_kernel", False)]
    assert [k.metadata.name for k in [*kernels, last]] == ["scale_kernel"] * 3


def test_the_compile_job_is_read_from_the_closure_triton_hands_over():
    src, target, options = object(), object(), type("Options", (), {})()
    options.num_warps = 4

    def async_compile():
        return src, target, options

    assert compile_ahead._compile_job(async_compile) == (src, target, {"num_warps": 4})
    assert compile_ahead._compile_job(lambda: None) is None  # not such a closure: the thread compiles alone
    assert compile_ahead._compile_job(print) is None


def test_workers_start_only_for_a_cuda_device_and_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(compile_ahead, "_workers", [None])
    assert not compile_ahead.start_workers(torch.device("cpu"))
    monkeypatch.setattr(compile_ahead, "available", lambda: True)
    monkeypatch.setenv("PORTATTN_COMPILE_WORKERS", "0")
    assert not compile_ahead.start_workers(torch.device("cuda", 0))
    assert not compile_ahead.workers_running()
    monkeypatch.setenv("PORTATTN_COMPILE_WORKERS", "1")
    started = []
    monkeypatch.setattr(
        "portattn.kernels.triton.compile_workers.CompileWorkers", lambda count: started.append(count) or "workers"
    )
    assert compile_ahead.start_workers(torch.device("cuda", 0), 3) and started == [3]
    assert not compile_ahead.start_workers(torch.device("cuda", 0), 3)  # already running: not started twice
    monkeypatch.setattr(compile_ahead, "_workers", [None])


@pytest.mark.parametrize("wait", [True, False])
def test_closed_workers_exit_and_refuse_jobs(wait, cache, monkeypatch):
    """Closing ends every worker (at once, or with ``wait`` False on a thread while the caller goes on)."""
    workers = start_workers(2, monkeypatch)
    procs = list(workers._procs)
    workers.close(wait=wait)
    assert workers.compile(None, None, {}) is None
    if wait:
        assert all(p.poll() is not None for p in procs)
    deadline = time.monotonic() + 30
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(p.poll() is not None for p in procs)
    workers.close()  # again: nothing to do
