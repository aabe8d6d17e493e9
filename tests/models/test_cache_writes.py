"""The backend is the one writer of the KV cache: the attention layers (MHA, the fused rotary path, MLA)
store nothing themselves.

Each test runs a layer's forward twice over a cache poisoned with NaN. First with the backend's write
diverted into a shadow copy of the cache: the real cache must come out bit for bit as it went in, so
no other path wrote to it. Then with the write in place: exactly the new tokens' slots change, to what
the diverted write stored in the shadow, and every other slot stays NaN.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import portattn.backends.triton as triton_backend_module
import portattn.models.layers.attention as attention_module
from conftest import BACKENDS, DEVICE
from portattn.backends.base import AttentionSpec
from portattn.backends.cache import LatentKVCache, PagedKVCache
from portattn.backends.registry import backend_class
from portattn.device import is_triton_interpreter
from portattn.models.layers import RotaryEmbedding, SelfAttention
from portattn.models.layers.latent_attention import MultiheadLatentAttention
from portattn.runtime.context import ForwardContext
from portattn.runtime.kv_cache import KVCacheSpec, make_kv_pool, mla_cache_spec
from portattn.runtime.plan import plan_latent_attention
from runtime.test_fp8_cache import make_batch

# A decode (1 new token of 9), an extend (3 of 7) and a prefill (5 of 5); pages of 3.
Q_LENS, K_LENS, PAGE_SIZE, NUM_PAGES = [1, 3, 5], [9, 7, 5], 3, 12


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # NaN included


def new_slots_only(before: torch.Tensor, after: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows (one per slot) that ``slots`` name, after checking that no other row changed."""
    rows_before, rows_after = before.flatten(0, 1), after.flatten(0, 1)  # [N * P, ...]
    others = torch.ones(rows_before.shape[0], dtype=torch.bool, device=before.device)
    others[slots] = False
    assert same_bits(rows_after[others], rows_before[others]), "a slot no new token owns was written"
    assert not rows_after[slots].isnan().any(), "a new token's slot was not written"
    return rows_after[slots]


def poisoned(cache: torch.Tensor, batch, seed: int) -> None:
    """NaN in every slot, then the earlier tokens' K/V (or rows) in theirs, as earlier forwards left them."""
    cache.fill_(float("nan"))
    old = torch.zeros(cache.shape[0] * cache.shape[1], dtype=torch.bool, device=cache.device)
    old[batch.req_to_token[batch.req_to_token >= 0].long()] = True
    old[batch.out_cache_loc] = False
    rows = cache.view(-1, *cache.shape[2:])  # [N * P, ...]
    g = torch.Generator().manual_seed(seed)
    rows[old] = torch.randn(rows[old].shape, generator=g).to(cache.device, cache.dtype)


