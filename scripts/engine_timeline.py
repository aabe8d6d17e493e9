"""Where an engine step's time goes on a GPU, kernel by kernel and step by step (Llama-3-8B shape, random weights).

``PYTHONPATH=src python scripts/engine_timeline.py MODE --out FILE.json [--workdir DIR]`` from the repository
root, with MODE one of

* ``replay``: one decode-graph replay of ``--batch`` sequences over ``--context`` keys under torch.profiler:
  every kernel's start and end, their sum against the profiled span (idle time between kernels) and against
  the replay's event-timed wall time, beside the async step time of the same batch. ``--kernel-options``
  switches launch options as the engine benchmark does (e.g. ``no_pdl``); ``--model llama4`` / ``deepseek``
  replays the engine benchmark's 4-layer mixture shapes instead of the 8B's;
* ``mixed``: ``--batch`` sequences decoding over ``--context`` keys, then one prompt of each of
  ``--prompt-lens`` tokens arriving: the synchronous step that prefills it beside the decodes (a server's
  step when a request arrives), its wall time against the decode step alone, and one such step under
  torch.profiler (every kernel, their sum and the span against the wall: the host's share) and one under
  cProfile (the host's functions by their own time and with their callees: ``host_profile``); then,
  with the engine's own (async) scheduling, the wall time of each step call around each arrival (``gaps``:
  what a streaming client sees between tokens);
  ``--piecewise`` builds the engine with ``piecewise_graphs`` (steps of up to 512 tokens in captured pieces),
  ``--max-num-batched-tokens`` with that token budget;
* ``poisson``: the serving benchmark's Poisson load inside the process (no server): requests of 256-768
  prompt tokens (uniform) and ``--output-len`` tokens arriving at ``--rate`` a second for ``--seconds``,
  with the engine's own (async) scheduling; each ``engine.step()`` call's wall time and what it scheduled
  (decode rows, prompt tokens; whether a step was launched ahead of the previous step's read), and each request's
  token times: the ITL percentiles a client would see without the server's part, and the calls behind the
  slowest 2% of gaps;
* ``job``: the engine benchmark's offline job (256 requests of 1024 + 256 tokens, after the same untimed
  warm-up job): each ``engine.step``'s start and end (async decode steps included), the time from
  ``generate()`` to the first step, and the host's time between steps.

The checkpoint is written to ``--workdir`` (default /tmp/ck) once and reused.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import engine as bench


def cuda_kernels(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of the device events a torch.profiler run recorded, in start order."""
    return sorted(
        (e.time_range.start, e.time_range.end, e.name[:80])
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )


def host_functions(profile: cProfile.Profile, count: int = 45) -> str:
    """The ``count`` functions of a cProfile run with the most time of their own, then the most time
    with their callees: where the host's time of a step goes."""
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(count)
    return text.getvalue()


