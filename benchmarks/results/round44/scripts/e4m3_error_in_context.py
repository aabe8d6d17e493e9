"""The 128-head MLA decode's error with both products in e4m3, beside the error the e4m3 cache itself costs.

Round 43's ``e4m3_error_sources.py`` measured each form against float64 over the cache *as stored*, which leaves
the cache's own rounding out. What a user of an fp8 cache sees is the output against the 16-bit cache's: here
every form is measured against float64 over the unquantized rows (bfloat16, as a bf16 cache holds them), so the
rows below read as "the e4m3 cache with the default float16 products" against "the e4m3 cache with e4m3
products". Same data and tiles as round 43 (random N(0, 1) latent rows stored in e4m3 with scale 0.0625, bfloat16
queries, 64-key tiles with a running maximum), softmax scales 0.07 and 0.21.

    PYTHONPATH=src python benchmarks/results/round44/scripts/e4m3_error_in_context.py [--keys 4096] [--seqs 4]
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from portattn.kernels.triton.launch import f16_query_scale
from portattn.kv_quant import dequantize_kv, quantize_kv

_SPEC = importlib.util.spec_from_file_location(
    "e4m3_error_sources", Path(__file__).parents[2] / "round43" / "scripts" / "e4m3_error_sources.py"
)
sources = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sources)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--seqs", type=int, default=4)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"{args.seqs} sequences x {sources.HEADS} heads over {args.keys} keys; error against float64 over the "
          "unquantized (bfloat16) rows / the output's norm")  # fmt: skip
    for scale in (0.07, 0.21):
        q_scale = f16_query_scale(scale)
        errors: dict[str, list[float]] = {}
        for _ in range(args.seqs):
            rows = torch.randn(args.keys, sources.RANK + sources.ROPE, generator=gen).to(torch.bfloat16).double()
            kv = dequantize_kv(quantize_kv(rows, torch.float8_e4m3fn, 0.0625), 0.0625, torch.float64)
            q = torch.randn(sources.HEADS, sources.RANK + sources.ROPE, generator=gen).to(torch.bfloat16).double()
            exact = sources.attend(q, rows, scale, False, False)
            forms = {
                "e4m3 cache, exact products": sources.attend(q, kv, scale, False, False),
                "e4m3 cache, f16 products (the default)": sources.attend(
                    sources.f16_rows(q, q_scale), kv, scale, False, True
                ),
                "e4m3 cache, e4m3 products": sources.attend(sources.e4m3_rows(q), kv, scale, True, False),
            }
            for name, out in forms.items():
                errors.setdefault(name, []).append(float((out - exact).norm() / exact.norm()))
        print(f"softmax scale {scale}:")
        base = sum(errors["e4m3 cache, f16 products (the default)"]) / args.seqs
        for name, values in errors.items():
            mean = sum(values) / len(values)
            print(f"  {name:40s} {mean:.2e}  ({mean / base:.2f}x the default's)")


if __name__ == "__main__":
    main()
