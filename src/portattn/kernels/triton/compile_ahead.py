"""Compiling the Triton kernels of a start-up in parallel, before their first launch.

A fresh process on an empty Triton cache compiles each kernel variant the first time it launches,
one after another on the launching thread: Triton's passes, LLVM, ``ptxas``, then a C compiler for
the variant's launcher. An engine's warm-up launches over a dozen variants, and on an H200 machine
they took most of a 14.8 s warm-up, of which 0.7 s remained once they were compiled ahead
(``benchmarks/results/engine_h200/round11/NOTES.md``).

:func:`compile_ahead` rehearses a piece of work with every Triton launch turned into a compile
handed to a thread pool (``triton.AsyncCompileMode``; ``ptxas`` runs as a subprocess, so the
threads wait side by side; with :func:`start_workers` called before, each thread first has a worker
process of ``compile_workers.py`` compile its variant into Triton's cache where the cache does not hold
it and a worker is ready, so that the compiles' Python and LLVM parts run side by side too, and Triton's
compile on the thread then reads the cache), and nothing launched: inside it the kernels' outputs
stay unwritten, so what runs there must only need their shapes (a forward whose
values are thrown away; torch's own kernels still run, on whatever the buffers hold). On leaving,
it waits for the compiles and loads each kernel with its launcher, one after another (launchers
built on several threads at once were given to the wrong kernels). The real work
that follows finds every variant compiled, as long as it launches them with the same
specializations (the same shapes and the same buffers' alignment), which a rehearsal of the same
steps does. While it is active no other thread of the process may launch Triton kernels (the launch
path is switched for the whole process).

:func:`log_late_compiles` reports the compiles that happen after a warm-up (a kernel variant that
the warm-up did not meet), each of which holds up the step that launches it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor

import torch

from ...device import is_triton_interpreter

logger = logging.getLogger("portattn")

# Compiles at once: each is one thread waiting on the compiler or on a subprocess.
MAX_WORKERS = 16
_rehearsing = [False]


def rehearsing() -> bool:
    """Whether a :func:`compile_ahead` rehearsal is under way: launchers whose outputs decide what the
    host does next (expert ids that a prefill counts) give them defined values then."""
    return _rehearsing[0]


def available() -> bool:
    """Whether this Triton compiles in a thread pool (``triton.AsyncCompileMode``, Triton 3.4 on) and
    the environment does not turn it off (``PORTATTN_COMPILE_AHEAD=0``)."""
    if os.environ.get("PORTATTN_COMPILE_AHEAD", "1") == "0" or is_triton_interpreter():
        return False
    try:
        import triton
    except ImportError:
        return False
    return hasattr(triton, "AsyncCompileMode")


_workers: list = [None]  # the CompileWorkers of start_workers
# Kernels that an engine's start compiles (the attention's, where it is the Triton backend's, and the fused
# norm's): a Triton cache without a variant of any of them is a fresh one.
START_KERNELS = ("attention_fwd_kernel", "add_rmsnorm_kernel")


def start_workers(device: torch.device, count: int | None = None) -> bool:
    """Let the compiles of :func:`compile_ahead` go through up to ``count`` (default: a core each, at most
    :data:`MAX_WORKERS`) worker processes (``compile_workers.py``), where compile-ahead applies
    (:func:`available`, a CUDA device) and ``PORTATTN_COMPILE_WORKERS`` is not ``0``. They take compiles
    once they have imported Triton. Where Triton's cache holds no variant of the :data:`START_KERNELS` (a
    fresh cache: the first start on a machine, or after an upgrade) they are spawned now, so that they import
    while the caller loads its weights; elsewhere at the first compile that misses the cache (a restart
    spawns none). On an H200 (8B bf16, empty cache) workers spawned with the build reached the first token in
    17.3-21.0 s against 19.6-21.7 s on threads (round 28); spawned at the memory profile's first miss, their
    16 imports slowed that step's compiles on threads to 7.8-8.1 s (5.8 s without them) and the start took
    22.2 and 26.5 s against 23.5 s (round 29). An engine allows them when it starts building and ends them
    after its warm-up (:func:`stop_workers`). True where this call allowed them (False where they already
    were)."""
    if _workers[0] is not None:
        return False
    if device.type != "cuda" or not available() or os.environ.get("PORTATTN_COMPILE_WORKERS", "1") == "0":
        return False
    from .compile_workers import CompileWorkers, cache_holds_kernel

    workers = CompileWorkers(count or min(MAX_WORKERS, os.cpu_count() or 1))
    if not cache_holds_kernel(*START_KERNELS):
        workers.start()
    _workers[0] = workers
    return True


def stop_workers() -> None:
    """End the workers of :func:`start_workers` (where they were spawned), logging how many kernels they
    compiled."""
    workers, _workers[0] = _workers[0], None
    if workers is None:
        return
    lost = workers.num_spawned - workers.num_alive  # (before the close, whose ends are not losses)
    workers.close(wait=False)
    if workers.num_spawned:
        logger.info(
            "compile ahead: %d kernel variants compiled in %d worker processes%s",
            workers.num_compiled,
            workers.num_spawned,
            f", {lost} of which ended early" if lost else "",
        )


class _Compiles(Executor):
    """What ``AsyncCompileMode`` submits each compile to: a thread of ``threads`` that first has one of
    ``workers`` (where given) compile the variant into Triton's on-disk cache, then runs Triton's compile
    itself, which then reads the cache (or compiles, where the worker could not)."""

    def __init__(self, threads: ThreadPoolExecutor, workers):
        self.threads, self.workers = threads, workers

    def submit(self, fn, /, *args, **kwargs):
        return self.threads.submit(self._compile, fn, args, kwargs)

    def _compile(self, fn, args, kwargs):
        job = _compile_job(fn)
        if job is not None and self.workers is not None:
            done = self.workers.compile(*job)
            for callback in _callbacks if done is not None else ():
                try:
                    callback(done[0], done[1], job[0])
                except Exception:  # a listener's failure is not the compile's
                    logger.exception("a compile listener failed")
        return fn(*args, **kwargs)


def _compile_job(fn) -> tuple | None:
    """``(src, target, options)`` of the compile that Triton's ``AsyncCompileMode`` hands over as a
    closure over them (Triton 3.4 on); None where ``fn`` is not such a closure."""
    try:
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=True))
        src, target, options = cells["src"], cells["target"], cells["options"]
    except (AttributeError, KeyError, ValueError, TypeError):
        return None
    return src, target, dict(getattr(options, "__dict__", options))


def _load(kernel, index: int) -> None:
    """Load a compiled kernel on device ``index`` and build its launcher (what its first launch
    would do). Errors are left to that launch, which raises them where they belong."""
    with contextlib.suppress(Exception), torch.cuda.device(index):  # the real launch reports it
        kernel._init_handles()


@contextlib.contextmanager
def compile_ahead(device: torch.device, workers: int | None = None) -> Iterator[bool]:
    """Inside: each Triton launch is compiled in a pool of ``workers`` threads and not run (yields
    True); on leaving, the compiles are waited for and their kernels loaded on ``device``. Yields
    False and changes nothing where :func:`available` says no. A compile that fails is left to the
    real launch, which compiles again and raises."""
    if not available() or device.type != "cuda":
        yield False
        return
    import triton
    from triton.runtime.jit import JITFunction

    workers = workers or min(MAX_WORKERS, os.cpu_count() or 1)
    rehearsed = []
    real_run = JITFunction.run

    index = device.index if device.index is not None else torch.cuda.current_device()

    def rehearse(self, *args, grid, warmup, **kwargs):
        try:
            kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as exc:  # not compiled ahead: its real launch compiles it (and raises what it raises)
            logger.debug("compile ahead: %s: %s", self, exc)
            return None
        if kernel is not None:
            rehearsed.append(kernel)
        return kernel

    with ThreadPoolExecutor(workers, thread_name_prefix="portattn-compile") as pool:
        compiles = _Compiles(pool, _workers[0])
        try:
            mode = triton.AsyncCompileMode(compiles, ignore_errors=True)
        except TypeError:  # a Triton whose mode has no ignore_errors
            mode = triton.AsyncCompileMode(compiles)
        mode.__enter__()
        JITFunction.run = rehearse
        _rehearsing[0] = True
        try:
            yield True
        finally:
            JITFunction.run = real_run
            _rehearsing[0] = False
            try:
                mode.__exit__(None, None, None)  # waits for every compile
            except Exception as exc:  # a failed compile: the real launch compiles it again
                logger.debug("compile ahead: %s", exc)
        kernels = {}
        for kernel in rehearsed:
            if hasattr(kernel, "result"):  # a FutureKernel
                kernel = _result(kernel)
            if kernel is not None:
                kernels[id(kernel)] = kernel
    # One at a time: Triton 3.6 building launchers on several threads at once gave kernels each other's
    # launchers ("function takes exactly 28 arguments (85 given)" at the first launch) in 6 of 7 engine
    # start-ups on an H200 at a 0.1 ms GIL switch interval, none of 5 with the loads in turn
    # (benchmarks/results/engine_h200/round27/NOTES.md).
    for kernel in kernels.values():
        _load(kernel, index)


def _result(future):
    """A FutureKernel's compiled kernel, None where its compile failed."""
    try:
        return future.result()
    except Exception:
        return None