def replay(args, path: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    llm = bench.make_llm(path, max_num_seqs=max(args.batch, 16), max_model_len=args.context + 512,
                         kv_cache_memory=48 << 30)  # fmt: skip
    engine = llm.engine
    out = {"mode": "replay", "model": args.model, "batch": args.batch, "context": args.context}
    out["kernel_options"] = args.kernel_options
    bench.start_decoding(engine, args.batch, args.context, max_tokens=64)
    out["async_step_ms"] = bench.step_ms(engine, 10)
    with bench.synchronous(engine):
        for _ in range(2):
            engine.step()
        graphs = engine.runner.graphs
        graph = graphs.graphs[graphs.write_step(engine.scheduler.schedule())]
        out["replay_ms"] = bench.event_time_ms(graph.replay)
        graph.replay()
        bench.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            bench.sync()
    kernels = cuda_kernels(prof)
    out["kernels"] = kernels
    out["span_ms"] = (kernels[-1][1] - kernels[0][0]) / 1e3
    out["kernel_sum_ms"] = sum(end - start for start, end, _ in kernels) / 1e3
    out["idle_between_kernels_us"] = sum(max(0.0, b[0] - a[1]) for a, b in itertools.pairwise(kernels))
    print(f"batch {args.batch} {args.kernel_options}: replay {out['replay_ms']:.3f} ms (async step "
          f"{out['async_step_ms']:.3f}); profiled span {out['span_ms']:.3f} ms, kernel sum {out['kernel_sum_ms']:.3f} "
          f"ms, idle between kernels {out['idle_between_kernels_us']:.0f} us, {len(kernels)} kernels")  # fmt: skip
    return out


def mixed(args, path: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from portattn.engine.sampling_params import SamplingParams

    longest = max(args.prompt_lens)
    llm = bench.make_llm(path, max_num_seqs=args.batch + 4, max_model_len=args.context + longest + 256,
                         kv_cache_memory=48 << 30, piecewise_graphs=args.piecewise, **budget(args))  # fmt: skip
    engine = llm.engine
    bench.start_decoding(engine, args.batch, args.context, max_tokens=1000)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)  # done at its prefill: no decode after
    out = {"mode": "mixed", "model": args.model, "batch": args.batch, "context": args.context, "rows": []}
    out |= {"piecewise": args.piecewise, "kernel_options": args.kernel_options}
    seed = itertools.count(100)
    with bench.synchronous(engine):
        out["decode_step_ms"] = bench.step_ms(engine, 10)

        def arrival_step(length: int) -> float:
            """Wall ms of the step that prefills a new prompt of ``length`` tokens beside the decodes."""
            engine.add_request(bench.random_prompts(1, length, engine.vocab_size, seed=next(seed))[0], one)
            bench.sync()
            t0 = time.perf_counter()
            engine.step()
            bench.sync()
            return (time.perf_counter() - t0) * 1e3

        for length in args.prompt_lens:
            arrival_step(length)  # untimed: a first step of this shape
            walls = [arrival_step(length) for _ in range(5)]
            engine.add_request(bench.random_prompts(1, length, engine.vocab_size, seed=next(seed))[0], one)
            bench.sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                engine.step()
                bench.sync()
                profiled_ms = (time.perf_counter() - t0) * 1e3
            kernels = cuda_kernels(prof)
            engine.add_request(bench.random_prompts(1, length, engine.vocab_size, seed=next(seed))[0], one)
            bench.sync()
            host = cProfile.Profile()
            with host:
                engine.step()
                bench.sync()
            row = {
                "prompt_len": length,
                "step_ms": statistics.median(walls),
                "step_ms_all": walls,
                "profiled_wall_ms": profiled_ms,
                "kernel_sum_ms": sum(end - start for start, end, _ in kernels) / 1e3,
                "span_ms": (kernels[-1][1] - kernels[0][0]) / 1e3 if kernels else 0.0,
                "kernels": kernels,
                "host_profile": host_functions(host),
            }
            out["rows"].append(row)
            print(f"{args.batch} decodes over {args.context} + a prompt of {length}: step {row['step_ms']:.2f} ms "
                  f"(decode step alone {out['decode_step_ms']:.2f}); kernels {row['kernel_sum_ms']:.2f} ms over a span "
                  f"of {row['span_ms']:.2f} ms, {len(kernels)} kernels", flush=True)  # fmt: skip
    out["gaps"] = [arrival_gaps(engine, length, seed) for length in args.prompt_lens]
    return out


def arrival_gaps(engine, length: int, seed) -> dict:
    """With the engine's own scheduling (async where it has it): the wall ms of each ``engine.step()``
    call, 8 before and 8 after a prompt of ``length`` tokens arrives, the step that admits it marked.
    Each call returns one token of every decoding sequence, so these are the gaps a streaming client
    sees."""
    from portattn.engine.sampling_params import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    walls, arrival = [], 8
    for i in range(2 * arrival):
        if i == arrival:
            engine.add_request(bench.random_prompts(1, length, engine.vocab_size, seed=next(seed))[0], one)
        t0 = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - t0) * 1e3)
    bench.sync()
    print(f"  arrival of {length} tokens, ms per step call (the arrival at [{arrival}]): "
          + " ".join(f"{w:.1f}" for w in walls), flush=True)  # fmt: skip
    return {"prompt_len": length, "arrival_index": arrival, "step_call_ms": walls}


def budget(args) -> dict:
    """The engine's token budget from ``--max-num-batched-tokens`` (none given: the engine's default)."""
    return {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}


