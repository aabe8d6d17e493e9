"""The one timing helper: median of many runs, device events, inputs rotated past the L2 cache."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..device import synchronize

ROTATE_BYTES = 512 << 20  # rotate through at least this much input: more than any GPU's L2 today


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int


def num_input_sets(bytes_per_set: int, *, at_least: int = 2, at_most: int = 16) -> int:
    """Input sets to rotate through so that one pass over them exceeds ``ROTATE_BYTES``."""
    return max(at_least, min(at_most, -(-ROTATE_BYTES // max(bytes_per_set, 1))))


def measure(
    fn: Callable[[object], object],
    inputs: Sequence[object],
    device: torch.device,
    *,
    warmup: int = 5,
    runs: int = 50,
    max_seconds: float = 3.0,
) -> Timing:
    """Time ``fn(inputs[i % len(inputs)])``; each run between its own pair of device events.

    The first ``warmup`` runs (compilation, autotuning, allocator growth) are not counted. Runs
    stop early after ``max_seconds`` of timed work, with at least 5 counted.
    """
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    synchronize(device)
    times = []
    spent = 0.0
    for i in range(runs):
        x = inputs[i % len(inputs)]
        if device.type == "cpu":
            t0 = time.perf_counter()
            fn(x)
            ms = (time.perf_counter() - t0) * 1e3
        else:
            start = torch.Event(device=device, enable_timing=True)
            end = torch.Event(device=device, enable_timing=True)
            start.record()
            fn(x)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        times.append(ms)
        spent += ms / 1e3
        if spent > max_seconds and len(times) >= 5:
            break
    times.sort()
    pick = lambda f: times[min(len(times) - 1, int(f * len(times)))]
    return Timing(statistics.median(times), pick(0.1), pick(0.9), len(times))
