"""The fp8 linears' matmul (``torch._scaled_mm`` with row-wise scales, as ``fp8_linear`` calls it) with and
without fast accumulation, beside the bf16 matmul, at the Llama-3-8B shape's four projections and the row counts
of prefill steps, on a GPU.

Hopper's fp8 tensor cores accumulate a product in fewer than float32's bits. Without fast accumulation, CUTLASS
moves the partial sums into float32 registers every few MMAs ("two-level accumulation"). With it
(``use_fast_accum=True``), the sums stay in the tensor core's accumulator. vLLM's CUTLASS fp8 GEMM on sm_90 takes
a fast-accumulation schedule for more than 128 rows.

Each case is timed as CUDA-graph replays (median, 10-90% spread). Its error is measured over the first 256 rows,
against float64 over the same quantized operands: the rows' and weights' rounding is left out, so only the
accumulation's error remains. The error is the norm of the difference over the norm of the result. The last table
sums one layer's four projections and gives the time 32 such layers take at each row count.

    PYTHONPATH=src python3 scripts/fp8_gemm_probe.py [--rows 256 1024 2048 3072 8192] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from portattn.bench.ceilings import measure_ceilings
from portattn.bench.timing import measure_graph
from portattn.models.layers.fp8_linear import quantize_rows

# name -> (out features, in features): Llama-3-8B's q/k/v, output, gate/up and down projections
PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
CHECKED_ROWS = 256  # the error over the first rows (each row's error does not depend on the others)


def bf16_mm(operands):
    x, w = operands[:2]
    return x @ w.t()


def fp8_mm(operands, fast: bool = False):
    xq, wq, xs, w_scale = operands[2:]
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=w_scale, out_dtype=torch.bfloat16, use_fast_accum=fast)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 1024, 2048, 3072, 8192])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    ceil = measure_ceilings(dev)
    print(f"{torch.cuda.get_device_name(dev)}: bf16 matmul {ceil.matmul_tflop_s:.0f} TFLOP/s, "
          f"copy {ceil.copy_tb_s:.2f} TB/s")  # fmt: skip
    g = torch.Generator(device=dev).manual_seed(0)
    rows_out, layer = [], {}
    for name, (n, k) in PROJECTIONS.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        wq, ws = quantize_rows(w)  # [N, K] e4m3, [N, 1]
        w_scale = ws.t().contiguous()
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            xq, xs = quantize_rows(x)
            c = slice(0, CHECKED_ROWS)
            exact = (xq[c].double() * xs[c].double()) @ (wq.double() * ws.double()).t()
            flop = 2 * m * n * k
            operands = (x, w, xq, wq, xs, w_scale)
            forms = {"bf16": bf16_mm, "fp8": fp8_mm, "fp8 fast": lambda a: fp8_mm(a, fast=True)}
            row = {"projection": name, "rows": m, "n": n, "k": k}
            for form, fn in forms.items():
                t = measure_graph(fn, [operands], dev, calls=10, replays=30)
                row[form] = {"ms": t.median_ms, "spread": [t.p10_ms, t.p90_ms], "tflop_s": flop / t.median_ms / 1e9}
                if form != "bf16":
                    y = fn(operands)[c].double()
                    row[form]["error"] = float((y - exact).norm() / exact.norm())
                layer.setdefault((m, form), 0.0)
                layer[(m, form)] += t.median_ms
            rows_out.append(row)
            print(f"{name:8s} M={m:5d} N={n:5d} K={k:5d}  "
                  + "  ".join(f"{f} {row[f]['ms']:.3f} ms {row[f]['tflop_s']:.0f} TFLOP/s"
                              + (f" err {row[f]['error']:.1e}" if "error" in row[f] else "") for f in forms),
                  flush=True)  # fmt: skip
    print(f"\none layer's four projections x {LAYERS} layers (ms):")
    for m in args.rows:
        b, f, ff = (LAYERS * layer[(m, form)] for form in ("bf16", "fp8", "fp8 fast"))
        print(f"  M={m:5d}: bf16 {b:.2f}, fp8 {f:.2f} ({b / f:.2f}x bf16), fp8 fast {ff:.2f} ({f / ff:.2f}x fp8)")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(dev), "ceilings": vars(ceil), "rows": rows_out}, fh,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