def scheduled_rows(engine) -> list:
    """Spy on the scheduler: the list it returns gets ``(decode rows, prompt tokens)`` of each step it
    schedules (synchronously or ahead), until it is cleared."""
    seen, schedule = [], engine.scheduler._schedule

    def spy(*args, **kwargs):
        scheduled = schedule(*args, **kwargs)
        if scheduled:
            seen.append((sum(n == 1 for _, n in scheduled), sum(n for _, n in scheduled if n != 1)))
        return scheduled

    engine.scheduler._schedule = spy
    return seen


def poisson(args, path: str) -> dict:
    import random

    from portattn.engine.sampling_params import SamplingParams

    rng = random.Random(0)
    arrivals, t = [], 0.0
    while t < args.seconds:
        t += rng.expovariate(args.rate)
        arrivals.append((t, rng.randint(256, 768)))
    longest = max(n for _, n in arrivals) + args.output_len
    llm = bench.make_llm(path, max_num_seqs=256, max_model_len=longest + 16, piecewise_graphs=args.piecewise,
                         **budget(args))  # fmt: skip
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = [bench.random_prompts(1, n, engine.vocab_size, seed=1000 + i)[0] for i, (_, n) in enumerate(arrivals)]
    llm.generate(prompts[:8], params, use_tqdm=False)  # untimed: the load's first prompts through the engine once
    from portattn.kernels.triton.compile_ahead import on_compile, variant

    compiles = []  # Triton compiles during the load: (seconds into it, kernel, seconds, variant)
    on_compile(lambda name, seconds, src: compiles.append((time.perf_counter() - t0, name, seconds, variant(src))))
    ahead = engine.run_ahead
    seen = scheduled_rows(engine)
    calls, tokens = [], {}  # (start s, wall ms, [(decode rows, prompt tokens) scheduled], launched ahead); seq -> times
    bench.sync()
    t0 = time.perf_counter()
    pending = list(zip(arrivals, prompts))
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0][0][0] <= now:
            seq = engine.add_request(pending.pop(0)[1], params)
            tokens[seq] = []
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0][0] - now))
            continue
        before = ahead.steps_ahead if ahead is not None else 0
        start = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        calls.append((start - t0, (end - start) * 1e3, list(seen), ahead is not None and ahead.steps_ahead > before))
        seen.clear()
        for seq, times in tokens.items():
            made = seq.num_tokens - seq.num_prompt_tokens
            times.extend([end - t0] * (made - len(times)))
    gaps = sorted((b - a) * 1e3 for times in tokens.values() for a, b in itertools.pairwise(times))
    median = statistics.median(gaps)
    pct = {str(q): gaps[min(len(gaps) - 1, int(q / 100 * len(gaps)))] for q in (50, 90, 95, 98, 99)}
    walls = [c[1] for c in calls]
    # under async scheduling a call reads the step the call before it launched: its wall is mostly that step's
    slow = sorted(range(1, len(calls)), key=lambda i: -walls[i])[: max(1, len(calls) // 50)]
    chunk = {i for i in range(1, len(calls)) if any(p for _, p in calls[i - 1][2])}
    out = {
        "mode": "poisson", "rate": args.rate, "seconds": args.seconds, "output_len": args.output_len,
        "requests": len(arrivals), "budget": args.max_num_batched_tokens, "piecewise": args.piecewise,
        "itl_ms": pct, "itl_p99_over_median": pct["99"] / median, "calls": calls, "compiles": compiles,
        "slowest_calls": [{"call": i, "wall_ms": walls[i], "before": calls[i - 1][2], "scheduled": calls[i][2],
                           "ahead": calls[i][3]} for i in slow],
        "mean_call_ms": statistics.mean(walls),
        "after_chunk_ms": statistics.median([walls[i] for i in chunk] or [0]),
        "after_decode_ms": statistics.median([walls[i] for i in range(1, len(calls)) if i not in chunk] or [0]),
    }  # fmt: skip
    print(f"poisson {args.rate}/s for {args.seconds} s: {len(calls)} step calls, ITL p50 {pct['50']:.2f} "
          f"p90 {pct['90']:.2f} p99 {pct['99']:.2f} ms = {out['itl_p99_over_median']:.2f}x the median; calls after "
          f"one that scheduled a chunk {out['after_chunk_ms']:.2f} ms, others {out['after_decode_ms']:.2f} ms; "
          f"launched ahead {sum(c[3] for c in calls)} of {len(calls)}", flush=True)  # fmt: skip
    for at, name, seconds, what in compiles:
        print(f"  compiled {name} at {at:.1f} s in {seconds:.1f} s: {what}", flush=True)
    for row in out["slowest_calls"][:20]:
        print(f"  slow call {row['call']}: {row['wall_ms']:.2f} ms; (decodes, prompt tokens) scheduled by the call "
              f"before {row['before']}, by it {row['scheduled']}, ahead {row['ahead']}", flush=True)  # fmt: skip
    return out


def job(args, path: str) -> dict:
    from portattn.engine.sampling_params import SamplingParams

    llm = bench.make_llm(path, max_num_seqs=256, max_model_len=1024 + 256 + 16, kv_cache_memory=48 << 30,
                         chunked_prefill_size=16384)  # fmt: skip
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(bench.random_prompts(256, 1024, engine.vocab_size, seed=2), params, use_tqdm=False)  # warm-up
    step, steps = engine.step, []

    def timed():
        start = time.perf_counter()
        finished = step()
        steps.append((start, time.perf_counter(), len(engine.scheduler.running)))
        return finished

    engine.step = timed
    bench.sync()
    t0 = time.perf_counter()
    try:
        llm.generate(bench.random_prompts(256, 1024, engine.vocab_size, seed=1), params, use_tqdm=False)
        bench.sync()
    finally:
        del engine.step
    seconds = time.perf_counter() - t0
    walls = [(end - start) * 1e3 for start, end, _ in steps]
    out = {
        "mode": "job",
        "seconds": seconds,
        "queue_seconds": steps[0][0] - t0,
        "between_steps_seconds": sum(b[0] - a[1] for a, b in itertools.pairwise(steps)),
        "after_last_step_seconds": t0 + seconds - steps[-1][1],
        "steps": [(start - t0, end - t0, running) for start, end, running in steps],
        "median_step_ms": statistics.median(walls),
    }
    print(
        f"job {seconds:.3f} s, {len(steps)} steps: {out['queue_seconds']:.3f} s before the first step, "
        f"{out['between_steps_seconds']:.3f} s between steps, median step {out['median_step_ms']:.1f} ms"
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["replay", "mixed", "poisson", "job"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ck"))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1152)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[256, 512, 768],
                        help="mixed: the arriving prompts' lengths")  # fmt: skip
    parser.add_argument("--kernel-options", nargs="*", default=[], choices=sorted(bench.KERNEL_OPTIONS))
    parser.add_argument("--piecewise", action="store_true",
                        help="mixed, poisson: eager steps in captured pieces (piecewise_graphs)")  # fmt: skip
    parser.add_argument("--rate", type=float, default=16.0, help="poisson: requests a second")
    parser.add_argument("--seconds", type=float, default=25.0, help="poisson: how long requests arrive")
    parser.add_argument("--output-len", type=int, default=128, help="poisson: tokens a request generates")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="mixed, poisson: the engine's token budget (its pieces' buckets follow it; a prompt "
                             "longer than the budget arrives as chunks)")  # fmt: skip
    parser.add_argument("--model", default="llama3_8b", choices=["llama3_8b", "llama4", "deepseek"],
                        help="replay: the 8B shape (32 layers) or a family part's shape (4 layers)")  # fmt: skip
    args = parser.parse_args()
    bench.apply_kernel_options(args.kernel_options)
    if args.model == "llama3_8b":
        path = bench.checkpoint("llama3_8b_32l", bench.llama3_8b_config(32), args.workdir)
    else:
        config = (bench.llama4_config if args.model == "llama4" else bench.deepseek_v3_config)(4)
        path = bench.checkpoint(f"{args.model}_4l", config, args.workdir)
    with torch.inference_mode():
        out = {"replay": replay, "mixed": mixed, "poisson": poisson, "job": job}[args.mode](args, path)
    args.out.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
