"""The paged attention kernel with each key tile's page ids loaded one tile ahead
(``TileConfig.pages_ahead``) against the float64 reference and against the same launch without it
(identical outputs: only where the page ids are loaded changes): page sizes 1, 3, 7, 16 with lengths
P - 1, P, P + 1 and longer, decodes and query runs, split and not, unused slots poisoned with NaN,
a float16 and an fp8 cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import BACKENDS, DEVICE
from portattn.testing import make_paged_case, max_error, paged_attention_ref

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")

if "triton" in BACKENDS:
    from portattn.kernels.triton.launch import TileConfig, attention_forward


def run(case, tiles: TileConfig, splits: int, k_cache=None, v_cache=None, k_scale=1.0) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))
    max_seqlen_q = int((case.cu_seqlens_q[1:] - case.cu_seqlens_q[:-1]).max())
    attention_forward(
        case.q, case.k_cache if k_cache is None else k_cache, case.v_cache if v_cache is None else v_cache, out,
        case.cu_seqlens_q, case.seq_lens_k, max_seqlen_q=max_seqlen_q, scale=0.125,
        page_table=case.page_table, num_kv_splits=splits, tiles=tiles, k_scale=k_scale, v_scale=k_scale,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("page_size", [1, 3, 7, 16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "query_run"])
def test_pages_ahead_equal_the_plain_launch_and_the_reference(page_size, splits, decode):
    k_lens = [page_size - 1 or 1, page_size, page_size + 1, 3 * page_size + 5, 1, 40]
    q_lens = [1] * len(k_lens) if decode else [min(3, L) for L in k_lens]
    case = make_paged_case(q_lens, k_lens, page_size=page_size, dtype=torch.float16, device=DEVICE, seed=page_size)
    group_pad = 2  # 4 query heads over 2 KV heads
    plain = TileConfig(block_q=8, block_m=8 * group_pad, block_n=16, num_warps=4, num_stages=2)
    ahead = dataclasses.replace(plain, pages_ahead=True)
    want = run(case, plain, splits)
    got = run(case, ahead, splits)
    assert not got.isnan().any()
    assert torch.equal(got, want)
    assert max_error(got, paged_attention_ref(**case.inputs(), scale=0.125)) < 2e-3


def test_pages_ahead_over_an_fp8_cache():
    from portattn.kv_quant import quantize_kv

    case = make_paged_case([1, 1, 1], [15, 16, 40], page_size=16, dtype=torch.float16, device=DEVICE, seed=5)
    scale = 0.5
    k8, v8 = (quantize_kv(c, torch.float8_e4m3fn, scale) for c in (case.k_cache, case.v_cache))
    plain = TileConfig(block_q=8, block_m=16, block_n=16, num_warps=4, num_stages=2)
    want = run(case, plain, 2, k8, v8, scale)
    got = run(case, dataclasses.replace(plain, pages_ahead=True), 2, k8, v8, scale)
    assert not got.isnan().any() and torch.equal(got, want)
    dequantized = dataclasses.replace(case, k_cache=k8.to(torch.float16) * scale, v_cache=v8.to(torch.float16) * scale)
    assert max_error(got, paged_attention_ref(**dequantized.inputs(), scale=0.125)) < 2e-3
