"""Triton paged attention across head dims (``python -m portattn.bench.head_dims``, GPU).

For each head dim: a decode batch (B=64 over 4096 keys, Hq 32 / Hkv 8) and a causal prefill (8192
tokens, Hq 32 / Hkv 8), in bf16, against SDPA's flash kernel on the same numbers (contiguous
K/V), which takes any multiple of 8 up to 256. Head dims that are not a power of two run as up to
three column tiles (``kernels/triton/launch.column_tiles``); the JSON records them, so a slow dim
can be told from a padded one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ..device import default_device, is_gpu
from . import report
from .ceilings import measure_ceilings
from .paged_attention import PagedCase, run_case

HEAD_DIMS = (32, 40, 48, 64, 72, 80, 96, 112, 128, 160, 192, 224, 256)


def cases(head_dims: tuple[int, ...]) -> list[PagedCase]:
    found = []
    for d in head_dims:
        found.append(PagedCase(f"decode B=64 L=4096 D={d}", 64, 1, 4096, head_dim=d, peers=("flash",)))
        found.append(PagedCase(f"prefill B=1 L=8192 D={d}", 1, 8192, 8192, head_dim=d, peers=("flash",)))
    return found


def main(argv: list[str] | None = None) -> int:
    from ..kernels.triton.launch import column_tiles

    parser = argparse.ArgumentParser(prog="python -m portattn.bench.head_dims", description=__doc__)
    parser.add_argument("--head-dim", type=int, action="append", default=None, help="head dims (default: a grid)")
    parser.add_argument("--out", default="benchmarks/results/head_dims.json", help="JSON file to write")
    args = parser.parse_args(argv)
    device = default_device()
    if not is_gpu(device):
        print(f"the benchmark needs a GPU (found {device})")
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings(device)
    results = []
    for case in cases(tuple(args.head_dim or HEAD_DIMS)):
        t0 = time.time()
        result = run_case(case, device)
        result["column_tiles"] = list(column_tiles(case.head_dim))
        results.append(result)
        rows = report.derive(results, ceilings)
        report.write_json(out, rows, ceilings, {"device": str(device)})
        print(report.format_table(rows[-1:], ceilings).splitlines()[2], f"({time.time() - t0:.0f} s)", flush=True)
        if hasattr(torch.accelerator, "empty_cache"):
            torch.accelerator.empty_cache()
    print(report.format_table(report.derive(results, ceilings), ceilings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
