"""Tensor-parallel benchmark on GPUs: ``python -m benchmarks.tp [--out DIR] [--checkpoint DIR]``.

A Llama-3-8B-shaped checkpoint (32 layers, hidden 4096, 32 query / 8 KV heads, MLP 14336, vocab
128256) with random bf16 weights (:mod:`.random_checkpoint`) is written to a temporary folder (or
to ``--checkpoint``, and read from there on later runs), then run at TP=1 and TP=2 in one process:

* greedy tokens of TP=2 against TP=1 (random weights give flat logits: where tokens part, the
  TP=1 gap between the two best logits at that step is reported, to tell a near-tie from an error);
* decode step time at batch 1 and 64 (prompts of 128 tokens; the median engine step once every
  sequence decodes; the step is synchronous, ending in the sampled tokens' copy to the host);
* offline throughput (``LLM.generate`` over 128 prompts of 128 tokens, 128 new tokens each);
* at TP=2: the all-reduce time inside those decode steps (rank 0's NCCL kernels under the profiler),
  the same all-reduces timed alone, and the bus bandwidth NCCL reaches between the two GPUs over a
  sweep of message sizes (``2 (n - 1) / n * bytes / time``).

Writes ``tp.json`` and ``tp_notes.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .random_checkpoint import SHAPES, write_random_llama

TARGET_BATCH1_RATIO = 0.6  # batch-1 decode step at TP=2 over TP=1


def prompts(count: int, length: int, seed: int, vocab: int = 500) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (count, length), generator=g).tolist()  # 0, 1: bos, eos


def greedy(llm, batch: list[list[int]], max_tokens: int):
    from portattn.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, return_logits=True)
    return llm.generate(batch, params, use_tqdm=False)


def decode_steps(llm, batch: int, steps: int, profile: bool = False) -> tuple[list[float], float | None]:
    """Wall times (ms) of ``steps`` engine steps in which all ``batch`` sequences decode; with
    ``profile``, also the NCCL kernel time per step (ms) on this rank."""
    from portattn.engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    seqs = [engine.add_request(ids, params) for ids in prompts(batch, 128, seed=batch)]
    while not all(seq.num_output_tokens for seq in seqs):
        engine.step()
    for _ in range(2):  # warm-up decodes
        engine.step()
    times, nccl_ms = [], None
    if profile and engine.config.device.type != "cpu":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        with profiler(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps // 2):
                engine.step()
        nccl_us = sum(e.device_time_total for e in prof.key_averages() if "nccl" in e.key.lower())
        nccl_ms = nccl_us / 1000 / (steps // 2)
    else:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1000)
    for seq in seqs:
        if seq.request_id in engine.requests:
            engine.abort(seq.request_id)
    return times, nccl_ms


def throughput(llm, count: int = 128, length: int = 128, new: int = 128) -> dict:
    from portattn.engine.sampling_params import SamplingParams

    batch = prompts(count, length, seed=7)
    start = time.perf_counter()
    out = llm.generate(batch, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in out)
    return dict(
        seconds=seconds,
        output_tokens_per_s=generated / seconds,
        total_tokens_per_s=(generated + count * length) / seconds,
    )


def time_all_reduce(engine, numel: int, iters: int) -> float:
    """Milliseconds per all-reduce of ``numel`` bf16 elements over the engine's group (every rank runs this)."""
    device = engine.config.device
    x = torch.ones(numel, dtype=torch.bfloat16, device=device)
    for _ in range(5):
        engine.tp.all_reduce(x)
    if device.type == "cpu":
        start = time.perf_counter()
        for _ in range(iters):
            engine.tp.all_reduce(x)
        return (time.perf_counter() - start) * 1000 / iters
    torch.accelerator.synchronize()
    start, end = torch.Event(device=device, enable_timing=True), torch.Event(device=device, enable_timing=True)
    start.record()
    for _ in range(iters):
        engine.tp.all_reduce(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def run(tp: int, path: str, args, device: torch.device) -> tuple[dict, list]:
    from portattn.engine.llm import LLM

    start = time.perf_counter()
    llm = LLM(
        path,
        device=str(device),
        dtype="bfloat16",
        tensor_parallel_size=tp,
        max_num_seqs=128,
        kv_cache_memory=args.kv_cache_gib << 30,
        max_model_len=1024,
    )
    result = dict(tensor_parallel_size=tp, start_s=time.perf_counter() - start)
    outputs = greedy(llm, prompts(8, 64, seed=1), args.greedy_tokens)
    for batch in (1, 64):
        times, _ = decode_steps(llm, batch, args.steps)
        result[f"decode_b{batch}_ms"] = statistics.median(times)
        result[f"decode_b{batch}_ms_p10_p90"] = [statistics.quantiles(times, n=10)[i] for i in (0, 8)]
    result["throughput"] = throughput(llm)
    if tp > 1:
        from . import tp as this  # the other ranks import the function by module name (not __main__)

        shape = SHAPES[args.shape]
        hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]  # two all-reduces per layer
        for batch in (1, 64):
            _, nccl_ms = decode_steps(llm, batch, args.steps, profile=True)
            alone = llm.engine.call(this.time_all_reduce, batch * hidden, 100)
            result[f"allreduce_b{batch}"] = dict(
                in_step_nccl_ms=nccl_ms,  # NCCL kernels of one decode step on rank 0 (logit gather included)
                alone_ms_each=alone,
                alone_ms_per_step=alone * 2 * layers,  # two all-reduces per layer
                share_of_step=nccl_ms / result[f"decode_b{batch}_ms"] if nccl_ms is not None else None,
            )
        sweep = []
        for mib in args.sweep_mib:
            numel = (mib << 20) // 2
            ms = llm.engine.call(this.time_all_reduce, numel, 20)
            bus = 2 * (tp - 1) / tp * (mib << 20) / (ms / 1000) / 1e9
            sweep.append(dict(mib=mib, ms=ms, bus_gb_s=bus))
        result["bandwidth_sweep"] = sweep
    llm.shutdown()
    del llm
    gc.collect()
    return result, outputs


