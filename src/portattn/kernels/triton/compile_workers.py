"""Worker processes that compile Triton kernels into Triton's on-disk cache, for :mod:`.compile_ahead`.

Threads of one process compile Triton kernels side by side only where the compiler lets go of the
GIL (``ptxas`` runs as a subprocess, Triton's passes and LLVM do not all release it): on an H200 host
with 16 cores an 8B warm-up's 30 variants, each 0.2-2.5 s alone, took 5.7-9.1 s in a pool of 16
threads, 3.4-4.3 s through 16 worker processes (``benchmarks/results/engine_h200/round28/NOTES.md``).

:class:`CompileWorkers` starts ``python -m portattn.kernels.triton.compile_workers`` processes, each of
which imports Triton (and this package's kernel modules) once, says it is ready, and then compiles jobs
sent on its standard input (what ``triton.compile`` takes: the kernel's source, the target, the
options; a kernel is sent as its module and name, which the worker imports), writing each into the
cache directory the parent uses, and answering with the kernel's name and seconds. Where the kernel has
a launcher that is built by a C compiler (Triton 3.6), the worker builds it too (into the same cache).
The parent then compiles the same source itself, which is a hit in the cache: it loads the files.

The workers start at :meth:`CompileWorkers.start` or at the first compile that Triton's cache does not hold
(a process whose kernels are all cached spawns none: a restart pays nothing), and take jobs once ready;
until then compiles run on the caller's threads as without workers (:func:`.compile_ahead.start_workers`
says when an engine spawns them). The workers never use the GPU (the target is given; nothing is
launched or loaded on a device), and a worker that fails leaves the compile to the parent, which compiles
as it would have without workers.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time

logger = logging.getLogger("portattn")

_LENGTH = struct.Struct("<Q")  # a job's length before its bytes


class CompileWorkers:
    """Up to ``count`` worker processes, started by the first :meth:`compile` that needs one (nothing
    is spawned where every kernel is in Triton's cache already) and handed one job at a time (from any
    thread) once they have imported what compiles need (:data:`READY`). :meth:`close` ends them; so
    does the end of this process (their standard input closes)."""

    def __init__(self, count: int):
        self.count = count
        self.num_spawned = self.num_alive = self.num_ready = self.num_compiled = 0
        self._idle: queue.SimpleQueue = queue.SimpleQueue()  # ready workers without a job
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen] = []
        self._started = self._closed = False

    def start(self) -> None:
        """Spawn the workers (once); each joins the idle ones when it says it is ready."""
        with self._lock:
            if self._started or self._closed:
                return
            self._started = True
        env = dict(os.environ)
        # The workers import what this process imports: its path (a source tree on PYTHONPATH, a test's
        # additions) and its Triton cache directory (where the compiles must land).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        cache_dir = _triton_cache_dir()
        if cache_dir:
            env["TRITON_CACHE_DIR"] = cache_dir
        for _ in range(self.count):
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
                )
            except OSError as exc:
                logger.info("compile workers: none started (%s); kernels compile on this process's threads", exc)
                break
            with self._lock:
                if self._closed:  # closed meanwhile: this one ends at once
                    proc.stdin.close()
                    _reap([proc])
                    break
                self._procs.append(proc)
                self.num_spawned += 1
                self.num_alive += 1
            threading.Thread(target=self._await_ready, args=(proc,), name="portattn-compile-ready", daemon=True).start()

    def _await_ready(self, proc: subprocess.Popen) -> None:
        try:
            message = pickle.load(proc.stdout)
        except Exception as exc:  # it exited before it was ready
            self._drop(proc, exc)
            return
        if message != READY:
            self._drop(proc, ValueError(f"expected {READY!r} from a compile worker, got {message!r}"))
            return
        with self._lock:
            self.num_ready += 1
        self._idle.put(proc)

    def wait_ready(self, timeout: float) -> bool:
        """Start the workers and wait until each is ready or gone (at most ``timeout`` seconds): whether
        any is ready."""
        self.start()
        deadline = time.monotonic() + timeout
        while self.num_ready < self.num_alive and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.num_ready > 0

    def compile(self, src, target, options: dict) -> tuple[str, float] | None:
        """Have a worker compile ``triton.compile(src, target=target, options=options)`` into the cache:
        ``(kernel name, seconds)``, or None where the caller compiles it itself: a kernel in the cache
        already (:func:`in_cache`), no worker ready yet (the first call starts them), a kernel the workers
        cannot import by its module and name, a compile that failed there, no worker left."""
        if self._closed or in_cache(src, target, options):
            return None
        self.start()
        if self.num_ready == 0:  # still importing: this one compiles on the caller's thread
            return None
        try:
            job = dumps((src, target, options))
        except Exception as exc:  # a kernel defined in a function or in __main__, an unpicklable constant
            logger.debug("compile workers: %s not sent: %s", getattr(src, "name", src), exc)
            return None
        while True:
            if self.num_ready == 0 or self._closed:
                return None
            try:
                proc = self._idle.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                proc.stdin.write(_LENGTH.pack(len(job)) + job)
                proc.stdin.flush()
                status, *reply = pickle.load(proc.stdout)
            except (OSError, EOFError, pickle.UnpicklingError, ValueError) as exc:
                self._drop(proc, exc, ready=True)
                continue  # another worker, if any is left
            self._idle.put(proc)
            if status != "ok":
                logger.debug("compile workers: %s failed there: %s", getattr(src, "name", src), reply[0])
                return None
            with self._lock:
                self.num_compiled += 1
            return reply[0], reply[1]

    def _drop(self, proc: subprocess.Popen, exc: BaseException, ready: bool = False) -> None:
        with self._lock:
            self.num_alive -= 1
            self.num_ready -= ready
        proc.kill()
        logger.debug("compile workers: a worker ended (%s, exit code %s); %d left", exc, proc.wait(), self.num_alive)

    def close(self, wait: bool = True) -> None:
        """End the workers: each exits when its standard input closes (a worker's exit, torch's teardown
        included, took 0.6 s on an H200 host). ``wait`` False: a daemon thread waits for them, so that the
        caller goes on at once. Idempotent."""
        with self._lock:
            self._closed = True
            procs, self._procs = self._procs, []
        for proc in procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        if wait:
            _reap(procs)
        elif procs:
            threading.Thread(target=_reap, args=(procs,), name="portattn-compile-reaper", daemon=True).start()


def _reap(procs: list[subprocess.Popen]) -> None:
    """Wait for each of ``procs`` to exit (at most 5 s each before it is killed) and close its pipe."""
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


READY = ("ready",)  # what a worker says once it has imported what compiles need


def in_cache(src, target, options: dict) -> bool:
    """Whether ``triton.compile(src, target=target, options=options)`` would find its kernel in Triton's
    cache (the key and file it looks for, as Triton 3.4-3.9 compute them); False where that cannot be
    told (another Triton)."""
    try:
        import hashlib

        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.compiler.compiler import make_backend
        from triton.runtime.cache import get_cache_key, get_cache_manager

        backend = make_backend(target)
        parsed = backend.parse_options(dict(options, **src.parse_options()))
        key = get_cache_key(src, backend, parsed, env_vars=get_cache_invalidating_env_vars())
        name = f"{src.name[:150]}.json"
        group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name) or {}
        return group.get(name) is not None
    except Exception:
        return False


def cache_holds_kernel(*names: str) -> bool:
    """Whether Triton's on-disk cache holds a compiled variant of one of the kernels ``names`` (its
    ``NAME.json`` in one of the cache's key folders); False where the cache's folder is unknown or missing."""
    cache_dir = _triton_cache_dir()
    if not cache_dir or not os.path.isdir(cache_dir):
        return False
    folder = glob.escape(cache_dir)
    return any(next(glob.iglob(os.path.join(folder, "*", f"{name}.json")), None) for name in names)


def _triton_cache_dir() -> str | None:
    try:
        from triton import knobs

        return knobs.cache.dir
    except (ImportError, AttributeError):
        return os.environ.get("TRITON_CACHE_DIR")


class _Pickler(pickle.Pickler):
    """Sends a Triton kernel (``JITFunction``) as its module and qualified name."""

    def reducer_override(self, obj):
        from triton.runtime.jit import JITFunction

        if isinstance(obj, JITFunction):
            module, name = obj.fn.__module__, obj.fn.__qualname__
            if module == "__main__" or "<locals>" in name:
                raise pickle.PicklingError(f"kernel {module}.{name} cannot be imported by name")
            return _kernel, (module, name)
        return NotImplemented


def dumps(obj) -> bytes:
    """``obj`` pickled with each Triton kernel in it sent by module and name (:func:`_kernel` finds it)."""
    import io

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _kernel(module: str, name: str):
    """The Triton kernel ``name`` of ``module``, under the wrappers a decorator put around it."""
    from triton.runtime.jit import JITFunction

    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, JITFunction):  # an autotuner's or heuristics' wrapper
        obj = obj.fn
    return obj


# Where a Triton target's launcher class lives (built by a C compiler in Triton 3.6; a Triton whose
# launcher is generic builds nothing there).
_LAUNCHERS = {
    "cuda": ("triton.backends.nvidia.driver", "CudaLauncher"),
    "hip": ("triton.backends.amd.driver", "HIPLauncher"),
}


def _build_launcher(kernel, target) -> None:
    """Build ``kernel``'s launcher into the cache where Triton compiles one (errors left to the parent,
    which builds it when it loads the kernel)."""
    where = _LAUNCHERS.get(getattr(target, "backend", None))
    if where is None:
        return
    try:
        launcher = getattr(importlib.import_module(where[0]), where[1])
        launcher(kernel.src, kernel.metadata)
    except Exception as exc:
        if not _launcher_failed:  # once a worker: the parent builds each launcher as it would have
            print(f"compile worker: no launcher built for {kernel.name}: {exc}", file=sys.stderr)
        _launcher_failed.append(exc)


_launcher_failed: list = []


def _reply(out, message: tuple) -> None:
    pickle.dump(message, out)
    out.flush()


def _read_exactly(stream, n: int) -> bytes | None:
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


# A worker's scheduling priority below its parent's, whose threads compile beside them and whose engine
# goes on with its start-up meanwhile.
NICENESS = 10


def _import_ahead() -> None:
    """Import before the first job what compiles import on first use: Triton's code generator and its
    backends' compilers, and this package's kernel modules (with torch), which jobs name."""
    import pkgutil

    for name in ("triton.compiler.code_generator", "triton.backends.nvidia.compiler", "triton.backends.amd.compiler"):
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    package = "portattn.kernels.triton"  # (this module runs as __main__)
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if module.name != "compile_workers":
            with contextlib.suppress(Exception):
                importlib.import_module(f"{package}.{module.name}")


def main() -> None:
    """A worker: jobs from standard input until it closes, one reply each on the original standard output
    (what the compiler prints goes to standard error)."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    with contextlib.suppress(OSError, AttributeError):  # the process that waits for them goes first
        os.nice(NICENESS)
    os.environ.pop("TRITON_INTERPRET", None)  # they compile for a GPU target, whatever the parent runs under
    import triton

    _import_ahead()
    _reply(out, READY)

    jobs = sys.stdin.buffer
    while True:
        header = _read_exactly(jobs, _LENGTH.size)
        if header is None:
            return
        payload = _read_exactly(jobs, _LENGTH.unpack(header)[0])
        if payload is None:
            return
        try:
            src, target, options = pickle.loads(payload)
            start = time.perf_counter()
            kernel = triton.compile(src, target=target, options=options)
            _build_launcher(kernel, target)
            _reply(out, ("ok", src.name, time.perf_counter() - start))
        except Exception as exc:
            _reply(out, ("error", f"{type(exc).__name__}: {exc}"))


if __name__ == "__main__":
    main()
