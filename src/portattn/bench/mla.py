"""MLA decode benchmark: ``python -m portattn.bench.mla [--sweep] [--out FILE]`` (needs a GPU).

DeepSeek-V3 shapes (bf16, kv_lora_rank 512, rope 64) over uniform decode batches: B sequences of
L keys each, pages placed at random in one pool. Every case reports the median time of the
per-layer call (planning done once, outside the timing), then

* ms: per call, the device's time, from CUDA-graph replays of 20 calls (``timing.measure_graph``: as an engine's
  captured decode step runs them); ``queued_ms``: with ``QUEUED_CALLS`` calls launched back to back from the host
  (eager layers), where the host's launch cost shows once it exceeds the device's time (the fp8 forms' Gluon
  launches: 0.15 ms of host time a call on the GPU machine's host against 0.09 of device time at 64 heads,
  benchmarks/results/round58/NOTES.md); ``single_call_ms``: one call on an idle device, host launch latency
  included;
* TB/s: the fewest bytes the call must move (latent rows once, queries, page table, output) over
  the time, and its ratio to the device-to-device copy bandwidth measured in the same run;
* TFLOP/s: ``2·B·H·L·(R + Dr)`` (scores) + ``2·B·H·L·R`` (values), and its ratio to a bf16
  8192³ matrix product measured in the same run;
* the torch reference backend's time on the small cases;
* with ``--fp8``, the default tiles over e4m3 and e5m2 caches of the same rows (quantized with one scale), timed
  the same way: their time, their ratio to the bf16 cache's, TB/s counted in fp8 bytes with its share of the copy
  bandwidth, and their output's largest difference from the bf16 cache's (relative to its largest value).

Each call runs as the Triton backend runs it: at the plan's split count, cut to about one program an SM where the
plan chose it (``fewer_splits``).

``--sweep`` also times other tile shapes and split counts per case (page size 64) and reports
the best. Timing and ceilings are the package's (``timing.measure``, ``ceilings``); cases whose
latent rows are few rotate through several page tables over one pool, past the L2 cache.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

import torch

from ..backends.torch_ref import TorchBackend
from ..device import default_device, is_gpu
from ..mla import plan_mla_decode
from .ceilings import measure_ceilings
from .timing import measure, measure_graph, num_input_sets

RANK, ROPE = 512, 64
FP8_CACHES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}  # --fp8
PAGE_SIZES = (64, 1)
BATCHES = (64, 128)
HEADS = (16, 128)
LENGTHS = (4096, 32768)
TORCH_MAX_TOKENS = 64 * 4096  # the reference backend runs on the small cases only
SWEEP_PAGE_SIZES = (64,)
# Calls queued back to back per timed run: a layer's call as the device sees it inside a forward,
# without the host's launch latency that a lone call on an idle device shows (reported apart).
QUEUED_CALLS = 10  # tiles behave alike at every page size; sweeping one keeps compiles few


def case_cost(batch: int, heads: int, length: int, page_size: int, cache_bytes: int = 2) -> tuple[int, int]:
    """(fewest bytes, flops) of one decode call (``cache_bytes``: a latent value's)."""
    latent = batch * length * (RANK + ROPE) * cache_bytes
    queries = batch * heads * (RANK + ROPE) * 2
    out = batch * heads * RANK * 2
    table = batch * math.ceil(length / page_size) * 4
    flops = 2 * batch * heads * length * (RANK + ROPE) + 2 * batch * heads * length * RANK
    return latent + queries + out + table, flops


def sweep_variants(heads: int, splits: int) -> list[tuple[object, int]]:
    from ..kernels.triton.mla_decode_launch import MLATileConfig as T

    if heads <= 16:
        tiles = [T(16, 64, 8, 2), T(16, 32, 4, 4), T(16, 64, 4, 2), T(16, 16, 4, 4)]
    else:
        tiles = [T(64, 16, 8, 2), T(64, 32, 8, 3), T(64, 64, 8, 2), T(32, 32, 4, 2)]
    variants = [(t, splits) for t in tiles]
    variants += [(None, s) for s in sorted({max(1, splits // 2), splits * 2, 1} - {splits})]
    return variants


def run_case(pool, batch, heads, length, page_size, *, sweep, torch_check, gen, device, fp8_pools=None) -> dict:
    """One case's timings (``fp8_pools``: ``{name: (rows, kv_scale)}`` of fp8 caches of ``pool``'s rows, timed with
    the default tiles beside the bf16 cache)."""
    from ..kernels.triton.mla_decode_launch import choose_tiles, mla_decode_forward

    pages_per_seq = -(-length // page_size)  # the last page partly filled where L is no multiple of P
    cache = pool.view(-1, page_size, RANK + ROPE)  # [N, P, R + Dr]
    nbytes, flops = case_cost(batch, heads, length, page_size)
    tables = [  # random physical placement, a different one per input set
        torch.randperm(cache.shape[0], device=device, generator=gen)[: batch * pages_per_seq]
        .view(batch, pages_per_seq)
        .to(torch.int32)
        for _ in range(num_input_sets(nbytes, at_least=1))
    ]
    page_table = tables[0]
    seq_lens_k = torch.full((batch,), length, dtype=torch.int32, device=device)
    q_nope = torch.randn(batch, heads, RANK, dtype=torch.bfloat16, device=device)
    q_rope = torch.randn(batch, heads, ROPE, dtype=torch.bfloat16, device=device)
    scale = 1.0 / math.sqrt(128 + ROPE)
    plans = {}

    def plan_for(splits: int | None):
        if splits not in plans:
            plans[splits] = plan_mla_decode(
                page_table, seq_lens_k, page_size, num_heads=heads, kv_lora_rank=RANK, max_seqlen_k=length,
                num_kv_splits=splits,
            )  # fmt: skip
        return plans[splits]

    default_plan = plan_for(None)
    default_tiles = choose_tiles(heads, torch.bfloat16, interpret=False)

    def time_variant(tiles, splits, kv=cache, kv_scale=1.0) -> tuple[dict, torch.Tensor | None]:
        """``splits`` None: the plan's own choice, as an engine's plan makes it (``splits_chosen``: a kernel that runs
        faster at fewer splits may take fewer; each split at least ``min_split_keys``)."""
        out = torch.full_like(q_nope, float("nan"))
        plan = plan_for(splits)
        row = {"tiles": vars(tiles or default_tiles), "num_kv_splits": plan.num_kv_splits}
        fn = lambda table: mla_decode_forward(
            q_nope, q_rope, kv, table, seq_lens_k, out, scale=scale, num_kv_splits=plan.num_kv_splits,
            partials=plan.partials, tiles=tiles, kv_scale=kv_scale, min_split_keys=plan.min_split_keys,
            fewer_splits=plan.splits_chosen,
        )  # fmt: skip
        try:
            single_ms = measure(fn, tables, device, burst=0).median_ms
            queued_ms = measure(fn, tables, device, runs=20, burst=QUEUED_CALLS).median_ms
            ms = measure_graph(fn, tables, device).median_ms
            fn(page_table)  # the output of the first table, for the error columns
        except Exception as exc:  # a tile shape that does not build on this device is reported, not fatal
            return row | {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}, None
        return row | {
            "ms": ms,
            "single_call_ms": single_ms,
            "queued_ms": queued_ms,
            "tb_s": nbytes / ms / 1e9,
            "tflop_s": flops / ms / 1e9,
        }, out

    result = {"batch": batch, "heads": heads, "length": length, "page_size": page_size, "bytes": nbytes, "flops": flops}
    result["default"], out = time_variant(None, None)
    for name, (rows, kv_scale) in (fp8_pools or {}).items():
        kv = rows.view(-1, page_size, RANK + ROPE)
        row, got = time_variant(None, None, kv, kv_scale)
        row["tiles"] = vars(choose_tiles(heads, torch.bfloat16, interpret=False, kv_dtype=kv.dtype, batch=batch))
        if "ms" in row:
            row["tb_s"] = case_cost(batch, heads, length, page_size, cache_bytes=1)[0] / row["ms"] / 1e9
            if "ms" in result["default"]:
                row["speedup_vs_bf16"] = result["default"]["ms"] / row["ms"]
            if out is not None and got is not None:
                row["max_rel_diff_vs_bf16"] = _rel(got, out)
        result[name] = row
    if torch_check and batch * length <= TORCH_MAX_TOKENS:
        backend = TorchBackend()
        torch_out = torch.empty_like(q_nope)
        torch_fn = lambda table: backend.mla_decode(
            q_nope, q_rope, cache, replace(default_plan, page_table=table), scale, torch_out
        )  # fmt: skip
        result["torch_ms"] = measure(torch_fn, tables, device, runs=10).median_ms
        if out is not None:
            # The reference backend computes in float32 from the bf16 inputs; keep its float32 output.
            reference = torch.empty(q_nope.shape, dtype=torch.float32, device=device)
            backend.mla_decode(q_nope, q_rope, cache, default_plan, scale, reference)
            result["default"]["max_rel_err_vs_fp32"] = _rel(out, reference)
    if sweep and out is not None and page_size in SWEEP_PAGE_SIZES:
        rows = []
        for tiles, splits in sweep_variants(heads, default_plan.num_kv_splits):
            row, got = time_variant(tiles, splits)
            if got is not None:
                row["max_rel_diff_vs_default"] = _rel(got, out)
            rows.append(row)
        result["sweep"] = rows
        result["best"] = min((r for r in [result["default"], *rows] if "ms" in r), key=lambda r: r["ms"])
    return result


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (NaN anywhere gives NaN)."""
    diff = (out.float() - ref.float()).abs().max()
    return float(diff / ref.float().abs().max())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--sweep", action="store_true", help="also time other tiles and split counts")
    parser.add_argument("--label", default="", help="a free-form device description stored in the JSON")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch reference backend")
    parser.add_argument("--fp8", action="store_true", help="also time e4m3 and e5m2 caches of the same rows")
    parser.add_argument("--page-sizes", type=_ints, default=PAGE_SIZES, help="comma-separated (default %(default)s)")
    parser.add_argument("--batches", type=_ints, default=BATCHES, help="comma-separated (default %(default)s)")
    parser.add_argument("--heads", type=_ints, default=HEADS, help="comma-separated (default %(default)s)")
    parser.add_argument("--lengths", type=_ints, default=LENGTHS, help="comma-separated (default %(default)s)")
    args = parser.parse_args(argv)
    device = default_device()
    if not is_gpu(device):
        print("portattn.bench.mla needs a GPU (Triton kernels are timed)", file=sys.stderr)
        return 2
    gen = torch.Generator(device=device).manual_seed(0)
    ceilings = measure_ceilings(device)
    copy_gb_s, mm_tflops = ceilings.copy_tb_s * 1e3, ceilings.matmul_tflop_s
    print(f"ceilings: copy {copy_gb_s:.0f} GB/s (read + write), bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    rows = pool_rows(args.batches, args.lengths, args.page_sizes)
    pool = torch.randn(rows, RANK + ROPE, dtype=torch.bfloat16, device=device)  # latent rows
    fp8_pools = {}
    if args.fp8:
        from ..kv_quant import quantize_kv

        kv_scale = float(pool.abs().max()) / 240.0  # the largest row value to 240: within e4m3's and e5m2's ranges
        for name, dtype in FP8_CACHES.items():
            fp8_pools[name] = (quantize_kv(pool, dtype, kv_scale), kv_scale)
    results = []
    for page_size in args.page_sizes:
        for batch in args.batches:
            for heads in args.heads:
                for length in args.lengths:
                    res = run_case(
                        pool, batch, heads, length, page_size, sweep=args.sweep, torch_check=not args.no_torch,
                        gen=gen, device=device, fp8_pools=fp8_pools,
                    )  # fmt: skip
                    results.append(res)
                    print(_row(res, copy_gb_s, mm_tflops), flush=True)
                    if args.out:  # after every case, so that a run cut short keeps what it measured
                        _write(args.out, args.label, ceilings, results)
    print()
    print(_table(results, copy_gb_s, mm_tflops))
    return 0


def pool_rows(batches: tuple[int, ...], lengths: tuple[int, ...], page_sizes: tuple[int, ...]) -> int:
    """Latent rows of the pool every case draws its pages from: the largest batch's sequences in whole pages of any
    page size, a multiple of every page size (the pool is viewed as pages of each)."""
    whole = math.lcm(*page_sizes)
    longest = max(-(-length // page) * page for length in lengths for page in page_sizes)
    return -(-max(batches) * longest // whole) * whole


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _write(path: str, label: str, ceilings, results: list[dict]) -> None:
    import triton

    report = {
        "label": label,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": "bfloat16",
        "timing": "graph",  # ms: graph replays (as python -m portattn.bench --graph); queued_ms: host bursts
        "kv_lora_rank": RANK,
        "rope_dim": ROPE,
        "ceilings": {"copy_gb_s": ceilings.copy_tb_s * 1e3, "matmul_bf16_tflop_s": ceilings.matmul_tflop_s},
        "cases": results,
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _row(res: dict, copy_gb_s: float, mm_tflops: float) -> str:
    d = res["default"]
    head = f"P={res['page_size']:<3} B={res['batch']:<4} H={res['heads']:<4} L={res['length']:<6}"
    if "ms" not in d:
        return f"{head} error: {d['error']}"
    text = (
        f"{head} S={d['num_kv_splits']:<3} {d['ms']:8.3f} ms (queued {d['queued_ms']:.3f}) {d['tb_s']:6.2f} TB/s "
        f"({100 * d['tb_s'] * 1e3 / copy_gb_s:4.0f}% copy) {d['tflop_s']:6.1f} TFLOP/s "
        f"({100 * d['tflop_s'] / mm_tflops:4.0f}% mm)"
    )
    if "torch_ms" in res:
        text += f"  torch {res['torch_ms']:.2f} ms (x{res['torch_ms'] / d['ms']:.1f})"
    if "best" in res:
        b = res["best"]
        text += f"  best {b['ms']:.3f} ms tiles={tuple(b['tiles'].values())} S={b['num_kv_splits']}"
    for name in FP8_CACHES:
        f = res.get(name)
        if f is not None:
            text += f"  {name} " + (
                f"{f['ms']:.3f} ms (x{f.get('speedup_vs_bf16', float('nan')):.2f}, "
                f"{100 * f['tb_s'] * 1e3 / copy_gb_s:.0f}% copy; queued {f['queued_ms']:.3f})"
                if "ms" in f
                else f"error: {f['error']}"
            )
    return text


def _table(results: list[dict], copy_gb_s: float, mm_tflops: float) -> str:
    columns = ["P", "B", "H", "L", "splits", "ms", "queued ms", "1 call ms", "TB/s", "% copy", "TFLOP/s", "% matmul",
               "torch ms"]  # fmt: skip
    columns.append("best ms (tiles, S)")
    fp8 = [name for name in FP8_CACHES if any(name in res for res in results)]
    columns += [f"{name} {what}" for name in fp8 for what in ("ms", "queued ms", "x bf16", "% copy")]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for res in results:
        d = res["default"]
        if "ms" not in d:
            lines.append(f"| {res['page_size']} | {res['batch']} | {res['heads']} | {res['length']} | error |")
            continue
        best = res.get("best")
        best_text = f"{best['ms']:.3f} ({tuple(best['tiles'].values())}, {best['num_kv_splits']})" if best else ""
        torch_text = f"{res['torch_ms']:.2f}" if "torch_ms" in res else ""
        lines.append(
            f"| {res['page_size']} | {res['batch']} | {res['heads']} | {res['length']} | {d['num_kv_splits']} "
            f"| {d['ms']:.3f} | {d['queued_ms']:.3f} | {d['single_call_ms']:.3f} | {d['tb_s']:.2f} "
            f"| {100 * d['tb_s'] * 1e3 / copy_gb_s:.0f} "
            f"| {d['tflop_s']:.0f} "
            f"| {100 * d['tflop_s'] / mm_tflops:.0f} | {torch_text} | {best_text} |"
            + "".join(_fp8_cells(res.get(name, {}), copy_gb_s) for name in fp8)
        )
    return "\n".join(lines)


def _fp8_cells(row: dict, copy_gb_s: float) -> str:
    if "ms" not in row:
        return " error | | | |"
    speedup = row.get("speedup_vs_bf16", float("nan"))
    return f" {row['ms']:.3f} | {row['queued_ms']:.3f} | {speedup:.2f} | {100 * row['tb_s'] * 1e3 / copy_gb_s:.0f} |"


if __name__ == "__main__":
    sys.exit(main())
