"""Every engine step of a load, timed: ``python -m benchmarks.step_trace CHECKPOINT [engine flags] --out F``.

The engine (built as the server builds it: ``--max-num-batched-tokens``, ``--quantization``,
``--piecewise-graphs`` ... as ``portattn serve`` takes them) runs a load without HTTP in between:
``--burst N`` prompts of ``--input-len`` random tokens queued at once (or arriving as a Poisson process of
``--rate`` a second; ``--range-ratio`` spreads the lengths uniformly by that fraction), each generating
``--output-len`` tokens (``ignore_eos``). Each ``Engine.step`` call is timed on the host (with asynchronous scheduling a
call returns once the next step is launched, so the calls' times follow the device's), beside what the
step scheduled: decodes, prompt tokens, running and waiting sequences. Also logged with their times:
Triton compiles and cache loads in this process (``triton.knobs.runtime`` hooks), decode graphs recorded
lazily, the caching allocator's calls to the driver (on a GPU) and the garbage collector's passes: the host
events that stall a step without being part of it. Each step's host time inside the runner's launches
(``launch_ms``: the eager forward and sampling queued, or a decode graph's replay) is kept apart: a launch
normally queues work and returns, so one that takes a step's time waited for the device inside it (a
synchronizing call, or a kernel loaded at its first use, which waits for the work queued before it).
``--skip-logits-warm-up`` leaves out the warm-up's LM head at every row count (``ModelRunner.warm_logits``),
to see what it takes out of a load's steps.

Printed: the steps over ``--slow`` times the median of their kind (decode-only or mixed), each with the
events inside it; written: every step as JSON, for a plot or a closer look. ``--profile STEP:COUNT``: the
kernels of those steps by time (``torch.profiler``), printed and written beside ``--out``. The objects alive
before the load are kept out of the garbage collector's reach during it (``frozen_gc``), as the server keeps its
start-up's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

from .engine import KERNEL_OPTIONS, apply_kernel_options
from .serve import latency_stats


def _hooks(events: list, start: float) -> None:
    """Record Triton's compiles (and loads from its disk cache) and the collector's passes in ``events``."""

    def compiled(*args, **kwargs):
        events.append({"t": time.perf_counter() - start, "kind": "triton", "what": str(kwargs.get("repr", ""))[:200]})
        return None

    try:
        import triton

        triton.knobs.runtime.jit_cache_hook = compiled
    except (ImportError, AttributeError):
        pass
    passes: dict[int, float] = {}

    def collected(phase: str, info: dict) -> None:
        if phase == "start":
            passes[info["generation"]] = time.perf_counter()
        else:
            began = passes.pop(info["generation"], time.perf_counter())
            events.append(
                {
                    "t": began - start,
                    "kind": "gc",
                    "what": f"generation {info['generation']}, {1e3 * (time.perf_counter() - began):.1f} ms",
                }
            )

    gc.callbacks.append(collected)


def _time_launches(runner) -> list[float]:
    """Add the host's seconds inside ``runner``'s launches (eager steps and decode graphs) to the returned
    one-element list."""
    spent = [0.0]

    def timed(launch):
        def wrapper(*args, **kwargs):
            began = time.perf_counter()
            try:
                return launch(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - began

        return wrapper

    runner.launch = timed(runner.launch)
    if runner.graphs is not None:
        runner.graphs.launch = timed(runner.graphs.launch)
    return spent


def _allocator_counts() -> dict:
    import torch

    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")}


def _start_profiler(cuda: bool):
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    profiler = torch.profiler.profile(activities=activities)
    profiler.__enter__()
    return profiler


def _report_profile(profiler, cuda: bool, first: int, count: int, out: Path | None) -> None:
    """The profiled steps' kernels (or host ops, without a GPU) by total time, printed and written beside
    ``out`` (``.profile.txt``)."""
    import torch

    if cuda:
        torch.cuda.synchronize()
    profiler.__exit__(None, None, None)
    table = profiler.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=40)
    text = f"steps {first} to {first + count - 1}\n{table}"
    print(text)
    if out is not None:
        out.with_suffix(".profile.txt").write_text(text)


@contextlib.contextmanager
def frozen_gc():
    """The objects alive on entry (the engine's among them) out of the garbage collector's reach for the load, as
    the server's processes keep theirs (``portattn.server.gc_pauses``): a full collection during the load looks
    only at newer objects (round 38's engine-alone burst had one of 207 ms in its middle). Yields ``[count]`` of
    the objects frozen; undone on exit."""
    gc.collect()
    gc.freeze()
    try:
        yield [gc.get_freeze_count()]
    finally:
        gc.unfreeze()


def main(argv: list[str] | None = None) -> int:
    from portattn.engine import LLM, SamplingParams
    from portattn.engine.arguments import add_flags, given
    from portattn.engine.config import EngineConfig
    from portattn.engine.sequence import Status

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--burst", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rate", type=float, default=float("inf"), help="arrivals a second (inf: all at once)")
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--slow", type=float, default=1.5, help="steps over this many times their kind's median")
    parser.add_argument(
        "--profile", metavar="STEP:COUNT", help="torch.profiler over COUNT steps from step STEP: kernels by time"
    )
    parser.add_argument("--skip-logits-warm-up", action="store_true", help="no LM head warm-up at every row count")
    parser.add_argument(
        "--kernel-options", nargs="*", default=[], choices=sorted(KERNEL_OPTIONS),
        help="launch options away from their defaults (benchmarks/engine.py says what each does)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path)
    add_flags(parser, EngineConfig, exclude=("model",))
    args = parser.parse_args(argv)
    apply_kernel_options(args.kernel_options)
    if args.skip_logits_warm_up:
        from portattn.engine.model_runner import ModelRunner

        ModelRunner.warm_logits = lambda self, max_rows: None
    llm = LLM(**{**given(args, EngineConfig), "model": args.model})
    engine = llm.engine
    vocab = engine.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    events: list = []
    arrivals, t = [], 0.0
    for _ in range(args.burst):
        low, high = int(args.input_len * (1 - args.range_ratio)), int(args.input_len * (1 + args.range_ratio))
        arrivals.append((t, [rng.randrange(100, vocab) for _ in range(rng.randint(max(low, 1), max(high, 1)))]))
        t += rng.expovariate(args.rate) if args.rate != float("inf") else 0.0
    arrivals.reverse()
    steps = []
    scheduler = engine.scheduler
    start = time.perf_counter()
    _hooks(events, start)
    launching = _time_launches(engine.runner)
    graphs = engine.runner.graphs
    captured = graphs.num_captured if graphs is not None else 0
    cuda = engine.config.device.type == "cuda"
    allocator = _allocator_counts() if cuda else None
    profile_from, profile_count = map(int, args.profile.split(":")) if args.profile else (-1, 0)
    profiler = None
    streams: dict = {}  # sequence -> [time added, tokens seen, time of the last one]
    ttft: list[float] = []
    itl: list[float] = []
    with frozen_gc() as frozen:
        while arrivals or engine.has_unfinished():
            while arrivals and arrivals[-1][0] <= time.perf_counter() - start:
                streams[engine.add_request(arrivals.pop()[1], params)] = [time.perf_counter(), 0, 0.0]
            if not engine.has_unfinished():
                time.sleep(max(0.0, arrivals[-1][0] - (time.perf_counter() - start)))
                continue
            prompt, generated = engine.num_prompt_tokens_computed, engine.num_generated_tokens
            running, waiting = len(scheduler.running), len(scheduler.waiting)
            decodes = sum(seq.num_tokens - seq.num_computed <= 1 for seq in scheduler.running)
            if len(steps) == profile_from:
                profiler = _start_profiler(cuda)
            launched = launching[0]
            began = time.perf_counter()
            engine.step()
            ended = time.perf_counter()
            for seq, seen in list(streams.items()):  # the tokens the host has now: first tokens and gaps
                count = seq.num_output_tokens
                if count > seen[1]:
                    (ttft if seen[1] == 0 else itl).append(ended - (seen[0] if seen[1] == 0 else seen[2]))
                    itl.extend([0.0] * (count - seen[1] - 1))  # (several in one step)
                    seen[1], seen[2] = count, ended
                if seq.status is Status.FINISHED:
                    del streams[seq]
            if profiler is not None and len(steps) + 1 == profile_from + profile_count:
                _report_profile(profiler, cuda, profile_from, profile_count, args.out)
                profiler = None
            if graphs is not None and graphs.num_captured != captured:
                recorded = f"{graphs.num_captured - captured} recorded"
                events.append({"t": began - start, "kind": "graph", "what": recorded})
                captured = graphs.num_captured
            if cuda:  # the caching allocator's calls to the driver (a retry frees cached blocks: a device sync)
                now = _allocator_counts()
                moved = {k: now[k] - allocator[k] for k in now if now[k] != allocator[k]}
                if moved:
                    events.append({"t": began - start, "kind": "allocator", "what": str(moved)})
                allocator = now
            steps.append(
                {
                    "t": began - start,
                    "ms": 1e3 * (ended - began),
                    "launch_ms": 1e3 * (launching[0] - launched),
                    "running": running,
                    "waiting": waiting,
                    "decodes": decodes,
                    "prompt_tokens": engine.num_prompt_tokens_computed - prompt,
                    "generated": engine.num_generated_tokens - generated,
                }
            )
    total = time.perf_counter() - start
    llm.shutdown()
    medians = {}
    for kind in ("decode", "mixed"):
        times = [s["ms"] for s in steps if (s["prompt_tokens"] > 0) == (kind == "mixed")]
        medians[kind] = statistics.median(times) if times else None
    print(
        f"{len(steps)} steps in {total:.2f} s; median decode-only {medians['decode']} ms, mixed {medians['mixed']} ms"
    )
    latency = {"ttft": latency_stats(ttft), "itl": latency_stats(itl)}  # (as the serving benchmark reports them)
    if ttft and itl:
        first, gaps = latency["ttft"], latency["itl"]
        print(
            f"engine alone: TTFT mean {first['mean_ms'] / 1e3:.3f} s (max {max(ttft):.3f}); ITL median "
            f"{gaps['median_ms']:.1f} ms, p90 {gaps['p90_ms']:.1f}, p99 {gaps['p99_ms']:.1f} "
            f"({gaps['p99_ms'] / gaps['median_ms']:.2f}x the median)"
        )
    waited = [
        s for s in steps if s["launch_ms"] > 0.5 * (medians["mixed" if s["prompt_tokens"] > 0 else "decode"] or 1e9)
    ]
    print(
        f"launches that waited (over half their kind's median step): {len(waited)}"
        + "".join(f"\n  at {s['t']:.3f} s: {s['launch_ms']:.1f} ms, decodes {s['decodes']}" for s in waited)
    )
    for s in steps:
        median = medians["mixed" if s["prompt_tokens"] > 0 else "decode"]
        if median and s["ms"] > args.slow * median:
            inside = [e for e in events if s["t"] <= e["t"] <= s["t"] + s["ms"] / 1e3]
            print(
                f"slow step at {s['t']:.3f} s: {s['ms']:.1f} ms (median {median:.1f}; launching "
                f"{s['launch_ms']:.1f}), decodes {s['decodes']}, "
                f"prompt tokens {s['prompt_tokens']}, running {s['running']}, waiting {s['waiting']}; events: "
                + ("; ".join(f"{e['kind']} {e['what']}" for e in inside) or "none")
            )
    for e in events:
        if e["kind"] == "triton":
            print(f"triton at {e['t']:.3f} s: {e['what']}")
    if args.out:
        args.out.write_text(json.dumps({"medians": medians, "latency": latency, "total_s": total, "steps": steps,
                                        "events": events, "gc_frozen_objects": frozen[0]}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
