"""The one timing helper: median of many samples, device events, inputs rotated past the L2 cache."""

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

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how far apart the samples lie."""
        return (self.p90_ms - self.p10_ms) / self.median_ms if self.median_ms > 0 else 0.0


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
    burst: int = 10,
    max_seconds: float = 3.0,
) -> Timing:
    """Time ``fn(inputs[i % len(inputs)])``: the median of ``runs`` samples, in milliseconds per call.

    On a GPU each sample is ``burst`` back-to-back calls between one pair of device events, the
    first event queued behind one more call: the device never waits for the host between calls,
    so the time is the device's, as in a busy engine or a CUDA graph replay, and launch costs count
    only where the host cannot keep up. On the CPU each sample is one call. The first ``warmup``
    calls (compilation, autotuning, allocator growth) are not counted. Sampling stops early after
    ``max_seconds`` of timed work, with at least 5 samples. ``burst=0`` times one call on an idle
    device instead (host launch latency included).
    """
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    synchronize(device)
    times = []
    spent = 0.0
    calls = 0
    for _ in range(runs):
        if device.type == "cpu":
            t0 = time.perf_counter()
            fn(inputs[calls % len(inputs)])
            calls += 1
            ms = (time.perf_counter() - t0) * 1e3
        else:
            start = torch.Event(device=device, enable_timing=True)
            end = torch.Event(device=device, enable_timing=True)
            if burst:
                fn(inputs[calls % len(inputs)])  # keeps the device busy while the burst is queued
                calls += 1
            start.record()
            for _ in range(max(burst, 1)):
                fn(inputs[calls % len(inputs)])
                calls += 1
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / max(burst, 1)
        times.append(ms)
        spent += ms / 1e3 * (1 if device.type == "cpu" else max(burst, 1))
        if spent > max_seconds and len(times) >= 5:
            break
    times.sort()
    pick = lambda f: times[min(len(times) - 1, int(f * len(times)))]
    return Timing(statistics.median(times), pick(0.1), pick(0.9), len(times))


def measure_graph(
    fn: Callable[[object], object],
    inputs: Sequence[object],
    device: torch.device,
    *,
    calls: int = 20,
    replays: int = 40,
    warmup_replays: int = 10,
) -> Timing:
    """Time ``fn`` as a captured CUDA graph replays it: per-call milliseconds, median of ``replays`` samples.

    One graph holds ``calls`` calls, rotating through ``inputs``; each sample is one replay between
    two device events, divided by ``calls``. Replays launch no host work, so short calls (a long
    decode of one sequence takes 0.1 ms) are timed without the host's pace or a queue that drains
    between bursts, and ``warmup_replays`` untimed replays first bring the clocks up. Devices
    without CUDA graphs fall back to :func:`measure`.
    """
    if device.type != "cuda":
        return measure(fn, inputs, device, runs=replays)
    for i in range(3):  # compile and settle allocations outside the capture
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(inputs[i % len(inputs)])
    for _ in range(warmup_replays):
        graph.replay()
    times = []
    for _ in range(replays):
        start = torch.Event(device=device, enable_timing=True)
        end = torch.Event(device=device, enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    times.sort()
    pick = lambda f: times[min(len(times) - 1, int(f * len(times)))]
    return Timing(statistics.median(times), pick(0.1), pick(0.9), len(times))


def measure_steady(fn: Callable[[object], object], inputs: Sequence[object], device: torch.device, **kwargs) -> Timing:
    """:func:`measure_graph`, or :func:`measure` (with ``kwargs``) for a call that a graph cannot capture
    (one that synchronises with the host, such as the reference backend's)."""
    try:
        return measure_graph(fn, inputs, device)
    except Exception:  # a capture that failed leaves nothing behind; time the call the other way
        torch.cuda.synchronize(device)
        return measure(fn, inputs, device, **kwargs)
