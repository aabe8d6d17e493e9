"""Where the 128-head MLA decode's error with both products in e4m3 comes from, emulated on the CPU in float64.

Random latent rows (N(0, 1), stored in e4m3 with scale 0.0625 as the probe stores them) and bfloat16 queries; the
output of each form against float64 over the cache as stored (its own quantization excluded, as the probe's
``--error``), as a fraction of the output's norm, with the softmax scale of the probe (0.07) and three times it
(sharper attention):

* ``f16 products`` (the default over an fp8 cache): the queries times ``q_scale`` rounded to float16, the
  probabilities rounded to float16;
* ``e4m3 queries``: each head's query row times a power of two (its largest magnitude in (224, 448]) rounded to
  e4m3, the probabilities exact;
* ``e4m3 probabilities``: the queries exact, the probabilities (64-key tiles, a running maximum, times 2^8) rounded
  to e4m3, the softmax's sum taken over them as rounded;
* ``both``: the e4m3-products kernel's arithmetic (round 42's patch).

    PYTHONPATH=src python benchmarks/results/round43/scripts/e4m3_error_sources.py [--keys 4096] [--seqs 4]
"""

from __future__ import annotations

import argparse

import torch

from portattn.kernels.triton.launch import f16_query_scale
from portattn.kv_quant import dequantize_kv, quantize_kv

RANK, ROPE, HEADS, BLOCK_N = 512, 64, 128, 64


def e4m3_rows(q: torch.Tensor) -> torch.Tensor:
    factor = torch.exp2(torch.floor(torch.log2(448.0 / q.abs().amax(-1, keepdim=True).clamp_min(1e-30))))
    return (q * factor).to(torch.float8_e4m3fn).double() / factor


def f16_rows(q: torch.Tensor, q_scale: float) -> torch.Tensor:
    return (q * q_scale).to(torch.float16).double() / q_scale


def attend(q: torch.Tensor, kv: torch.Tensor, scale: float, p_e4m3: bool, p_f16: bool) -> torch.Tensor:
    """One sequence's output ``[heads, RANK]``: 64-key tiles with a running maximum (base 2, as the kernels)."""
    s = (q @ kv.T) * scale * 1.4426950408889634  # [heads, keys], base 2
    m = torch.full((q.shape[0],), -torch.inf, dtype=torch.float64)
    total = torch.zeros(q.shape[0], dtype=torch.float64)
    acc = torch.zeros(q.shape[0], RANK, dtype=torch.float64)
    for t in range(0, kv.shape[0], BLOCK_N):
        tile = s[:, t : t + BLOCK_N]
        m_new = torch.maximum(m, tile.amax(1))
        alpha = torch.exp2(m - m_new)
        p = torch.exp2(tile - m_new[:, None])
        if p_e4m3:
            p = (p * 256.0).to(torch.float8_e4m3fn).double() / 256.0
        elif p_f16:
            p = p.to(torch.float16).double()
        total = total * alpha + p.sum(1)
        acc = acc * alpha[:, None] + p @ kv[t : t + BLOCK_N, :RANK]
        m = m_new
    return acc / total[:, None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--seqs", type=int, default=4)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"{args.seqs} sequences x {HEADS} heads over {args.keys} keys; error / the output's norm")
    for scale in (0.07, 0.21):
        q_scale = f16_query_scale(scale)
        errors: dict[str, list[float]] = {}
        for _ in range(args.seqs):
            rows = torch.randn(args.keys, RANK + ROPE, generator=gen)
            kv = dequantize_kv(quantize_kv(rows, torch.float8_e4m3fn, 0.0625), 0.0625, torch.float64)
            q = torch.randn(HEADS, RANK + ROPE, generator=gen).to(torch.bfloat16).double()
            exact = attend(q, kv, scale, False, False)
            forms = {
                "f16 products": attend(f16_rows(q, q_scale), kv, scale, False, True),
                "e4m3 queries": attend(e4m3_rows(q), kv, scale, False, False),
                "e4m3 probabilities": attend(q, kv, scale, True, False),
                "both": attend(e4m3_rows(q), kv, scale, True, False),
            }
            for name, out in forms.items():
                errors.setdefault(name, []).append(float((out - exact).norm() / exact.norm()))
        print(f"softmax scale {scale}: " + ", ".join(f"{k} {sum(v) / len(v):.2e}" for k, v in errors.items()))


if __name__ == "__main__":
    main()
