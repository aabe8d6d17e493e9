"""The fp8-scores form's errors on the GPU, beside the warp-specialized form's (``fp8_scores_form.patch``
applied; ``PYTHONPATH=src:tests python3 fp8_scores_errors.py``). Each case prints the max error of each form's
output against the float64 reference of the unquantized queries over the exactly dequantized cache, the fp8-scores
form's against the reference of its own e4m3 queries (and its LSE's), and the fp8 cache's own error (the unquantized
cache's reference against the dequantized one's)."""

import torch

from kernels.test_mla_wide_fp8 import fp8_queries
from ops.test_mla import make_mla_case
from portattn.kernels.triton.mla_decode_launch import WIDE_PRODUCER_TILES, MLATileConfig, mla_decode_forward
from portattn.kv_quant import dequantize_kv, quantize_kv
from portattn.testing import max_error, mla_decode_ref

FP8_SCORES = MLATileConfig(64, 64, 8, 2, wide=True, producer=True, fp8_scores=True)
for cache in (torch.float8_e4m3fn, torch.float8_e5m2):
    for heads, lens, q_std in ((64, [4096] * 4, 1.0), (128, [1000, 4096, 17], 1.0), (64, [4096] * 2, 8.0)):
        case = make_mla_case(lens, page_size=64, num_heads=heads, rank=512, rope_dim=64, device="cuda", seed=heads)
        kv_scale = 0.0625
        kv = quantize_kv(case.kv_cache, cache, kv_scale)
        exact = dequantize_kv(kv, kv_scale, torch.float64)
        qn, qr = (case.q_nope * q_std).bfloat16(), (case.q_rope * q_std).bfloat16()
        base = {**case.inputs(), "q_nope": qn, "q_rope": qr}
        scale = 576**-0.5
        plain = mla_decode_ref(**{**base, "kv_cache": exact}, scale=scale)
        q8n, q8r = fp8_queries(qn, qr)
        own, own_lse = mla_decode_ref(
            **{**base, "kv_cache": exact, "q_nope": q8n, "q_rope": q8r}, scale=scale, return_lse=True
        )
        cache_err = max_error(mla_decode_ref(**{**base, "kv_cache": case.kv_cache.double()}, scale=scale), plain)
        line = f"{cache} heads {heads} lens {lens} q std {q_std}: cache's own {cache_err:.3e}"
        for name, tiles in (("producer", WIDE_PRODUCER_TILES), ("fp8 scores", FP8_SCORES)):
            out = torch.empty_like(qn)
            ws = torch.empty(4 * len(lens) * heads * 4 * 513, dtype=torch.uint8, device="cuda")
            lse = torch.empty(len(lens), heads, device="cuda")
            mla_decode_forward(qn, qr, kv, case.page_table, case.seq_lens, out, scale=scale, num_kv_splits=4,
                               workspace=ws, tiles=tiles, kv_scale=kv_scale, lse=lse)  # fmt: skip
            line += f"; {name} {max_error(out, plain):.3e}"
            if tiles is FP8_SCORES:
                lse_err = max_error(lse, own_lse)
                line += f" (against its queries' reference {max_error(out, own):.3e}, LSE {lse_err:.3e})"
        print(line, flush=True)