_late_compiles = [0]  # compiles logged after a warm-up
_callbacks: list = []  # of on_compile, also told of the worker processes' compiles
_logging = [False]  # log_late_compiles has set its listener


def on_compile(callback: Callable[[str, float, object], None]) -> bool:
    """From now on, ``callback(kernel name, seconds, source)`` after each Triton compile of this process (not a
    hit in Triton's cache), through ``triton.knobs.compilation.listener`` and after a listener already
    set (``source``: Triton's, for :func:`variant`), and after each compile of :func:`start_workers`'
    processes (whose result this process then reads from the cache). False (nothing set) for a Triton
    without the listener (before 3.4)."""
    try:
        from triton import knobs
    except ImportError:
        return False
    compilation = getattr(knobs, "compilation", None)
    if compilation is None or not hasattr(compilation, "listener"):
        return False
    previous = compilation.listener

    def listener(*, src, metadata, times, cache_hit, **kwargs) -> None:
        if previous is not None:
            previous(src=src, metadata=metadata, times=times, cache_hit=cache_hit, **kwargs)
        if not cache_hit:
            callback(str(metadata.get("name", getattr(src, "name", "?"))), times.total / 1e6, src)

    compilation.listener = listener
    _callbacks.append(callback)
    return True


def variant(src) -> str:
    """What makes a compiled kernel one variant of its function: the constexpr values and the arguments
    specialized (as 1, or as pointers and integers divisible by 16), by argument name; ``src`` is the
    source object Triton's compile listener receives. Without the attributes this needs (another Triton
    version): the source's ``repr``."""
    try:
        names = src.fn.arg_names
        constants = {names[key[0]]: value for key, value in src.constants.items() if len(key) == 1}
        attrs = {names[key[0]]: value for key, value in src.attrs.items() if len(key) == 1}
    except (AttributeError, IndexError, TypeError):
        return repr(src)
    shown = ", ".join(f"{name}={value}" for name, value in constants.items())
    specialized = ", ".join(f"{name} {value}" for name, value in attrs.items())
    return f"constexprs {shown}; specialized: {specialized or 'none'}"


def log_late_compiles() -> None:
    """Log each Triton compile from now on: its kernel and seconds, with a running count. A served
    engine calls it after its warm-up, so that a step held up by a kernel variant the warm-up did not
    compile says so; set once a process (:func:`on_compile`)."""
    if _logging[0]:
        return

    def log(name: str, seconds: float, src) -> None:
        _late_compiles[0] += 1
        logger.info(
            "Triton compiled %s in %.1f s after the warm-up (%d so far): a kernel variant the warm-up did not "
            "meet; the step that launched it waited",
            name,
            seconds,
            _late_compiles[0],
        )
        logger.debug("the variant of %s compiled after the warm-up: %s", name, variant(src))

    _logging[0] = on_compile(log)
