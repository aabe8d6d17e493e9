"""The fp8 linears' quantizing launches against the launches they replace, on a GPU (issue 23 target 3's mixed
steps): at the Llama-3-8B shape's rows of a 2,048-token step,

* the gated activation then the quantizer (``gated_activation`` + ``quantize_fp8_rows``) against
  ``gated_activation_fp8`` with the row in registers (one read) and in two passes;
* the residual add and RMSNorm then the quantizer against ``add_rmsnorm_fp8``;

each timed as CUDA-graph replays (median, spread), with the bytes each moves at the copy bandwidth measured in the
same run, and the outputs compared (bit for bit).

    python3 scripts/fp8_fusion_probe.py [--tokens 2048] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from portattn.bench.ceilings import measure_ceilings
from portattn.bench.timing import measure_graph
from portattn.kernels.triton import fused_launch
from portattn.models.layers.fp8_linear import FP8_DTYPE, FP8_MAX, MIN_SCALE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=14336)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    ceil = measure_ceilings(dev)
    T, H, I = args.tokens, args.hidden, args.inter
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = [torch.randn(T, 2 * I, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2)]
    xs = [torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2)]
    residual = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
    weight = torch.rand(H, device=dev, dtype=torch.bfloat16, generator=g)
    q = (FP8_DTYPE, FP8_MAX, MIN_SCALE)

    def act_then_quant(x):
        return fused_launch.quantize_fp8_rows(fused_launch.gated_activation("silu", x, True), *q)

    def act_quant(one_block):
        def fn(x):
            saved = fused_launch.GATED_FP8_ONE_BLOCK
            fused_launch.GATED_FP8_ONE_BLOCK = saved if one_block else 0
            try:
                return fused_launch.gated_activation_fp8("silu", x, True, *q)
            finally:
                fused_launch.GATED_FP8_ONE_BLOCK = saved

        return fn

    def norm_then_quant(x):
        out, _ = fused_launch.add_rmsnorm(x, weight, 1e-5, residual)
        return fused_launch.quantize_fp8_rows(out, *q)

    def norm_quant(x):
        q8, scale, _ = fused_launch.add_rmsnorm_fp8(x, weight, 1e-5, residual, mode="dtype", dtype=FP8_DTYPE,
                                                     fp8_max=FP8_MAX, min_scale=MIN_SCALE)  # fmt: skip
        return q8, scale

    # bytes each form moves once (the quantizer's second pass over a row counted as a cache hit)
    act_unfused = T * 2 * I * 2 + T * I * 2 + T * I * 2 + T * I
    act_fused = T * 2 * I * 2 + T * I
    norm_unfused = 4 * T * H * 2 + T * H * 2 + T * H
    norm_fused = 3 * T * H * 2 + T * H
    cases = [
        ("activation then quantizer", act_then_quant, gate_up, act_unfused),
        ("activation quantizing, row in registers", act_quant(True), gate_up, act_fused),
        ("activation quantizing, two passes", act_quant(False), gate_up, act_fused),
        ("add + RMSNorm then quantizer", norm_then_quant, xs, norm_unfused),
        ("add + RMSNorm quantizing", norm_quant, xs, norm_fused),
    ]
    rows = {"copy_tb_s": ceil.copy_tb_s, "tokens": T, "hidden": H, "inter": I}
    for name, fn, inputs, nbytes in cases:
        t = measure_graph(fn, inputs, dev)
        floor = nbytes / (ceil.copy_tb_s * 1e12) * 1e3
        rows[name] = {"ms": t.median_ms, "spread": t.spread, "bytes": nbytes, "floor_ms": floor}
        print(f"{name:<42} {t.median_ms:.4f} ms (spread {t.spread:.1%}), {nbytes / 1e6:.0f} MB, "
              f"{floor / t.median_ms:.0%} of copy", flush=True)  # fmt: skip
    want = act_then_quant(gate_up[0])
    for one_block in (True, False):
        got = act_quant(one_block)(gate_up[0])
        same = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
        print(f"activation quantizing (one block {one_block}) bit for bit the unfused launches: {same}")
        rows[f"equal_activation_one_block_{one_block}"] = same
    want, got = norm_then_quant(xs[0]), norm_quant(xs[0])
    same = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    print(f"add + RMSNorm quantizing bit for bit the unfused launches: {same}")
    rows["equal_norm"] = same
    saved = (rows["activation then quantizer"]["ms"] - min(rows["activation quantizing, row in registers"]["ms"],
             rows["activation quantizing, two passes"]["ms"])) + 2 * (rows["add + RMSNorm then quantizer"]["ms"]
             - rows["add + RMSNorm quantizing"]["ms"])  # fmt: skip
    print(f"saved a layer: {saved:.4f} ms; 32 layers: {32 * saved:.2f} ms a {T}-token step")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_fusion.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
