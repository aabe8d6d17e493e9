"""The garbage collector's pauses in a serving process: the start-up's objects frozen out of its reach, and a
collection that stops every thread for long logged (``portattn serve``'s process and the engine's own process
with ``--engine-process``)."""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger("portattn")

SLOW_COLLECTION_S = 0.02  # a garbage collection that stops every thread this long is logged


def freeze_start_up_objects() -> None:
    """Move the objects alive after the start-up (the model's modules, torch's, transformers' and Triton's
    own) out of the garbage collector's reach (``gc.freeze``, as vLLM's engine process does), after
    collecting what is garbage already: a full collection while serving then looks only at what was made
    since. A full collection stops every thread: the start-up's took 10-160 ms each in a CPU server of a
    tiny model, and five of six servers on an H200 machine had every stream stop once for 227-287 ms,
    which such a collection would explain (benchmarks/results/engine_h200/round26/NOTES.md); with the
    freeze none of eight had such a stop (round 27). For ``portattn serve``'s own process: an application
    that builds the app itself decides for its process."""
    gc.collect()
    gc.freeze()


def log_slow_collections(threshold_s: float):
    """Log every garbage collection of ``portattn serve``'s process that takes at least ``threshold_s``
    (its generation, time and what it freed): while it runs no thread runs, so every stream's next
    token waits for it. Returns the ``gc.callbacks`` entry (remove it to stop)."""
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        if took >= threshold_s:
            logger.warning(
                "garbage collection of generation %d took %.0f ms (%d objects freed); no thread ran meanwhile",
                info["generation"],
                took * 1e3,
                info["collected"],
            )

    gc.callbacks.append(callback)
    return callback
