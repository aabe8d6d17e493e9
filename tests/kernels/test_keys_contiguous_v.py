"""The paged attention kernel over a V cache whose keys are contiguous within each page (``V_KEYS``:
stored ``[pages, Hkv, Dv, P]``, the logical ``[pages, P, Hkv, Dv]``; the pool's fp8 V caches) against the
same launch over the usual layout (identical outputs: only V's addressing changes) and the float64
reference: pages of 3, 4, 7, 8 and 16 keys, tiles of whole pages and of a page id a key, lengths P - 1,
P, P + 1 and longer, decodes and query runs, windows and chunks, split and not, page ids ahead or not,
float16 and fp8 (e4m3, e5m2) caches, value dims of one column tile, of two (80) and with masked columns
(72); unused slots poisoned with NaN (kept by the layout copy). The tiles the launcher picks for an fp8
decode over such a cache, and the stride checks that keep other layouts out."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import BACKENDS, DEVICE
from portattn.kv_quant import dequantize_kv, quantize_kv
from portattn.runtime import kv_cache
from portattn.testing import make_paged_case, max_error, paged_attention_ref

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")

if "triton" in BACKENDS:
    from portattn.kernels.triton import launch
    from portattn.kernels.triton.launch import TileConfig, attention_forward


def keys_contiguous(cache: torch.Tensor) -> torch.Tensor:
    """``cache [N, P, H, D]`` copied into the keys-contiguous layout (the same logical tensor), checked."""
    _, page_size, heads, dim = cache.shape
    out = kv_cache.keys_contiguous(cache)
    assert out.stride() == (heads * dim * page_size, 1, dim * page_size, page_size) and torch.equal(
        out.to(torch.float32).nan_to_num(7.0), cache.to(torch.float32).nan_to_num(7.0)
    )
    return out


def run(case, tiles, splits, k_cache, v_cache, scale=1.0, **kwargs) -> torch.Tensor:
    out = torch.full(
        (case.q.shape[0], case.q.shape[1], v_cache.shape[-1]), float("nan"), dtype=case.q.dtype, device=DEVICE
    )
    max_seqlen_q = int((case.cu_seqlens_q[1:] - case.cu_seqlens_q[:-1]).max())
    attention_forward(
        case.q, k_cache, v_cache, out, case.cu_seqlens_q, case.seq_lens_k, max_seqlen_q=max_seqlen_q,
        scale=0.125, page_table=case.page_table, num_kv_splits=splits, tiles=tiles, k_scale=scale,
        v_scale=scale, **kwargs,
    )  # fmt: skip
    return out


CASES = [  # page size, key tile, splits, page ids ahead, whole pages, decode, cache, value dim, kwargs
    (16, 32, 1, True, True, True, torch.float8_e4m3fn, 64, {}),
    (16, 16, 2, True, True, True, torch.float8_e5m2, 64, {}),
    (4, 16, 3, False, True, True, torch.float8_e4m3fn, 64, {}),
    (8, 32, 2, True, True, False, torch.float16, 64, {}),
    (16, 32, 1, False, True, False, torch.float8_e4m3fn, 64, {"window_left": 20}),
    (4, 16, 2, True, True, False, torch.float8_e4m3fn, 64, {"chunk_size": 24}),
    (8, 16, 1, False, False, True, torch.float8_e5m2, 64, {"window_left": 9}),
    (3, 16, 1, True, True, False, torch.float8_e4m3fn, 64, {}),  # pages do not divide the tile: a page id a key
    (7, 16, 2, False, False, True, torch.float16, 64, {}),
    (8, 16, 2, True, True, True, torch.float8_e4m3fn, 80, {}),  # two value column tiles: a page id a key
    (8, 16, 1, False, False, False, torch.float8_e5m2, 72, {}),  # masked value columns
]  # fmt: skip


@pytest.mark.parametrize("page_size, block_n, splits, ahead, whole, decode, kv_dtype, value_dim, kwargs", CASES)
def test_keys_contiguous_v_equals_the_usual_layout_and_the_reference(
    page_size, block_n, splits, ahead, whole, decode, kv_dtype, value_dim, kwargs
):
    k_lens = [page_size - 1 or 1, page_size, page_size + 1, 3 * page_size + 5, 1, 70]
    q_lens = [1] * len(k_lens) if decode else [min(5, L) for L in k_lens]
    case = make_paged_case(
        q_lens, k_lens, page_size=page_size, dtype=torch.float16, device=DEVICE, seed=page_size + value_dim,
        value_dim=value_dim,
    )  # fmt: skip
    scale = 0.5 if kv_dtype != torch.float16 else 1.0
    k_cache, v_cache = (quantize_kv(c, kv_dtype, scale) for c in (case.k_cache, case.v_cache))
    v_keys = keys_contiguous(v_cache)
    assert launch.keys_contiguous_v(v_keys) and not launch.keys_contiguous_v(v_cache)
    tiles = TileConfig(
        block_q=8, block_m=16, block_n=block_n, num_warps=4, num_stages=2, pages_ahead=ahead, whole_pages=whole
    )
    want = run(case, tiles, splits, k_cache, v_cache, scale, **kwargs)
    got = run(case, tiles, splits, k_cache, v_keys, scale, **kwargs)
    assert not got.isnan().any()
    assert torch.equal(got, want)
    dequantized = dataclasses.replace(
        case, k_cache=dequantize_kv(k_cache, scale, torch.float64), v_cache=dequantize_kv(v_cache, scale, torch.float64)
    )
    ref = paged_attention_ref(
        **dequantized.inputs(), scale=0.125, window_left=kwargs.get("window_left", -1),
        attention_chunk_size=kwargs.get("chunk_size"),
    )  # fmt: skip
    assert max_error(got, ref) < 2e-3


def test_fp8_decode_tiles_over_keys_contiguous_v_take_whole_pages_under_a_register_cap():
    """On a GPU an fp8 decode over keys-contiguous V loads whole pages in 64-key tiles, 3 stages, with at most
    ``FP8_KEYS_MAXNREG`` registers a thread; over the usual layout, and for 16-bit caches, as before."""
    rules = dict(interpret=False, itemsize=2, kv_itemsize=1)
    keys = launch.choose_tiles(1, 4, 128, 128, v_keys=True, **rules)
    usual = launch.choose_tiles(1, 4, 128, 128, **rules)
    assert keys == dataclasses.replace(
        usual, block_n=64, num_stages=3, whole_pages=True, maxnreg=launch.FP8_KEYS_MAXNREG
    )
    assert (usual.block_n, usual.whole_pages, usual.maxnreg) == (128, False, None)
    assert (keys.block_n, keys.num_warps, keys.num_stages, keys.pages_ahead) == (64, 4, 3, True)
    assert keys.launch_options()["maxnreg"] == launch.FP8_KEYS_MAXNREG
    bf16 = dict(rules, kv_itemsize=2)
    assert launch.choose_tiles(1, 4, 128, 128, v_keys=True, **bf16) == launch.choose_tiles(1, 4, 128, 128, **bf16)
    prefill = launch.choose_tiles(4096, 4, 128, 128, v_keys=True, **rules)
    assert prefill == launch.choose_tiles(4096, 4, 128, 128, **rules)


def test_default_tiles_see_the_layout_and_strided_v_is_kept_for_paged_launches_only():
    case = make_paged_case([1, 1], [20, 9], page_size=4, dtype=torch.float16, device=DEVICE, seed=2)
    v_keys = keys_contiguous(case.v_cache)
    seen = []
    choose = launch.choose_tiles
    try:
        launch.choose_tiles = lambda *a, **k: seen.append(k["v_keys"]) or choose(*a, **k)
        for v in (case.v_cache, v_keys):
            launch.default_tiles(case.q, case.k_cache, v, 2, 1, 20, 1)
    finally:
        launch.choose_tiles = choose
    assert seen == [False, True]
    # varlen (contiguous K/V) still asks for a contiguous last dim
    k = torch.randn(29, 2, 64, dtype=torch.float16, device=DEVICE)
    v = torch.randn(29, 64, 2, dtype=torch.float16, device=DEVICE).transpose(1, 2)
    cu = torch.tensor([0, 20, 29], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, 64, dtype=torch.float16, device=DEVICE)
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="v with a contiguous last dim"):
        attention_forward(q, k, v, torch.empty_like(q), cu_q, cu[1:] - cu[:-1], max_seqlen_q=1, scale=0.125,
                          kv_start=cu[:-1])  # fmt: skip
