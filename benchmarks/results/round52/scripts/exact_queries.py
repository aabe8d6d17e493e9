"""Where the fp8-scores form's error comes from (``fp8_scores_form.patch`` applied; ``PYTHONPATH=src:tests
python3 exact_queries.py``): queries whose rows are e4m3 values with a largest magnitude of 448, so the kernel's
quantization is exact, over an e4m3 cache; each form's max error against the float64 reference (the test fixture's
shapes: page 16 with 32 keys a step at 100 heads, page 7 with 64 at 40). What is left beside the warp-specialized
form's error is the tensor cores' fp8 sums."""

import torch

from ops.test_mla import make_mla_case
from portattn.kernels.triton.mla_decode_launch import WIDE_PRODUCER_TILES, MLATileConfig, mla_decode_forward
from portattn.kv_quant import dequantize_kv, quantize_kv
from portattn.testing import max_error, mla_decode_ref

for page, block_n, heads in ((16, 32, 100), (7, 64, 40), (64, 64, 64)):
    lens = [1, page - 1, page, page + 1, 63, 64, 65, 300, 0]
    case = make_mla_case(lens, page_size=page, num_heads=heads, rank=512, rope_dim=64, device="cuda", seed=page)
    q = torch.cat([case.q_nope, case.q_rope], -1)
    q8 = (q * (448.0 / q.abs().amax(-1, keepdim=True))).to(torch.float8_e4m3fn).to(torch.float16)
    qn, qr = q8[..., :512].contiguous(), q8[..., 512:].contiguous()
    scale = 0.07 * float(q.abs().amax(-1).mean()) / 448.0
    kv_scale = 0.0625
    kv = quantize_kv(case.kv_cache, torch.float8_e4m3fn, kv_scale)
    exact = dequantize_kv(kv, kv_scale, torch.float64)
    inputs = {**case.inputs(), "q_nope": qn, "q_rope": qr}
    ref, ref_lse = mla_decode_ref(**{**inputs, "kv_cache": exact}, scale=scale, return_lse=True)
    line = f"page {page}, {block_n} keys, {heads} heads"
    tiles = MLATileConfig(64, block_n, 8, 2, wide=True, producer=True, fp8_scores=True)
    for name, t in (("producer", WIDE_PRODUCER_TILES), ("fp8 scores", tiles)):
        out = torch.full_like(qn, float("nan"))
        lse = torch.full((len(lens), heads), float("nan"), device="cuda")
        mla_decode_forward(qn, qr, kv, case.page_table, case.seq_lens, out, scale=scale, num_kv_splits=1, lse=lse,
                           tiles=t, kv_scale=kv_scale)  # fmt: skip
        finite = torch.isfinite(ref_lse)
        lse_err = max_error(lse[finite], ref_lse[finite]) / float(ref_lse[finite].abs().max())
        line += f"; {name}: error {max_error(out, ref):.3e}, LSE {lse_err:.2e}"
    print(line, flush=True)
