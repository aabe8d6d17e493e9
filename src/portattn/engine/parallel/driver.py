"""Rank 0's handle on a tensor-parallel engine: start the other ranks, send each step, stop them.

Two ways to get ``tensor_parallel_size = N`` processes:

* **spawned** (the default): the engine's own process is rank 0 and starts ranks ``1 .. N-1`` as
  fresh interpreters (``python -m portattn.engine.parallel.worker``: the user's script is not re-run,
  so it needs no ``if __name__ == "__main__"`` guard), one per device, meeting on a store rank 0
  opens on 127.0.0.1;
* **torchrun** (``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` set, on one host or several): every process
  runs the user's program; on rank 0 the engine is built as above, on every other rank the ``LLM``
  constructor serves rank 0's steps and then ends the process (``SystemExit(0)``) when rank 0 shuts
  down.

The spawned ranks register the model architectures and attention backends registered in rank 0's
process when it starts them (:func:`portattn.engine.parallel.worker.register_all`).

A failing rank makes rank 0's step raise :class:`WorkerError` with that rank's traceback; a rank
that stops answering makes it raise after ``PORTATTN_TP_TIMEOUT_S``, naming the rank (from the
ranks' pulses, :mod:`.liveness`). The engine is then stopped (every rank exits) and further calls
raise. :meth:`Driver.shutdown` (``LLM.shutdown``, and at interpreter exit) stops the ranks and
leaves no process behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import torch.distributed as dist

from ...backends.registry import backend_targets
from ...distributed.group import TPGroup
from ...models import registered_models
from .liveness import read_pulses, silent_ranks
from .process_group import (
    START_TIMEOUT,
    TIMEOUT_ENV,
    broadcast_message,
    check_groups,
    destroy_groups,
    init_groups,
    make_groups,
    rank_device,
    step_timeout,
    use_device,
)
from .protocol import STOP, CallMessage, JournaledReqToTokenPool, StepSender
from .worker import error_key, joined_key, report_error, run_rank

logger = logging.getLogger("portattn")

JOIN_TIMEOUT_S = 10.0  # a rank told to stop gets this long before it is terminated
ERROR_WAIT_S = 5.0  # after a failed collective: how long to wait for the failing rank's report
STEP_DEADLINE = 0.8  # a step running this fraction of the step timeout is aborted (before NCCL's watchdog)


class WorkerError(RuntimeError):
    """A tensor-parallel rank failed (raised, died or stopped answering); the message says which and why."""


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def start(config) -> Driver:
    """Start (or join, under torchrun) the ranks of an engine with ``config.tensor_parallel_size > 1``.
    Returns rank 0's :class:`Driver`; on another torchrun rank, serves and then raises ``SystemExit(0)``."""
    if launched_by_torchrun():
        return _join_torchrun(config)
    if dist.is_initialized():
        raise ValueError(
            "expected no torch.distributed process group in this process for tensor_parallel_size "
            f"{config.tensor_parallel_size} (the engine starts its own), got one of world size {dist.get_world_size()}"
        )
    return _spawn(config)


def _spawn(config) -> Driver:
    size = config.tensor_parallel_size
    registered = registrations("tensor_parallel_size > 1 (the other ranks import it)")
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=START_TIMEOUT)
    level = logging.getLogger("portattn").getEffectiveLevel()
    common = dict(config=config, world_size=size, host="127.0.0.1", port=store.port, log_level=level)
    common |= registered | dict(sys_path=list(sys.path))
    payloads = [pickle.dumps(common | dict(rank=rank)) for rank in range(1, size)]  # before any process starts
    processes = []
    for payload in payloads:
        command = [sys.executable, "-m", "portattn.engine.parallel.worker"]
        process = subprocess.Popen(command, stdin=subprocess.PIPE, env=_child_env())
        processes.append(process)
        process.stdin.write(payload)
        process.stdin.flush()  # stdin stays open: the rank exits when it closes
    device = rank_device(config.device, 0)
    driver = Driver(config, device, store, processes, owns_groups=True)
    try:
        driver.wait_for_ranks()
        use_device(device)
        driver.tp = init_groups(device, 0, size, store)
    except BaseException as err:
        raise driver.fail(err) from err
    return driver


def registrations(needed_for: str) -> dict[str, dict[str, str]]:
    """The model architectures and attention backends registered in this process (``models`` and
    ``backends``: name -> ``"module:Class"``), for another process to register again
    (``worker.register_all``); one that lives in ``__main__`` is refused, naming ``needed_for``: a
    started process runs its own main module, not the user's script."""
    registered = dict(models=registered_models(), backends=backend_targets())
    for targets in registered.values():
        for name, target in targets.items():
            if target.split(":")[0] == "__main__":
                raise ValueError(
                    f"expected {name!r} registered from an importable module for {needed_for}, got {target!r}: "
                    "move the class into a module"
                )
    return registered


