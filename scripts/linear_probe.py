"""The small-batch linear with its norm and activation fused in (``norm_linear``) against the unfused
launches it replaces, on a GPU: the q/k/v projection after the input norm and the gate/up projection
with its activation after the post-attention norm, at the shapes of SmolLM2-135M, Qwen2.5-0.5B and
Llama-3-8B, rows 1, 4 and 16, over ``TILES``.

    PYTHONPATH=src python scripts/linear_probe.py [--out DIR] [--shapes NAME ...] [--rows N ...]

Each case is timed as CUDA-graph replays (``timing.measure_graph``), rotating through enough weight
copies that they do not stay in L2 (as a model's layers do not); the percentage is of the copy
bandwidth over the weight bytes. Writes ``DIR/linear_probe.json`` and its plot ``DIR/linear_probe.png``;
``--replot FILE.json ...`` draws the plots of committed results again (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from portattn.bench.ceilings import measure_ceilings
from portattn.bench.timing import measure_graph
from portattn.kernels.triton.fused_launch import (
    LinearTiles,
    add_rmsnorm,
    gated_activation,
    linear_tiles,
    norm_linear,
)

# hidden, q/k/v width, intermediate size
SHAPES = {"smollm2-135m": (576, 960, 1536), "qwen2.5-0.5b": (896, 1152, 4864), "llama3-8b": (4096, 6144, 14336)}
# (block_n, block_k, warps, stages); a block_k of at least the hidden size: every load at once
TILES = [(16, 1024, 4, 1), (16, 1024, 8, 1), (16, 256, 4, 3), (16, 128, 2, 4), (16, 256, 8, 3), (32, 256, 4, 3)]
DEV = torch.device("cuda")
DT = torch.bfloat16


def sets_for(weight_bytes: int) -> int:
    return max(2, min(64, math.ceil(160e6 / weight_bytes)))  # past the H200's 50 MB of L2


def plot(path: Path) -> None:
    """``path``'s timed rows as bars (``kernels_probe.plot``, in milliseconds) beside it, as a PNG."""
    from kernels_probe import plot as plot_rows

    rows = json.loads(path.read_text())
    timed = {key: {"ms": r["us"] / 1e3} for key, r in rows.items() if isinstance(r, dict) and "us" in r}
    plot_rows(timed, path.with_suffix(".png"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--replot", nargs="+", type=Path, default=None, help="plot these result JSONs again")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    if args.replot:
        for path in args.replot:
            plot(path)
        return 0
    copy_tb_s = measure_ceilings(DEV).copy_tb_s
    rows_out: dict = {"copy_tb_s": copy_tb_s}
    for shape in args.shapes:
        hidden, qkv, inter = SHAPES[shape]
        for what, width, act in (("qkv", qkv, None), ("gate_up", 2 * inter, "silu")):
            nbytes = width * hidden * 2
            n = sets_for(nbytes)
            weights = [torch.randn(width, hidden, device=DEV, dtype=DT) / hidden**0.5 for _ in range(n)]
            norm_w = torch.rand(hidden, device=DEV, dtype=DT) + 0.5
            for rows in args.rows:
                x = torch.randn(rows, hidden, device=DEV, dtype=DT)
                res = torch.randn(rows, hidden, device=DEV, dtype=DT)

                def unfused(w, x=x, res=res, act=act, norm_w=norm_w):
                    h, _ = add_rmsnorm(x, norm_w, 1e-5, res)
                    y = F.linear(h, w)
                    return gated_activation(act, y) if act else y

                def matmul_only(w, x=x):
                    return F.linear(x, w)

                cases = {"unfused": unfused, "cublas linear alone": matmul_only}
                for tiles in [None, *TILES]:
                    t = LinearTiles(*tiles) if tiles else None

                    def fused(w, x=x, res=res, act=act, t=t, norm_w=norm_w):
                        return norm_linear(x, w, norm_weight=norm_w, eps=1e-5, residual=res, act=act, tiles=t)[0]

                    auto = linear_tiles(width // (2 if act else 1), hidden, DEV, gated=act is not None, rows=rows)
                    cases[f"fused {tiles or f'auto {tuple(vars(auto).values())}'}"] = fused
                ref = unfused(weights[0]).float()
                for name, fn in cases.items():
                    key = f"{shape} {what} rows {rows} {name}"
                    try:
                        if name.startswith("fused"):
                            err = float((fn(weights[0]).float() - ref).abs().max() / ref.abs().max())
                            assert err < 2e-2, f"relative error {err}"
                        timing = measure_graph(fn, weights, DEV, calls=n, replays=30)
                        us = timing.median_ms * 1e3
                        of_copy = nbytes / (us * 1e-6) / (copy_tb_s * 1e12)
                        rows_out[key] = {"us": us, "spread": timing.spread, "of_copy": of_copy}
                        print(f"{key:70s} {us:8.2f} us  {rows_out[key]['of_copy']:6.1%} of copy", flush=True)
                    except Exception as exc:  # a tile that does not fit, or a wrong result
                        rows_out[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                        print(f"{key:70s} {rows_out[key]['error']}", flush=True)
            del weights
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "linear_probe.json").write_text(json.dumps(rows_out, indent=2))
    plot(args.out / "linear_probe.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
