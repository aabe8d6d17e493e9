"""Scenarios of compile-ahead's worker processes (``kernels/triton/compile_workers.py``), run by
``test_compile_workers.py`` in a fresh process without Triton's interpreter: a process that has run
interpreted kernels has Triton's language patched for the interpreter, and cannot compile for a GPU.

``python -c "from kernels import compile_workers_scenarios as s; s.main()" NAME ...`` (``tests`` on the
path: the workers import this module's kernel by its name) prints one JSON object: each scenario's
findings. Each scenario compiles for sm_90 (ptxas included, no GPU) into an empty Triton cache of its own.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import triton
import triton.language as tl

from portattn.kernels.triton import compile_ahead
from portattn.kernels.triton.compile_workers import CompileWorkers, in_cache


@triton.jit
def scale_kernel(X, Out, n, scale, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(Out + offsets, tl.load(X + offsets, mask=mask) * scale, mask=mask)


SIGNATURE = {"X": "*fp32", "Out": "*fp32", "n": "i32", "scale": "fp32", "BLOCK": "constexpr"}
ATTRS = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
COMPILED: list = []  # (kernel name, hit in the cache) of each compile of this process


def listener(*, src, metadata, times, cache_hit, **kwargs):
    COMPILED.append([metadata["name"], cache_hit])


def jit_function(python_function):
    """A new JITFunction of ``python_function`` (nothing compiled in it yet), set up for sm_90 as its
    first launch on device 0 would (Triton's ``create_binder``, which needs a GPU)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction

    fn = JITFunction(python_function)
    target = GPUTarget("cuda", 90, 32)
    fn.device_caches[0] = ({}, {}, target, make_backend(target), None)
    fn.compile, fn.ASTSource = triton.compile, ASTSource
    return fn


def compile_through_the_mode(fn, workers, block: int = 128):
    """Triton's ``_do_compile`` under ``AsyncCompileMode`` with compile-ahead's executor: the kernel."""
    options = fn.device_caches[0][3].parse_options({"num_warps": 4})
    with ThreadPoolExecutor(4) as pool, triton.AsyncCompileMode(compile_ahead._Compiles(pool, workers)):
        kernel = fn._do_compile(("key", block), SIGNATURE, 0, {"BLOCK": block}, options, ATTRS, warmup=True)
    return kernel.result()


def ready_workers(count: int) -> CompileWorkers:
    workers = CompileWorkers(count)
    assert workers.wait_ready(timeout=120) and workers.num_ready == count
    return workers


def worker_compiles():
    """A worker compiles; this process's compile is a hit; on_compile's callbacks hear of it."""
    seen = []
    compile_ahead._callbacks[:] = [lambda name, seconds, src: seen.append([name, src.name])]
    workers = ready_workers(2)
    try:
        kernel = compile_through_the_mode(jit_function(scale_kernel.fn), workers)
    finally:
        workers.close()
        compile_ahead._callbacks.clear()
    return {"num_compiled": workers.num_compiled, "seen": seen, "name": kernel.metadata.name,
            "ptx_loads": "ld.global" in kernel.asm["ptx"]}  # fmt: skip


def local_kernel_compiled_here():
    """A kernel defined in a function: the workers cannot import it; this process compiles it."""

    def local_kernel(X, Out, n, scale, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Out + offsets, tl.load(X + offsets, mask=offsets < n) * scale, mask=offsets < n)

    workers = ready_workers(1)
    try:
        kernel = compile_through_the_mode(jit_function(local_kernel), workers)
    finally:
        workers.close()
    return {"num_compiled": workers.num_compiled, "num_alive": workers.num_alive, "name": kernel.metadata.name}


def dead_workers():
    """One of two workers killed: the other compiles; both killed: this process compiles."""
    workers = ready_workers(2)
    try:
        workers._procs[0].kill()
        workers._procs[0].wait()
        names = [compile_through_the_mode(jit_function(scale_kernel.fn), workers, b).metadata.name for b in (64, 256)]
        alive_after_one = workers.num_alive
        workers._procs[1].kill()
        workers._procs[1].wait()
        names.append(compile_through_the_mode(jit_function(scale_kernel.fn), workers, 512).metadata.name)
    finally:
        workers.close()
    return {"alive_after_one": alive_after_one, "num_alive": workers.num_alive, "num_compiled": workers.num_compiled,
            "names": names}  # fmt: skip


def lazy_start():
    """Nothing spawned before a compile needs a worker, nor for a kernel the cache holds; the first miss
    spawns them and compiles on its thread; once they are ready the next miss goes to one."""
    workers = CompileWorkers(2)
    steps = {"spawned_at_first": workers.num_spawned}
    try:
        compile_through_the_mode(jit_function(scale_kernel.fn), None, block=64)  # compiled here: now cached
        compile_through_the_mode(jit_function(scale_kernel.fn), workers, block=64)
        steps["spawned_after_a_hit"] = workers.num_spawned
        compile_through_the_mode(jit_function(scale_kernel.fn), workers, block=128)
        steps["spawned_after_a_miss"], steps["compiled_after_a_miss"] = workers.num_spawned, workers.num_compiled
        steps["ready"] = workers.wait_ready(timeout=120)
        compile_through_the_mode(jit_function(scale_kernel.fn), workers, block=256)
        steps["compiled_when_ready"] = workers.num_compiled
    finally:
        workers.close()
    return steps


def cache_check():
    """``in_cache`` before and after a compile, for another variant, for what is not a source."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(jit_function(scale_kernel.fn), SIGNATURE, {"BLOCK": 32}, ATTRS)
    target, options = GPUTarget("cuda", 90, 32), {"num_warps": 4}
    before = in_cache(src, target, options)
    triton.compile(src, target=target, options=options)
    return {
        "before": before,
        "after": in_cache(src, target, options),
        "other_variant": in_cache(src, target, {"num_warps": 8}),
        "not_a_source": in_cache(object(), target, options),
    }


SCENARIOS = {
    f.__name__: f for f in (worker_compiles, local_kernel_compiled_here, dead_workers, lazy_start, cache_check)
}


def main() -> None:
    triton.knobs.compilation.listener = listener
    results = {}
    for name in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as cache:
            os.environ["TRITON_CACHE_DIR"] = cache
            COMPILED.clear()
            results[name] = SCENARIOS[name]() | {"compiled_here": list(COMPILED)}
    print(json.dumps(results))
