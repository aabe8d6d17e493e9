"""The ranks other than 0: build the same engine, then run each step rank 0 sends until it says stop.

A rank that fails records its traceback in the job's store (:func:`report_error`) and exits at
once, which closes its connections: rank 0's pending collective fails and rank 0 raises that
traceback from ``generate``. A rank the engine started also exits when rank 0's process goes away
(its stdin, which only rank 0 holds open, reaches end of file). While it serves, a rank publishes
its pulse (:mod:`.liveness`), from which rank 0 tells a rank that stopped answering. SIGINT is ignored
(a terminal's Ctrl-C reaches every process of its foreground group; rank 0's decides).

A started rank registers what rank 0's process had registered when it started the ranks: the
model architectures (``portattn.models.register_model``) and the attention backends
(``portattn.backends.registry.register_backend``), by their ``"module:Class"`` targets, importable
through rank 0's ``sys.path``. Under torchrun every rank runs the user's program, which registers them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import sys
import threading
import traceback

import torch

from ...backends.registry import register_backend
from ...distributed.group import TPGroup
from ...models import register_model
from ..engine import Engine
from .liveness import Pulse
from .process_group import broadcast_message, check_groups, destroy_groups, init_groups, rank_device, use_device
from .protocol import STOP, CallMessage, SequenceMirror, StepMessage

logger = logging.getLogger("portattn")


def error_key(rank: int) -> str:
    return f"portattn/tp/error/{rank}"


def joined_key(rank: int) -> str:
    return f"portattn/tp/joined/{rank}"


def report_error(store, rank: int) -> None:
    """Put the current exception's traceback where rank 0 reads it (best effort: the store may be gone)."""
    with contextlib.suppress(Exception):
        store.set(error_key(rank), traceback.format_exc())


def serve(engine: Engine, tp: TPGroup, pulse: Pulse) -> None:
    """Run rank 0's steps on this rank's shard until rank 0 sends :data:`STOP`."""
    mirror = SequenceMirror(engine.req_pool)
    while True:
        message = broadcast_message(None, tp)
        pulse.received()
        if message == STOP:
            return
        if isinstance(message, CallMessage):
            message.fn(engine, *message.args)
        elif isinstance(message, StepMessage):
            engine.runner.forward(mirror.apply(message), message.logit_rows, message.cascade)
        else:
            raise RuntimeError(f"expected a step, call or stop message from rank 0, got {type(message).__name__}")
        pulse.done()


def run_rank(config, tp: TPGroup, device: torch.device, store) -> None:
    """Build this rank's engine (same code as rank 0's), check in with the others, and serve."""
    engine = Engine(dataclasses.replace(config, device=device), tp=tp)
    pulse = Pulse(store, tp.rank)  # published before the check-in: rank 0 finds it from its first step
    check_groups(tp)
    serve(engine, tp, pulse)


def register_all(models: dict[str, str], backends: dict[str, str]) -> None:
    """Register rank 0's model architectures and attention backends (``"module:Class"`` targets)."""
    for architecture, target in models.items():
        register_model(architecture, target)
    for name, target in backends.items():
        register_backend(name, target)


def _exit_with_parent(stdin) -> None:
    def watch():
        with contextlib.suppress(OSError):
            while stdin.read(1 << 16):  # rank 0 never writes again: EOF when its process is gone
                pass
        os._exit(1)

    threading.Thread(target=watch, name="portattn-parent-watch", daemon=True).start()


def worker_main() -> None:
    """Entry point of a rank started by the engine (``python -m portattn.engine.parallel.worker``): its
    arguments come pickled on stdin, which rank 0 then keeps open for as long as it lives."""
    import torch.distributed as dist

    # Ctrl-C in a terminal signals the whole foreground group: rank 0's process decides (portattn serve drains
    # its streams first, with every rank stepping), and this rank ends with it (stdin's end, or its stop).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    args = pickle.load(stdin)
    config, rank, world_size = args["config"], args["rank"], args["world_size"]
    sys.path[:] = args["sys_path"]  # rank 0's import path: the models it registered import here too
    _exit_with_parent(stdin)
    logging.basicConfig(level=args["log_level"], format=f"%(name)s[rank {rank}]: %(message)s")
    store = None
    try:
        register_all(args["models"], args["backends"])
        if config.device.type == "cpu":  # the ranks share the host's cores
            torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
        store = dist.TCPStore(args["host"], args["port"], world_size, is_master=False)
        device = rank_device(config.device, rank)
        use_device(device)
        store.set(joined_key(rank), "1")  # rank 0 waits for every rank to get this far
        tp = init_groups(device, rank, world_size, store)
        run_rank(config, tp, device, store)
        destroy_groups()
    except BaseException:
        report_error(store, rank)
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)  # now: closing the connections is what unblocks rank 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not a normal interpreter exit: the stdin watcher is still reading


if __name__ == "__main__":
    worker_main()
