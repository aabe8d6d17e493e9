"""The paged attention kernel with key tiles of whole pages (``TileConfig.whole_pages``: one page id a
page, K/V addressed as ``[pages, page rows, columns]``) against the same launch without it (identical
outputs: only the addressing changes) and against the float64 reference: pages of 4, 8 and 16 keys in
tiles of one to four pages with lengths P - 1, P, P + 1 and longer, decodes and query runs, windows
and chunks (tiles masked before and after the visible ones), split and not, page ids a tile ahead or
not, unused slots poisoned with NaN, a float16 and an fp8 cache; pages of 3 and 7 keys, and a head dim
of two column tiles, where the launch addresses rows as before."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import BACKENDS, DEVICE
from portattn.testing import make_paged_case, max_error, paged_attention_ref

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")

if "triton" in BACKENDS:
    from portattn.kernels.triton.launch import TileConfig, attention_forward


def run(case, tiles, splits, k_cache=None, v_cache=None, scale=1.0, **kwargs) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))
    max_seqlen_q = int((case.cu_seqlens_q[1:] - case.cu_seqlens_q[:-1]).max())
    attention_forward(
        case.q, case.k_cache if k_cache is None else k_cache, case.v_cache if v_cache is None else v_cache, out,
        case.cu_seqlens_q, case.seq_lens_k, max_seqlen_q=max_seqlen_q, scale=0.125, page_table=case.page_table,
        num_kv_splits=splits, tiles=tiles, k_scale=scale, v_scale=scale, **kwargs,
    )  # fmt: skip
    return out


@pytest.mark.parametrize(
    "page_size, block_n, splits, ahead, decode, kwargs",
    [
        (16, 16, 1, True, True, {}),
        (4, 16, 3, False, True, {}),
        (8, 32, 2, True, False, {}),
        (16, 32, 1, False, False, {"window_left": 20}),
        (4, 16, 2, True, False, {"chunk_size": 24}),
        (8, 16, 1, False, True, {"window_left": 9}),
        (3, 16, 1, True, False, {}),  # no whole pages in a tile: rows addressed as before
    ],
)  # fmt: skip
def test_whole_pages_equal_the_plain_launch_and_the_reference(page_size, block_n, splits, ahead, decode, kwargs):
    k_lens = [page_size - 1 or 1, page_size, page_size + 1, 3 * page_size + 5, 1, 70]
    q_lens = [1] * len(k_lens) if decode else [min(5, L) for L in k_lens]
    case = make_paged_case(q_lens, k_lens, page_size=page_size, dtype=torch.float16, device=DEVICE, seed=page_size)
    plain = TileConfig(block_q=8, block_m=16, block_n=block_n, num_warps=4, num_stages=2, pages_ahead=ahead)
    want = run(case, plain, splits, **kwargs)
    got = run(case, dataclasses.replace(plain, whole_pages=True), splits, **kwargs)
    assert not got.isnan().any()
    assert torch.equal(got, want)
    ref = paged_attention_ref(
        **case.inputs(), scale=0.125, window_left=kwargs.get("window_left", -1),
        attention_chunk_size=kwargs.get("chunk_size"),
    )  # fmt: skip
    assert max_error(got, ref) < 2e-3


def test_whole_pages_over_an_fp8_cache_and_two_column_tiles():
    from portattn.kv_quant import quantize_kv

    case = make_paged_case([1, 3, 1], [15, 16, 40], page_size=8, dtype=torch.float16, device=DEVICE, seed=5)
    k8, v8 = (quantize_kv(c, torch.float8_e5m2, 0.5) for c in (case.k_cache, case.v_cache))
    plain = TileConfig(block_q=8, block_m=16, block_n=16, num_warps=4, num_stages=2)
    want = run(case, plain, 2, k8, v8, 0.5)
    got = run(case, dataclasses.replace(plain, whole_pages=True), 2, k8, v8, 0.5)
    assert not got.isnan().any() and torch.equal(got, want)
    dequantized = dataclasses.replace(case, k_cache=k8.to(torch.float16) * 0.5, v_cache=v8.to(torch.float16) * 0.5)
    assert max_error(got, paged_attention_ref(**dequantized.inputs(), scale=0.125)) < 2e-3
    wide = make_paged_case([2, 1], [17, 30], page_size=8, head_dim=80, dtype=torch.float16, device=DEVICE, seed=6)
    got = run(wide, dataclasses.replace(plain, whole_pages=True), 1)
    assert torch.equal(got, run(wide, plain, 1))
    assert max_error(got, paged_attention_ref(**wide.inputs(), scale=0.125)) < 2e-3
