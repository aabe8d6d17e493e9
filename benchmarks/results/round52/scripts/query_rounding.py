"""Which rounding of the queries to e4m3 the fp8-scores form matches (``fp8_scores_form.patch`` applied;
``PYTHONPATH=src:tests python3 query_rounding.py``): on the GPU test's fixture, the kernel's max error against
float64 references whose queries are rounded to nearest (``fp8_queries``), toward zero, and through float16 first."""

import torch

from kernels.test_mla_wide_fp8 import FP8_SCORES_TILES
from ops.test_mla import make_mla_case
from portattn.kernels.triton.mla_decode_launch import MLATileConfig, mla_decode_forward
from portattn.kv_quant import dequantize_kv, quantize_kv
from portattn.testing import max_error, mla_decode_ref


def rounded(q: torch.Tensor, how: str) -> torch.Tensor:
    q = q.float()
    amax = q.abs().amax(-1, keepdim=True)
    x = q * (448.0 / amax)
    if how == "nearest":
        y = x.to(torch.float8_e4m3fn).double()
    elif how == "float16 first":
        y = x.half().to(torch.float8_e4m3fn).double()
    else:  # toward zero: 3 mantissa bits, subnormal steps of 2^-9
        e = torch.floor(torch.log2(x.abs().double().clamp_min(2.0**-9))).clamp_min(-6)
        ulp = torch.pow(2.0, e - 3)
        y = torch.sign(x.double()) * torch.floor(x.abs().double() / ulp) * ulp
    return y * (amax / 448.0).double()


for page, block_n, heads, dtype in ((16, 32, 100, torch.float16), (7, 64, 40, torch.bfloat16)):
    lens = [1, page - 1, page, page + 1, 63, 64, 65, 300, 0]
    case = make_mla_case(lens, page_size=page, num_heads=heads, rank=512, rope_dim=64, device="cuda",
                         seed=page + block_n)  # fmt: skip
    kv_scale, scale = 0.0625, 0.07
    kv = quantize_kv(case.kv_cache, torch.float8_e4m3fn, kv_scale)
    exact = dequantize_kv(kv, kv_scale, torch.float64)
    qn, qr = case.q_nope.to(dtype), case.q_rope.to(dtype)
    out = torch.full_like(qn, float("nan"))
    tiles = MLATileConfig(64, block_n, 8, 2, wide=True, producer=True, fp8_scores=True)
    assert tiles.fp8_scores and FP8_SCORES_TILES.fp8_scores
    mla_decode_forward(qn, qr, kv, case.page_table, case.seq_lens, out, scale=scale, num_kv_splits=1, tiles=tiles,
                       kv_scale=kv_scale)  # fmt: skip
    line = f"page {page}, {block_n} keys, {heads} heads, {dtype}"
    q = torch.cat([qn, qr], -1)
    for how in ("nearest", "toward zero", "float16 first"):
        q8 = rounded(q, how)
        ref = mla_decode_ref(**{**case.inputs(), "kv_cache": exact, "q_nope": q8[..., :512], "q_rope": q8[..., 512:]},
                             scale=scale)  # fmt: skip
        line += f"; {how} {max_error(out, ref):.3e}"
    print(line, flush=True)
