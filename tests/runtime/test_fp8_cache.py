"""fp8 KV caches in the engine's write path and pools: what a write stores (saturated, divided by the
scale) lands exactly in its slots and nowhere else, reads give back value / scale * scale, and the
pools and the checkpoint's scales are checked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from conftest import BACKENDS, DEVICE
from portattn.backends.base import AttentionSpec, Request
from portattn.backends.cache import LatentKVCache, PagedKVCache
from portattn.backends.registry import select_backend
from portattn.backends.torch_ref import TorchBackend
from portattn.kv_quant import dequantize_kv, quantize_kv, resolve_kv_cache_dtype
from portattn.models.loader import kv_cache_scales
from portattn.runtime import kv_cache as kv_cache_module
from portattn.runtime.kv_cache import KVCacheSpec, keys_contiguous, make_kv_pool, mla_cache_spec
from portattn.testing import cu_seqlens, max_error, paged_attention_ref, tolerance

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def make_batch(page_size: int, q_lens: list[int], k_lens: list[int], num_pages: int) -> SimpleNamespace:
    """An engine batch (``AttentionBackend.plan``'s input): req_to_token rows over shuffled pages."""
    g = torch.Generator().manual_seed(page_size)
    width = -(-max(k_lens) // page_size) * page_size
    req_to_token = torch.full((len(q_lens) + 1, width), -1, dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=g).tolist()
    rows, locs = list(range(len(q_lens), 0, -1)), []
    for row, n, length in zip(rows, q_lens, k_lens):
        pages = [perm.pop() for _ in range(-(-length // page_size))]
        slots = torch.tensor([pages[j // page_size] * page_size + j % page_size for j in range(length)])
        req_to_token[row, :length] = slots
        locs.append(slots[length - n :])
    return SimpleNamespace(
        req_to_token=req_to_token.to(DEVICE),
        req_pool_indices=torch.tensor(rows, device=DEVICE),
        cu_seqlens_q=cu_seqlens(q_lens, DEVICE),
        seq_lens_k=torch.tensor(k_lens, dtype=torch.int32, device=DEVICE),
        out_cache_loc=torch.cat(locs).long().to(DEVICE),
        page_size=page_size,
        max_seqlen_k=max(k_lens),
        attention_chunk_size=None,
    )


def poisoned_pool(num_pages, page_size, heads, dim, dtype):
    """A cache whose every slot holds NaN (as the dtype encodes it), so that a stray write or read shows."""
    return torch.full((num_pages, page_size, heads, dim), float("nan"), device=DEVICE).to(dtype)


@pytest.mark.parametrize("v_keys", [False, True], ids=["v_usual", "v_keys_contiguous"])
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("backend", [b for b in ("torch", "triton") if b in BACKENDS])
def test_forward_writes_saturated_scaled_values_to_their_slots_only(backend, page_size, kv_dtype, v_keys):
    """``v_keys``: the V cache stored with each page's keys contiguous (the pool's fp8 layout), written
    through its strides."""
    q_lens, k_lens = [1, 5, 9], [13, 5, 20]
    num_pages = -(-64 // page_size)
    batch = make_batch(page_size, q_lens, k_lens, num_pages)
    impl = select_backend("attention", backend, Request("paged_attention", DEVICE.type, torch.float16, 16))
    spec = AttentionSpec(0, num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, window_left=7)
    k_scale, v_scale = 0.5, 0.125
    g = torch.Generator().manual_seed(page_size)
    k_cache, v_cache = (poisoned_pool(num_pages, page_size, 2, 16, kv_dtype) for _ in range(2))
    # The old tokens' K/V, written as a previous forward would have.
    old = torch.ones(num_pages * page_size, dtype=torch.bool, device=DEVICE)
    old[batch.out_cache_loc] = False
    owned = torch.zeros_like(old)
    owned[batch.req_to_token[batch.req_to_token >= 0].long()] = True
    for cache, scale in ((k_cache, k_scale), (v_cache, v_scale)):
        rows = cache.view(-1, 2, 16)
        rows[old & owned] = quantize_kv(
            torch.randn(int((old & owned).sum()), 2, 16, generator=g).to(DEVICE), kv_dtype, scale
        )
    if v_keys:
        v_cache = keys_contiguous(v_cache)
    v_strides = v_cache.stride()
    before_k, before_v = k_cache.clone(), v_cache.clone()
    n = sum(q_lens)
    q = torch.randn(n, 4, 16, generator=g).to(DEVICE, torch.float16)
    k = torch.randn(n, 2, 16, generator=g).to(DEVICE, torch.float16)
    v = torch.randn(n, 2, 16, generator=g).to(DEVICE, torch.float16)
    k[0, 0, :3] = torch.tensor([1e4, -1e4, float("inf")])  # saturate to the format's largest value
    v[2, 1, 0] = 6e4

    metadata = impl.plan(batch)
    out = impl.forward(q, k, v, spec, metadata, PagedKVCache(k_cache, v_cache, k_scale, v_scale))

    loc = batch.out_cache_loc
    limit = torch.finfo(kv_dtype).max
    for cache, before, new, scale in ((k_cache, before_k, k, k_scale), (v_cache, before_v, v, v_scale)):
        slots, old_slots = cache.contiguous().view(-1, 2, 16), before.contiguous().view(-1, 2, 16)
        stored = slots[loc]
        assert torch.equal(stored.view(torch.uint8), quantize_kv(new, kv_dtype, scale).view(torch.uint8))
        assert torch.isfinite(stored.float()).all() and float(stored.float().abs().max()) == limit
        untouched = torch.ones(slots.shape[0], dtype=torch.bool, device=DEVICE)
        untouched[loc] = False
        assert torch.equal(slots[untouched].view(torch.uint8), old_slots[untouched].view(torch.uint8))
    assert v_cache.stride() == v_strides and (v_cache.stride(1) == 1) == v_keys
    # Read back: the dequantised cache is what the attention saw.
    dequantised = [dequantize_kv(c, s, torch.float64) for c, s in ((k_cache, k_scale), (v_cache, v_scale))]
    args = (q, *dequantised, metadata.page_table, batch.cu_seqlens_q, batch.seq_lens_k)
    ref = paged_attention_ref(*args, scale=0.25, window_left=7)
    lowp = paged_attention_ref(*args, scale=0.25, window_left=7, upcast=False)
    assert max_error(out, ref) <= tolerance(ref, lowp, torch.float16)


@pytest.mark.parametrize("kv_dtype", FP8)
def test_write_latent_round_trip(kv_dtype):
    cache = torch.full((5, 3, 12), float("nan")).to(kv_dtype)
    before = cache.clone()
    c_kv = torch.randn(4, 8) * 100
    k_pe = torch.randn(4, 4)
    c_kv[1, 2] = 1e9
    slots = torch.tensor([14, 0, 7, 3])
    TorchBackend().write_latent(c_kv, k_pe, LatentKVCache(cache, scale=0.5), slots)
    rows = cache.view(-1, 12)
    assert torch.equal(
        rows[slots].view(torch.uint8), quantize_kv(torch.cat([c_kv, k_pe], 1), kv_dtype, 0.5).view(torch.uint8)
    )
    assert rows[slots[1], 2].float() == torch.finfo(kv_dtype).max  # saturated
    back = dequantize_kv(rows[slots], 0.5)  # within one rounding of the format
    eps = {torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}[kv_dtype]
    want = torch.cat([c_kv, k_pe], 1).clamp(-0.5 * torch.finfo(kv_dtype).max, 0.5 * torch.finfo(kv_dtype).max)
    assert ((back - want).abs() <= eps * want.abs() + 2**-10).all()
    others = torch.ones(15, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(rows[others].view(torch.uint8), before.view(-1, 12)[others].view(torch.uint8))
    with pytest.raises(ValueError, match=r"scale 1\.0 for a torch\.float32 cache"):
        TorchBackend().write_latent(c_kv[:1], k_pe[:1], LatentKVCache(torch.zeros(2, 3, 12), scale=0.5), slots[:1])


def test_pools_in_the_cache_dtype_and_their_scales():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=16, v_head_dim=8)
    pool = make_kv_pool(spec, 4, 5, torch.float8_e5m2, "cpu")
    assert pool.kv_cache(2).k.dtype == pool.kv_cache(2).v.dtype == torch.float8_e5m2
    assert spec.bytes_per_page(5, torch.float8_e5m2) * 2 == spec.bytes_per_page(5, torch.bfloat16)
    assert pool.kv_scales(1) == (1.0, 1.0)
    pool.set_kv_scales([(1.0, 1.0), (0.5, 2.0), (3, 1.0)])
    assert pool.kv_scales(1) == (0.5, 2.0) and pool.kv_scales(2) == (3.0, 1.0)
    view = pool.kv_cache(1)  # the layer's view carries its scales
    assert (view.k_scale, view.v_scale) == (0.5, 2.0) and view.k is pool.k[1] and view.v is pool.v[1]
    with pytest.raises(ValueError, match=r"expected 3 \(k_scale, v_scale\) pairs, got 2"):
        pool.set_kv_scales([(1.0, 1.0)] * 2)
    with pytest.raises(ValueError, match=r"expected v_scale to be a positive finite float, got 0\.0"):
        pool.set_kv_scales([(1.0, 0.0)] * 3)
    plain = make_kv_pool(spec, 4, 5, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"expected KV scales of 1\.0 for a torch\.float32 cache"):
        plain.set_kv_scales([(1.0, 1.0), (0.5, 1.0), (1.0, 1.0)])
    latent = make_kv_pool(mla_cache_spec(2, 32, 8), 4, 5, torch.float8_e4m3fn, "cpu")
    assert latent.kv_cache(1).latent.dtype == torch.float8_e4m3fn and latent.kv_cache(1).latent.shape == (4, 5, 40)
    latent.set_kv_scales([(1.0, 1.0), (0.25, 1.0)])
    assert latent.kv_cache(1).scale == 0.25 and latent.kv_cache(0).scale == 1.0  # the K scale


@pytest.mark.parametrize("on", [False, True])
def test_fp8_v_caches_keep_their_keys_contiguous_where_the_pool_is_told(on, monkeypatch):
    """``FP8_V_KEYS_CONTIGUOUS``: an fp8 pool's V caches of pages of more than one key are stored
    ``[N, Hkv, Dv, P]`` (the same logical shape); K, 16-bit caches and pages of one key as usual."""
    monkeypatch.setattr(kv_cache_module, "FP8_V_KEYS_CONTIGUOUS", on)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, v_head_dim=8)
    pool = make_kv_pool(spec, 4, 5, torch.float8_e4m3fn, "cpu")
    for layer in range(2):
        k, v = pool.kv_cache(layer).k, pool.kv_cache(layer).v
        assert k.shape == (4, 5, 2, 16) and v.shape == (4, 5, 2, 8) and k.is_contiguous()
        assert v.stride() == ((2 * 8 * 5, 1, 8 * 5, 5) if on else (5 * 2 * 8, 2 * 8, 8, 1))
    for dtype, page_size in ((torch.bfloat16, 5), (torch.float8_e4m3fn, 1)):
        assert make_kv_pool(spec, 4, page_size, dtype, "cpu").kv_cache(0).v.is_contiguous()


def test_kv_cache_dtype_names():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float16) == torch.float8_e5m2
    assert resolve_kv_cache_dtype(torch.float8_e5m2, torch.float16) == torch.float8_e5m2
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn  # vLLM's name for e4m3
    wanted = r"expected kv_cache_dtype in \['auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\], got 'int8'"
    with pytest.raises(ValueError, match=wanted):
        resolve_kv_cache_dtype("int8", torch.float16)
    with pytest.raises(ValueError, match=r"expected kv_cache_dtype torch\.float16 or an fp8 dtype"):
        resolve_kv_cache_dtype(torch.bfloat16, torch.float16)


def test_checkpoint_scales(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    one = torch.tensor(1.0)
    save_file(
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(0.25),
            "model.layers.0.self_attn.v_scale": torch.tensor([0.5]),
            "model.layers.2.self_attn.kv_scale": torch.tensor(2.0),
            "model.layers.9.self_attn.k_scale": torch.tensor(7.0),  # past the model's layers: ignored
            "model.layers.1.self_attn.q_proj.weight": torch.zeros(2, 2),
            "model.norm.weight": one,
        },
        tmp_path / "model.safetensors",
    )
    assert kv_cache_scales(tmp_path, 3) == [(0.25, 0.5), (1.0, 1.0), (2.0, 2.0)]
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor([0.5, 0.5])}, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"expected model\.layers\.0\.self_attn\.k_scale to hold one positive finite scale"
    ):
        kv_cache_scales(tmp_path, 3)


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton does not run here")
def test_the_fused_rotary_write_leaves_fp8_caches_to_write_kv(monkeypatch):
    """The fused rotary + cache-write kernel stores plain casts: with an fp8 cache the Triton backend
    does not fuse (the layer then rotates and calls ``forward``, whose ``write_kv`` saturates and
    scales); the torch backend never fuses."""
    import portattn.backends.triton as triton_backend

    monkeypatch.setattr(triton_backend, "rotary_kv_write", lambda *args: pytest.fail("the fused write ran on fp8"))
    spec = AttentionSpec(0, num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
    fp8 = torch.zeros(2, 4, 2, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    q, k, v = (torch.zeros(3, h, 16, device=DEVICE) for h in (4, 2, 2))
    cos, sin = torch.ones(3, 16, device=DEVICE), torch.zeros(3, 16, device=DEVICE)
    for backend in (triton_backend.TritonBackend(), TorchBackend()):
        cache = PagedKVCache(fp8, fp8.clone(), k_scale=0.5, v_scale=2.0)
        assert backend.forward_rotary(q, k, v, cos, sin, spec, None, cache) is None