def _child_env() -> dict[str, str]:
    """This process's environment, with the directory portattn is imported from on PYTHONPATH."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _join_torchrun(config) -> Driver:
    size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if size != config.tensor_parallel_size:
        raise ValueError(
            f"expected torchrun's world size to equal tensor_parallel_size {config.tensor_parallel_size}, got {size}"
        )
    device = rank_device(config.device, int(os.environ["LOCAL_RANK"]))
    use_device(device)
    owns = not dist.is_initialized()
    tp = init_groups(device, rank, size) if owns else _existing_group(device, rank, size)
    store = dist.distributed_c10d._get_default_store()
    if rank != 0:
        try:
            run_rank(config, tp, device, store)
        except BaseException:
            report_error(store, rank)
            raise
        if owns:
            destroy_groups()
        raise SystemExit(0)
    driver = Driver(config, device, store, [], owns_groups=owns)
    driver.tp = tp
    return driver


def _existing_group(device, rank: int, size: int) -> TPGroup:
    if dist.get_world_size() != size:
        raise ValueError(f"expected a default process group of world size {size}, got {dist.get_world_size()}")
    return make_groups(device, rank, size)


class _Ranks:
    """What stopping the ranks needs, apart from the :class:`Driver`, so that a driver that is
    garbage-collected (or alive at interpreter exit) without a shutdown still stops them politely."""

    def __init__(self, processes: list[subprocess.Popen], owns_groups: bool):
        self.processes = processes
        self.owns_groups = owns_groups
        self.tp: TPGroup | None = None
        self.error: BaseException | None = None  # set once the engine stopped after a failure
        self.closed = False
        self.dead_rank: int | None = None  # a rank seen exiting while the engine ran
        self.step_started: float | None = None  # time.monotonic() when the running step began
        self.timed_out = False  # a step outlived the step timeout (and the compute group was aborted)
        self.watch_stop = threading.Event()

    def stop(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.watch_stop.set()
        told = False
        if self.error is None and self.tp is not None:
            with contextlib.suppress(Exception):  # a rank already gone is terminated below
                broadcast_message(STOP, self.tp)
                told = True
        deadline = time.monotonic() + (JOIN_TIMEOUT_S if told else 0.0)  # ranks not told are terminated now
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=2.0)
            if process.poll() is None:
                process.kill()
                process.wait()
            with contextlib.suppress(OSError):
                process.stdin.close()
        if self.owns_groups:
            destroy_groups()


class Driver:
    """Rank 0's side of a tensor-parallel engine (built by :func:`start`)."""

    req_pool_class = JournaledReqToTokenPool  # rank 0's page table records its writes for the other ranks

    def __init__(self, config, device, store, processes: list[subprocess.Popen], *, owns_groups: bool):
        self.config = dataclasses.replace(config, device=device)
        self.device = device
        self.store = store
        self.processes = processes
        self.sender: StepSender | None = None
        self.ranks = _Ranks(processes, owns_groups)
        # The watching thread holds the ranks, not the driver (which may then be collected).
        threading.Thread(target=_watch, args=(self.ranks,), name="portattn-tp-watch", daemon=True).start()
        # Runs once: at shutdown(), when the driver is collected, or at interpreter exit.
        self._stop = weakref.finalize(self, self.ranks.stop)

    @property
    def tp(self) -> TPGroup | None:
        return self.ranks.tp

    @tp.setter
    def tp(self, tp: TPGroup) -> None:
        self.ranks.tp = tp

    @property
    def error(self) -> BaseException | None:
        return self.ranks.error

    @error.setter
    def error(self, error: BaseException) -> None:
        self.ranks.error = error

    @property
    def closed(self) -> bool:
        return self.ranks.closed

    # -- the engine's calls ------------------------------------------------------------------------

    def attach(self, req_pool: JournaledReqToTokenPool) -> None:
        """After rank 0's engine is built: check every rank is up, then start sending steps."""
        req_pool.take_journal()  # the warm-up's writes: every rank made its own
        self.sender = StepSender(req_pool)
        self._guarded(lambda: check_groups(self.tp))

    def step(self, runner, scheduled, live: set[int], while_running=None):
        """Send the step to the other ranks and run it here; returns rank 0's sampled tokens
        (``while_running``: as ``ModelRunner.step`` takes it)."""
        want = runner.logit_rows(scheduled)
        cascade = runner.cascade_tokens(scheduled)  # the other ranks' mirrors do not know the pages
        message = self.sender.message(scheduled, want.rows, live, cascade)

        def run():
            broadcast_message(message, self.tp)
            return runner.step(scheduled, want, while_running, cascade)

        return self._guarded(run)

    def call(self, engine, fn, *args):
        """``fn(engine, *args)`` on every rank (``fn`` a module-level function, ``args`` picklable);
        returns rank 0's result. ``fn`` may make collectives over ``engine.tp``: every rank makes them."""
        if getattr(fn, "__module__", "__main__") == "__main__" or "<locals>" in getattr(fn, "__qualname__", "<"):
            raise ValueError(f"expected a module-level function the other ranks can import, got {fn!r}")

        def run():
            broadcast_message(CallMessage(fn, args), self.tp)
            return fn(engine, *args)

        return self._guarded(run)

    def shutdown(self) -> None:
        """Stop the other ranks (told, then terminated if they do not exit) and leave the process groups."""
        self._stop()

    def wait_for_ranks(self) -> None:
        """Wait until every started rank reached the process-group rendezvous; a rank that exits
        first (no such device, a failed import) raises here instead of leaving rank 0 waiting."""
        keys = [joined_key(rank) for rank in range(1, self.config.tensor_parallel_size)]
        deadline = time.monotonic() + START_TIMEOUT.total_seconds()
        while not self.store.check(keys):
            if any(p.poll() is not None for p in self.processes) or time.monotonic() > deadline:
                raise self._rank_error() or WorkerError("tensor-parallel ranks did not start in time")
            time.sleep(0.05)

    # -- failures ----------------------------------------------------------------------------------

    def _guarded(self, fn):
        if self.error is not None:
            raise RuntimeError(f"the tensor-parallel engine stopped after an error: {self.error}") from self.error
        if self.closed:
            raise RuntimeError("expected a running engine, got one that was shut down")
        self.ranks.step_started = time.monotonic()
        try:
            result = fn()
        except BaseException as err:
            raise self.fail(err) from err
        finally:
            self.ranks.step_started = None
        if self.ranks.dead_rank is not None:  # an aborted communicator may have returned garbage
            raise self.fail(RuntimeError(f"rank {self.ranks.dead_rank} exited during the step"))
        if self.ranks.timed_out:
            raise self.fail(WorkerError(f"a tensor-parallel step took longer than {TIMEOUT_ENV}"))
        return result

    def fail(self, cause: BaseException) -> BaseException:
        """Stop the engine after ``cause``; returns the exception to raise: the failing rank's error
        when one reported; after a failed or timed-out collective, the ranks that stopped answering
        (from their pulses, read over the seconds waited for a report); else ``cause``."""
        pulses = read_pulses(self.store, range(1, self.config.tensor_parallel_size))
        started = time.monotonic()
        error = self._rank_error()
        collective = _raised_by_collective(cause)
        if error is None and (collective or self.ranks.timed_out):
            after = read_pulses(self.store, range(1, self.config.tensor_parallel_size))
            silent = silent_ranks(pulses, after, time.monotonic() - started)
            limit = f"{TIMEOUT_ENV} = {step_timeout().total_seconds():g} s"
            if silent:
                error = WorkerError("; ".join(silent) + f" (rank 0 waits {limit} for a collective): {cause}")
            elif collective:
                error = WorkerError(
                    "a tensor-parallel collective failed and no rank reported an error (a rank that does not "
                    f"answer is given up on after {limit}): {cause}"
                )
        error = error or cause
        self.error = error
        self.shutdown()
        return error

    def _rank_error(self) -> WorkerError | None:
        """The error a rank reported, else the exit code of a rank that died, waiting up to
        ERROR_WAIT_S for either (a rank's report follows its failure by a moment)."""
        started = time.monotonic()
        while True:
            for rank in range(1, self.config.tensor_parallel_size):
                try:
                    if self.store.check([error_key(rank)]):
                        text = self.store.get(error_key(rank)).decode(errors="replace")
                        return WorkerError(f"tensor-parallel rank {rank} failed:\n{text}")
                except Exception:  # the store may have gone with its host
                    break
            waited = time.monotonic() - started
            exited = [(rank, p.poll()) for rank, p in enumerate(self.processes, 1) if p.poll() is not None]
            if exited and waited > 0.5:
                rank, code = exited[0]
                return WorkerError(f"tensor-parallel rank {rank} exited with code {code} (it reported no error)")
            if waited > ERROR_WAIT_S:
                return None
            time.sleep(0.05)


def _watch(ranks: _Ranks) -> None:
    """Notice a started rank exiting while the engine runs, or a step running past the step timeout,
    and abort the compute group, so that a step waiting on a collective that cannot complete ends.
    On gloo the waiting collective fails by itself (a closed connection, its own timeout); NCCL
    waits on the device and its own watchdog, at the same timeout, would end the whole process."""
    limit = STEP_DEADLINE * step_timeout().total_seconds()
    while not ranks.watch_stop.wait(0.2):
        group = ranks.tp.group if ranks.tp is not None else None
        on_device = group is not None and dist.get_backend(group) != "gloo"
        dead = [rank for rank, p in enumerate(ranks.processes, 1) if p.poll() is not None]
        started = ranks.step_started
        late = on_device and started is not None and time.monotonic() - started > limit
        if ranks.closed or not (dead or late):
            continue
        ranks.dead_rank = dead[0] if dead else None
        ranks.timed_out = late and not dead
        if on_device:
            with contextlib.suppress(Exception):  # best effort: else the step fails on its timeout
                group.abort()
        return


def _raised_by_collective(err: BaseException) -> bool:
    """Whether ``err`` was raised inside ``torch.distributed`` (a collective that failed or timed out)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("torch.distributed")
