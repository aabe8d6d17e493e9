"""Engine benchmark on the CPU: ``python -m benchmarks.engine_cpu [--threads N] [--out FILE.json]``.

Tokens/s of the engine against ``transformers``' batched ``generate`` on the same tiny random
checkpoint (one per text family, :func:`portattn.testing.save_tiny_checkpoint`) and the same prompts: a batch
of 16 prompts of 128 tokens, 128 new greedy tokens each (end-of-sequence ignored), float32. Runs of
the two are interleaved and the median is reported. The engine's attention share is the time spent
in the backend's attention ops (paged, varlen, MLA decode; the CPU runs synchronously, so wall-clock
time is exact).
Greedy tokens of the two are compared as well.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from portattn.testing import TEXT_FAMILIES, engine_families, save_tiny_checkpoint, tiny_config


def _prompts(batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


def _transformers_run(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return time.perf_counter() - start, out[:, ids.shape[1] :].tolist()


def _engine_run(llm, ids: torch.Tensor, new_tokens: int) -> tuple[float, list[list[int]], float]:
    from portattn.engine.sampling_params import SamplingParams

    backend = llm.engine.backend
    spent = [0.0]
    ops = [name for name in ("paged_attention", "varlen_attention", "mla_decode") if hasattr(backend, name)]

    def timed(op):
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = op(*args, **kwargs)
            spent[0] += time.perf_counter() - start
            return out

        return run

    for name in ops:  # instance attributes: this run only
        setattr(backend, name, timed(getattr(backend, name)))
    try:
        start = time.perf_counter()
        outs = llm.generate(
            ids.tolist(), SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False
        )
        seconds = time.perf_counter() - start
    finally:
        for name in ops:
            delattr(backend, name)
    return seconds, [o.token_ids for o in outs], spent[0]


def bench_family(family: str, root: Path, args) -> dict:
    from transformers import AutoModelForCausalLM

    from portattn.engine.llm import LLM

    path = save_tiny_checkpoint(family, root / family)
    config = tiny_config(family)
    ids = _prompts(args.batch, args.prompt_len, config.vocab_size)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    pages = args.batch * -(-(args.prompt_len + args.new_tokens) // args.page_size)
    max_len = args.prompt_len + args.new_tokens
    llm = LLM(
        path, device="cpu", page_size=args.page_size, num_pages=pages, max_num_seqs=args.batch, max_model_len=max_len
    )
    _transformers_run(model, ids[:, :16], 4)  # warm-up
    _engine_run(llm, ids[:, :16], 4)
    hf_times, engine_times, attention = [], [], []
    for _ in range(args.runs):
        seconds, hf_tokens = _transformers_run(model, ids, args.new_tokens)
        hf_times.append(seconds)
        seconds, engine_tokens, attn = _engine_run(llm, ids, args.new_tokens)
        engine_times.append(seconds)
        attention.append(attn / seconds)
    tokens = args.batch * args.new_tokens
    hf_s, engine_s = statistics.median(hf_times), statistics.median(engine_times)
    return {
        "family": family,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "vocab": config.vocab_size,
        "backend": llm.engine.backend.name,
        "page_size": args.page_size,
        "engine_s": engine_s,
        "transformers_s": hf_s,
        "engine_tokens_per_s": tokens / engine_s,
        "transformers_tokens_per_s": tokens / hf_s,
        "ratio": hf_s / engine_s,
        "engine_attention_share": statistics.median(attention),
        "greedy_equal": engine_tokens == hf_tokens,
    }


def format_table(rows: list[dict]) -> str:
    lines = [
        "| family | layers x hidden, vocab | backend | engine tokens/s | transformers tokens/s | engine / transformers "
        "| engine attention share | greedy tokens equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['layers']} x {r['hidden']}, {r['vocab']} | {r['backend']} "
            f"| {r['engine_tokens_per_s']:.0f} | {r['transformers_tokens_per_s']:.0f} | {r['ratio']:.2f}x "
            f"| {r['engine_attention_share']:.0%} | {'yes' if r['greedy_equal'] else 'NO'} |"
        )
    return "\n".join(lines)


def _notes(rows: list[dict]) -> str:
    outside = [r["transformers_s"] / (r["engine_s"] * (1 - r["engine_attention_share"])) for r in rows]
    return (
        "What limits it: at this size (hidden 64) every op costs microseconds, so per-op overhead, not "
        "arithmetic, decides the ratio. Attention through the backend `auto` picks on the CPU (the PyTorch "
        "reference: per decode step one padded page gather and one matmul per KV head, per prefill chunk "
        "one gather and matmul per sequence) is "
        f"{min(r['engine_attention_share'] for r in rows):.0%}-{max(r['engine_attention_share'] for r in rows):.0%}"
        " of the engine's time; transformers' dense cache needs no gather and runs one SDPA call per layer. "
        "Everything else (batch building, page tables, projections/norms/MLPs, sampling) takes "
        f"{min(outside):.1f}-{max(outside):.1f}x less time than transformers' whole `generate`."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    families = [family for family in engine_families() if family in TEXT_FAMILIES]
    parser.add_argument("--families", nargs="+", default=families, choices=families)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None, help="write FILE.json and FILE.md")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for family in args.families:
            rows.append(bench_family(family, Path(root), args))
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    meta = {
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "threads": torch.get_num_threads(),
        "load_average": round(os.getloadavg()[0], 1),
        "torch": torch.__version__,
        "runs": args.runs,
    }
    table = format_table(rows)
    print("\n" + table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        header = (
            f"Engine vs transformers `generate`, CPU, float32, batch {args.batch}, {args.prompt_len}-token prompts, "
            f"{args.new_tokens} new greedy tokens, page size {args.page_size}, {meta['threads']} thread(s), "
            f"load average {meta['load_average']}, torch {torch.__version__}. Median of {args.runs} interleaved runs."
        )
        flags = " ".join(sys.argv[1:] if argv is None else argv)
        command = f"PYTHONPATH=src python -m benchmarks.engine_cpu {flags}".strip()
        args.out.with_suffix(".md").write_text(f"{header}\n\n{table}\n\nCommand: `{command}`\n\n{_notes(rows)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