def random_parameters(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data.copy_(0.2 * torch.randn(p.shape, generator=g))


def mha_case(backend_name: str, dtype: torch.dtype):
    from transformers import LlamaConfig

    hidden, head_dim = 64, 16
    spec = AttentionSpec(0, num_heads=4, num_kv_heads=2, head_dim=head_dim, scale=head_dim**-0.5)
    layer = SelfAttention(hidden, spec)
    random_parameters(layer, 0)
    layer = layer.to(DEVICE, dtype)
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=4, head_dim=head_dim, rope_theta=1e4)
    rotary = RotaryEmbedding(config, head_dim).to(DEVICE)
    pool = make_kv_pool(KVCacheSpec(1, 2, head_dim, head_dim), NUM_PAGES, PAGE_SIZE, dtype, DEVICE)
    batch = make_batch(PAGE_SIZE, Q_LENS, K_LENS, NUM_PAGES)
    poisoned(pool.k[0], batch, 1)
    poisoned(pool.v[0], batch, 2)
    backend = backend_class(backend_name)()
    ctx = ForwardContext(backend, backend.plan(batch), pool)
    positions = torch.cat([torch.arange(k - q, k) for q, k in zip(Q_LENS, K_LENS)]).to(DEVICE)
    x = torch.randn(sum(Q_LENS), hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    table = rotary.table(positions, dtype)
    return SimpleNamespace(
        layer=layer, rotary=rotary, table=table, pool=pool, backend=backend, ctx=ctx, x=x, positions=positions
    )


def divert_write_kv(monkeypatch, backend, shadow: PagedKVCache) -> list:
    """The backend's ``write_kv`` stores into ``shadow`` instead of the cache it is given."""
    calls, write = [], type(backend).write_kv

    def diverted(k, v, kv_cache, slots):
        calls.append(slots)
        write(backend, k, v, PagedKVCache(shadow.k, shadow.v, kv_cache.k_scale, kv_cache.v_scale), slots)

    monkeypatch.setattr(backend, "write_kv", diverted)
    return calls


PAGED_BACKENDS = [b for b in ("torch", "triton") if b in BACKENDS]


@pytest.mark.parametrize("backend_name", PAGED_BACKENDS)
def test_the_backends_write_kv_is_the_only_kv_write(backend_name, monkeypatch):
    case = mha_case(backend_name, torch.float32)
    monkeypatch.setattr(attention_module, "fused_ops", lambda x: None)  # the unfused path: rotary, then forward
    before = [case.pool.k[0].clone(), case.pool.v[0].clone()]
    shadow = PagedKVCache(before[0].clone(), before[1].clone())
    with monkeypatch.context() as patch:
        calls = divert_write_kv(patch, case.backend, shadow)
        case.layer(case.positions, case.x, case.ctx, case.rotary, case.table)
    assert len(calls) == 1 and torch.equal(calls[0], case.ctx.metadata.out_cache_loc)
    assert same_bits(case.pool.k[0], before[0]) and same_bits(case.pool.v[0], before[1])  # nobody else wrote

    out = case.layer(case.positions, case.x, case.ctx, case.rotary, case.table)
    assert out.isfinite().all()  # every key the attention read was written
    slots = case.ctx.metadata.out_cache_loc
    for cache, old, owner in zip((case.pool.k[0], case.pool.v[0]), before, (shadow.k, shadow.v)):
        assert same_bits(new_slots_only(old, cache, slots), owner.flatten(0, 1)[slots])


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton does not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_the_fused_rotary_write_is_the_backends_and_the_only_one(dtype, monkeypatch):
    """With the fused kernels on, the layer asks the backend to fuse rotary with its write; the Triton
    backend's fused kernel is then the one write (``write_kv`` does not run too), and it stores and
    attends exactly what the unfused path does (rotary in the layer, then ``forward``): the kernel
    rounds each product and the sum to the dtype, as the layer's torch code does."""
    case = mha_case("triton", dtype)
    monkeypatch.setattr(attention_module, "fused_ops", lambda x: attention_module)  # any launchers: "fused on"
    before = [case.pool.k[0].clone(), case.pool.v[0].clone()]
    shadow = [before[0].clone(), before[1].clone()]
    calls, fused = [], triton_backend_module.rotary_kv_write

    def diverted(q, k, v, cos, sin, k_cache, v_cache, slots):
        calls.append(slots)
        return fused(q, k, v, cos, sin, *shadow, slots)

    with monkeypatch.context() as patch:
        patch.setattr(triton_backend_module, "rotary_kv_write", diverted)
        patch.setattr(case.backend, "write_kv", lambda *args: pytest.fail("the fused path wrote through write_kv too"))
        case.layer(case.positions, case.x, case.ctx, case.rotary, case.table)
    assert len(calls) == 1 and torch.equal(calls[0], case.ctx.metadata.out_cache_loc)
    assert same_bits(case.pool.k[0], before[0]) and same_bits(case.pool.v[0], before[1])  # nobody else wrote

    fused_out = case.layer(case.positions, case.x, case.ctx, case.rotary, case.table)
    slots = case.ctx.metadata.out_cache_loc
    for cache, old, owner in zip((case.pool.k[0], case.pool.v[0]), before, shadow):
        assert same_bits(new_slots_only(old, cache, slots), owner.flatten(0, 1)[slots])
    fused_cache = [case.pool.k[0].clone(), case.pool.v[0].clone()]
    monkeypatch.setattr(attention_module, "fused_ops", lambda x: None)
    unfused_out = case.layer(case.positions, case.x, case.ctx, case.rotary, case.table)  # rewrites the same slots
    assert fused_out.isfinite().all()  # every key the attention read was written
    if is_triton_interpreter():
        assert same_bits(case.pool.k[0], fused_cache[0]) and same_bits(case.pool.v[0], fused_cache[1])
        assert torch.equal(fused_out, unfused_out)
    else:
        # Compiled for a GPU, the two paths have differed: on an H200, float16 outputs by up to 3e-3 (15%
        # of elements), the cause not yet isolated (caches not compared then). Held to a tolerance there.
        tol = {} if dtype == torch.float32 else dict(rtol=0, atol=5e-3 * float(unfused_out.abs().max()))
        for cache, want in zip((case.pool.k[0], case.pool.v[0]), fused_cache):
            torch.testing.assert_close(cache, want, equal_nan=True, **tol)
        torch.testing.assert_close(fused_out, unfused_out, **tol)


class MLAConfig(SimpleNamespace):
    num_attention_heads, hidden_size, attention_bias = 4, 64, False
    q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim = 24, 32, 16, 8, 16


@pytest.mark.parametrize("fused", [False, True], ids=["write_latent", "write_latent_rotary"])
@pytest.mark.parametrize("backend_name", PAGED_BACKENDS)
def test_the_backends_write_latent_is_the_only_latent_write(backend_name, fused, monkeypatch):
    """A batch of a decode (absorbed) and prompt chunks (expanded): one latent write per layer forward,
    the backend's (with ``FUSED_ROTARY_WRITE``: its rope and write in one, where it has one, else
    ``write_latent``)."""
    from portattn.models.layers import latent_attention
    from portattn.models.layers.rotary import PartialRotaryEmbedding

    monkeypatch.setattr(latent_attention, "FUSED_ROTARY_WRITE", fused)
    if fused and "triton" in BACKENDS:  # the layer asks where the fused kernels are on (on the CPU: the interpreter)
        from portattn.kernels.triton import fused_launch

        monkeypatch.setattr(latent_attention, "fused_ops", lambda x: fused_launch)
    config, dtype = MLAConfig(), torch.float32
    layer = MultiheadLatentAttention(config, 0, scale=0.2)
    random_parameters(layer, 2)
    layer = layer.to(DEVICE, dtype)
    pool = make_kv_pool(
        mla_cache_spec(1, config.kv_lora_rank, config.qk_rope_head_dim), NUM_PAGES, PAGE_SIZE, dtype, DEVICE
    )
    batch = make_batch(PAGE_SIZE, Q_LENS, K_LENS, NUM_PAGES)
    poisoned(pool.latent[0], batch, 1)
    backend = backend_class(backend_name)()
    metadata = backend.plan(batch)
    plan = plan_latent_attention(backend, metadata, num_heads=4, kv_lora_rank=config.kv_lora_rank)
    assert plan.decode is not None and plan.varlen is not None  # both forms run
    ctx = ForwardContext(backend, metadata, pool, plan)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(Q_LENS), config.hidden_size, generator=g).to(DEVICE, dtype)
    positions = torch.arange(sum(Q_LENS), device=DEVICE)
    rope_config = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    rotary = PartialRotaryEmbedding(rope_config, config.qk_rope_head_dim, interleave=True).to(DEVICE)
    table = rotary.table(positions, dtype)

    before = pool.latent[0].clone()
    shadow, calls = before.clone(), []
    write, write_rotary = type(backend).write_latent, type(backend).write_latent_rotary

    def diverted(c_kv, k_pe, kv_cache, slots):
        calls.append(slots)
        write(backend, c_kv, k_pe, LatentKVCache(shadow, kv_cache.scale), slots)

    def diverted_rotary(q_pe, c_kv, k_pe, cos, sin, kv_cache, slots, **kwargs):
        out = write_rotary(backend, q_pe, c_kv, k_pe, cos, sin, LatentKVCache(shadow, kv_cache.scale), slots, **kwargs)
        if out is not None:
            calls.append(slots)
        return out

    with monkeypatch.context() as patch:
        patch.setattr(backend, "write_latent", diverted)
        patch.setattr(backend, "write_latent_rotary", diverted_rotary)
        layer(positions, x, ctx, rotary, table)
    assert len(calls) == 1 and torch.equal(calls[0], metadata.out_cache_loc)
    assert same_bits(pool.latent[0], before)  # nobody else wrote

    assert layer(positions, x, ctx, rotary, table).isfinite().all()
    slots = metadata.out_cache_loc
    assert same_bits(new_slots_only(before, pool.latent[0], slots), shadow.flatten(0, 1)[slots])
