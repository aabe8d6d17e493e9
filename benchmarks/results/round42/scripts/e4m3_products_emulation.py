"""The e4m3-products MLA decode (``fp8_products.patch``) emulated on the CPU, against its GPU test's reference.

The kernel's arithmetic in float32 where the kernel has it: each head's query row times a factor, rounded to e4m3;
the scores exact (fp8 products and sums, as the MMA), times the factor's inverse and the softmax scale; 64-key
tiles with a running maximum, the probabilities times 2^8 rounded to e4m3 and summed as rounded. The reference is
the test's: float64 over the cache as stored with the queries rounded in float64 by the same rule. Per sequence: the
LSE's difference against the bound the probabilities' rounding allows (2^-4 + n 2^-18 over n keys).

With ``--factor 448`` (448 / the row's largest magnitude, the first form) a one-key sequence's LSE is 0.083 off
(the H100's kernel, on the test's case: 0.084): bfloat16 ratios times 448 land on e4m3's midpoints, and float32's
product and float64's fall on either side of them. With ``--factor pow2`` (the patch now) the two roundings agree
and every LSE is within its bound.

    PYTHONPATH=src:tests python benchmarks/results/round42/scripts/e4m3_products_emulation.py --page-size 1 --heads 100
"""

from __future__ import annotations

import argparse
import math

import torch

from ops.test_mla import make_mla_case
from portattn.kv_quant import dequantize_kv, quantize_kv
from portattn.testing import mla_decode_ref

LOG2E = 1.4426950408889634


def factor_of(amax: torch.Tensor, kind: str) -> torch.Tensor:
    ratio = 448.0 / amax.clamp_min(1e-30)
    return torch.exp2(torch.floor(torch.log2(ratio))) if kind == "pow2" else ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--heads", type=int, default=100)
    parser.add_argument("--factor", choices=["448", "pow2"], default="pow2")
    args = parser.parse_args()
    page, block_n, heads = args.page_size, args.block_n, args.heads
    lens = [1, max(page - 1, 1), page, page + 1, 63, 64, 65, 300, 2000]
    case = make_mla_case(lens, page_size=page, num_heads=heads, rank=512, rope_dim=64, device="cpu",
                         seed=page + block_n)  # fmt: skip
    scale, kv_scale = 0.07, 0.0625
    kv = quantize_kv(case.kv_cache, torch.float8_e4m3fn, kv_scale)
    q = torch.cat([case.q_nope, case.q_rope], -1).to(torch.bfloat16)

    x = q.double()  # the test's rounding of the queries, in float64
    f64 = factor_of(x.abs().amax(-1, keepdim=True), args.factor)
    q_ref = (x * f64).to(torch.float8_e4m3fn).double() / f64
    exact = dequantize_kv(kv, kv_scale, torch.float64)
    _, ref_lse = mla_decode_ref(q_ref[..., :512], q_ref[..., 512:], exact, case.page_table, case.seq_lens,
                                scale=scale, return_lse=True)  # fmt: skip

    qf = q.float()  # the kernel's, in float32
    factor = factor_of(qf.abs().amax(-1), args.factor).float()
    qq = (qf * factor[..., None]).to(torch.float8_e4m3fn).double()
    stored = kv.float()
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        rows = stored[case.page_table[b, pos // page].long(), pos % page]  # [n, 576]
        scores = (qq[b] @ rows.double().T).float() * ((1.0 / factor[b]) * scale * kv_scale * LOG2E)[:, None]
        m = torch.full((heads,), -math.inf)
        total = torch.zeros(heads)
        for t in range(0, n, block_n):
            s = scores[:, t : t + block_n]
            m_new = torch.maximum(m, s.amax(1))
            p = torch.exp2(s - (m_new - 8.0)[:, None]).to(torch.float8_e4m3fn).float()
            total = total * torch.exp2(m - m_new) + p.sum(1)
            m = m_new
        lse = (m - 8.0 + torch.log2(total)) * math.log(2)
        err = float((lse.double() - ref_lse[b]).abs().max())
        bound = 2**-4 + n * 2**-18
        print(f"{n:5d} keys: LSE off by {err:.4f} (bound {bound:.4f}){'  OVER' if err > bound else ''}")


if __name__ == "__main__":
    main()