def compare(one: list, two: list) -> dict:
    """Greedy tokens of TP=2 against TP=1; where they part, TP=1's gap between its two best logits."""
    parted = []
    for i, (a, b) in enumerate(zip(one, two)):
        if a.token_ids != b.token_ids:
            step = next(j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
            top2 = a.logits[step].topk(2).values
            parted.append(dict(prompt=i, step=step, tp1_top2_gap=float(top2[0] - top2[1])))
    first_rel = max(float((b.logits[0] - a.logits[0]).abs().max() / a.logits[0].abs().max()) for a, b in zip(one, two))
    return dict(equal=not parted, prompts=len(one), parted=parted, first_token_logits_max_rel_err=first_rel)


def notes(results: dict) -> str:
    one, two = results["tp1"], results["tp2"]
    lines = [f"# Tensor parallelism: {results['shape']} shape, bf16, random weights", ""]
    lines.append(
        f"- greedy tokens TP=2 vs TP=1: {'equal' if results['tokens']['equal'] else 'parted'} "
        f"({results['tokens']['prompts']} prompts x {results['greedy_tokens']} tokens); "
        f"first-token logits max rel err {results['tokens']['first_token_logits_max_rel_err']:.2e}"
    )
    for p in results["tokens"]["parted"]:
        lines.append(f"  - prompt {p['prompt']} parts at step {p['step']} (TP=1 top-2 gap {p['tp1_top2_gap']:.3g})")
    for batch in (1, 64):
        a, b = one[f"decode_b{batch}_ms"], two[f"decode_b{batch}_ms"]
        lines.append(f"- decode step, batch {batch}: TP=1 {a:.2f} ms, TP=2 {b:.2f} ms (ratio {b / a:.2f})")
        ar = two[f"allreduce_b{batch}"]
        in_step = "n/a" if ar["in_step_nccl_ms"] is None else f"{ar['in_step_nccl_ms']:.3f} ms"
        lines.append(
            f"  - all-reduce at TP=2: {in_step} of NCCL kernels per step on rank 0; alone "
            f"{ar['alone_ms_each'] * 1000:.1f} us each, {ar['alone_ms_per_step']:.3f} ms for 2 per layer"
        )
    ratio = two["decode_b1_ms"] / one["decode_b1_ms"]
    verdict = "met" if ratio <= TARGET_BATCH1_RATIO else "not met"
    lines.append(f"- target batch-1 step at TP=2 <= {TARGET_BATCH1_RATIO}x TP=1: {verdict} ({ratio:.2f}x)")
    for key in ("tp1", "tp2"):
        t = results[key]["throughput"]
        lines.append(
            f"- offline throughput {key}: {t['output_tokens_per_s']:.0f} output tok/s "
            f"({t['total_tokens_per_s']:.0f} total), {t['seconds']:.1f} s"
        )
    peak = max(s["bus_gb_s"] for s in two["bandwidth_sweep"])
    sweep = ", ".join(f"{s['mib']} MiB {s['bus_gb_s']:.0f} GB/s" for s in two["bandwidth_sweep"])
    lines.append(f"- NCCL all-reduce bus bandwidth between the two GPUs: peak {peak:.0f} GB/s ({sweep})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--checkpoint", default=None, help="reuse (or write to) this folder")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="tiny: a CPU check of the script")
    parser.add_argument("--sweep-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-gib", type=int, default=16)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama3_8b_shape_") as tmp:
        path = Path(args.checkpoint or tmp)
        if not (path / "config.json").is_file():
            start = time.perf_counter()
            path.mkdir(parents=True, exist_ok=True)
            write_random_llama(path, args.shape, device=device)
            print(f"wrote the checkpoint in {time.perf_counter() - start:.0f} s", flush=True)
        results = dict(shape=args.shape, greedy_tokens=args.greedy_tokens)
        results["tp1"], out1 = run(1, str(path), args, device)
        print(json.dumps(results["tp1"]), flush=True)
        results["tp2"], out2 = run(2, str(path), args, device)
        print(json.dumps(results["tp2"]), flush=True)
    results["tokens"] = compare(out1, out2)
    (out / "tp.json").write_text(json.dumps(results, indent=2))
    text = notes(results)
    (out / "tp_notes.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
