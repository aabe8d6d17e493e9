"""The fused elementwise kernels (residual add + RMSNorm, gated activation) against the layers' torch
code, which is their reference (on the CPU through Triton's interpreter; on a GPU natively)."""

from __future__ import annotations

import pytest
import torch

from conftest import BACKENDS, DEVICE
from portattn.models.layers import RMSNorm, RotaryEmbedding
from portattn.models.layers.activation import ACTIVATIONS

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")

if "triton" in BACKENDS:
    from portattn.kernels.triton.fused_launch import (
        ACTIVATION_CODES,
        RotaryTiles,
        add_rmsnorm,
        argmax_rows,
        attn_temperature,
        gated_activation,
        grouped_topk,
        kv_write,
        latent_rotary_write,
        rotary_kv_write,
        rotary_pairs,
        rotary_table,
        router_topk,
    )

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type != "cpu" else [])
ULP = {torch.float32: 2e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within one rounding step of the dtype of each value (sums in another order, exp/erf by another
    library), plus a few float32 steps of the largest value (where a value is near zero)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = got.double(), want.double()
    bound = 1.01 * ULP[dtype] * want.abs() + 4 * ULP[torch.float32] * want.abs().max()
    excess = (got - want).abs() - bound
    assert float(excess.max()) <= 0, float(((got - want).abs() / want.abs().max()).max())


@pytest.mark.parametrize("mode", ["dtype", "unit_offset", "float32"])
@pytest.mark.parametrize("hidden", [64, 80, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rmsnorm_equals_the_layer(dtype, hidden, mode):
    g = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-5, unit_offset=mode == "unit_offset", weight_in_float32=mode == "float32")
    norm = norm.to(DEVICE, dtype)
    assert norm.mode == mode
    norm.weight.copy_(torch.randn(hidden, generator=g).to(DEVICE, dtype))
    x = torch.randn(7, hidden, generator=g).to(DEVICE, dtype)
    residual = torch.randn(7, hidden, generator=g).to(DEVICE, dtype)
    out, none = add_rmsnorm(x, norm.weight, norm.eps, mode=mode)
    assert none is None
    close(out, norm.norm(x), dtype)
    out, summed = add_rmsnorm(x, norm.weight, norm.eps, residual, mode=mode)
    assert torch.equal(summed, x + residual)  # the add rounds as a separate add does
    close(out, norm.norm(x + residual), dtype)
    assert add_rmsnorm(x[:0], norm.weight, norm.eps, residual[:0])[0].shape == (0, hidden)


def test_add_rmsnorm_takes_strided_rows():
    x = torch.randn(5, 3, 64).to(DEVICE)[:, 1]  # rows 192 apart
    weight = torch.rand(64).to(DEVICE)
    out, _ = add_rmsnorm(x, weight, 1e-6)
    norm = RMSNorm(64, 1e-6).to(DEVICE)
    norm.weight.copy_(weight)
    close(out, norm.norm(x), torch.float32)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("name", sorted(ACTIVATION_CODES))
@pytest.mark.parametrize("inter", [48, 1500])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_activation_equals_the_torch_code(dtype, inter, name, interleaved):
    """Gate half first, or gate and up features alternating (``interleaved``)."""
    g = torch.Generator().manual_seed(inter)
    gate_up = (3 * torch.randn(2, 3, 2 * inter, generator=g)).to(DEVICE, dtype)
    gate, up = (gate_up[..., 0::2], gate_up[..., 1::2]) if interleaved else gate_up.chunk(2, dim=-1)
    want = ACTIVATIONS[name](gate) * up
    got = gated_activation(name, gate_up, interleaved)
    assert got.shape == (2, 3, inter)
    close(got, want, dtype)


def test_layers_take_their_torch_code_on_the_cpu():
    from portattn.models.layers.fused import fused_ops

    assert fused_ops(torch.zeros(1)) is None  # the interpreter is for tests, not the model path


# (tokens, heads, warps) a program: None the default (rotary_tiles: 8 tokens of one head); one of each;
# blocks past the 5 tokens and past the 2 KV heads; 16 tokens (the default from 2,048 tokens on).
ROTARY_BLOCKS = [None, (1, 1, 1), (2, 4, 4), (16, 1, 4)]


@pytest.mark.parametrize("scaling", [1.0, 0.875])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_table_equals_the_layers_torch_code(dtype, head_dim, scaling):
    """``rotary_table``'s rows against ``RotaryEmbedding.cos_sin`` (the torch code it replaces in a
    forward on GPUs): 21 tokens (a partial last block of 16) at positions up to 131,071, within one
    rounding of the dtype (cos and sin of another library's float32); halves equal, as the layer's."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_theta=5e5)
    rotary = RotaryEmbedding(config, head_dim).to(DEVICE)
    rotary.scaling = scaling
    positions = torch.tensor([0, 1, 2, 15, 16, 17, 300, 4095, 4096, 131071, *range(40, 51)], device=DEVICE)
    cos, sin = rotary_table(positions, rotary.inv_freq, scaling, dtype)
    want_cos, want_sin = rotary.cos_sin(positions[:, None].float() * rotary.inv_freq[None, :], dtype)
    for got, want in ((cos, want_cos[:, 0]), (sin, want_sin[:, 0])):
        assert got.shape == (21, head_dim) and got.dtype == dtype
        close(got, want, dtype)
        assert torch.equal(got[:, : head_dim // 2], got[:, head_dim // 2 :])
    with pytest.raises(ValueError, match="expected integer positions"):
        rotary_table(positions.float(), rotary.inv_freq, scaling, dtype)
    with pytest.raises(ValueError, match="contiguous float32 inv_freq"):
        rotary_table(positions, rotary.inv_freq.double(), scaling, dtype)


@pytest.mark.parametrize("chunk", [64, 4096])
def test_argmax_rows_equals_torch_argmax(chunk):
    """``argmax_rows`` (the decode graph's greedy ids) against ``torch.argmax``: 1000 scores a row (a
    partial last chunk), ties within a chunk and across chunks (the first index wins), a NaN after a
    +inf (the NaN wins, as in torch), a row of -inf (index 0), and the scores' copy."""
    g = torch.Generator().manual_seed(chunk)
    scores = torch.randn(6, 1000, generator=g)
    scores[1, [70, 900]] = 50.0  # a tie across chunks (of 64)
    scores[2, [5, 9]] = 50.0  # a tie within one
    scores[3, 10], scores[3, 600], scores[3, 700] = float("inf"), float("nan"), float("nan")
    scores[4] = float("-inf")
    scores[5, 999] = 50.0  # the last score, in the partial chunk
    scores = scores.to(DEVICE)
    out = torch.full((6,), -1, dtype=torch.int64, device=DEVICE)
    copy = torch.zeros_like(scores)
    argmax_rows(scores, out, copy_into=copy, chunk=chunk)
    assert out.tolist() == torch.argmax(scores, dim=-1).tolist() == [out[0].item(), 70, 5, 600, 0, 999]
    assert torch.equal(copy.nan_to_num(), scores.nan_to_num()) and torch.equal(copy.isnan(), scores.isnan())
    with pytest.raises(ValueError, match="expected float32 scores"):
        argmax_rows(scores.half(), out)
    with pytest.raises(ValueError, match="contiguous int64 out"):
        argmax_rows(scores, out.int())


def test_rotary_tiles_are_powers_of_two():
    with pytest.raises(ValueError, match=r"RotaryTiles.block_h a power of two, got 3"):
        RotaryTiles(block_h=3)
    with pytest.raises(ValueError, match=r"RotaryTiles.block_t a power of two, got 0"):
        RotaryTiles(block_t=0)


@pytest.mark.parametrize("blocks", ROTARY_BLOCKS, ids=lambda b: "default" if b is None else "t{}h{}w{}".format(*b))
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_kv_write_equals_rotary_then_cache_write(dtype, head_dim, blocks):
    """Exactly the layer's rotation (each product rounded, then the sum) and the backend's cache write,
    at every program shape (blocks of tokens and of heads, with masked tails)."""
    from transformers import LlamaConfig

    g = torch.Generator().manual_seed(head_dim)
    num_tokens, hq, hkv, page_size, num_pages = 5, 4, 2, 3, 6
    config = LlamaConfig(hidden_size=hq * head_dim, num_attention_heads=hq, head_dim=head_dim, rope_theta=1e4)
    rotary = RotaryEmbedding(config, head_dim).to(DEVICE)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * head_dim, generator=g).to(DEVICE, dtype)  # one projection
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], 1))
    positions = torch.tensor([0, 7, 8, 300, 4095], device=DEVICE)
    cos, sin = rotary.table(positions, dtype)
    slots = torch.tensor([17, 0, 5, 9, 12], device=DEVICE)
    caches = [torch.full((num_pages, page_size, hkv, head_dim), float("nan"), dtype=dtype, device=DEVICE) for _ in "kv"]
    got_q = rotary_kv_write(q, k, v, cos, sin, *caches, slots, tiles=blocks and RotaryTiles(*blocks))

    want_q, want_k = RotaryEmbedding.apply(q, k, cos, sin)
    want = [torch.full_like(c, float("nan")) for c in caches]
    want[0].view(-1, hkv, head_dim)[slots] = want_k
    want[1].view(-1, hkv, head_dim)[slots] = v
    # Exact under the interpreter; a GPU compiler may contract a product and a sum into one FMA,
    # which rounds once instead of twice (one unit in the last place).
    exact = DEVICE.type == "cpu"
    ulp = dict(rtol=0.0, atol=0.0) if exact else dict(rtol=2 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).eps)
    torch.testing.assert_close(got_q, want_q, **ulp)
    for got, expected in zip(caches, want):
        assert torch.equal(got.isnan(), expected.isnan())  # no other slot written
        torch.testing.assert_close(got.nan_to_num(), expected.nan_to_num(), **ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("head_dim", [128, 40])  # 20 pairs: a masked block
def test_rotary_pairs_equal_llama4s_torch_code(dtype, norm, head_dim):
    """Llama 4's pair rotation (and q/k norm) of strided q and k views (a merged q/k/v row split) in one
    launch: the torch code's values, within one rounding step (a sum of squares in another order)."""
    from portattn.models.layers.norm import l2_norm
    from portattn.models.layers.rotary import InterleavedRotaryEmbedding

    g = torch.Generator().manual_seed(head_dim + norm)
    tokens, q_heads, kv_heads = 5, 6, 2
    qkv = (3 * torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=g)).to(DEVICE, dtype)
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 7, 300, 8191], device=DEVICE)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    table = torch.polar(torch.ones_like(freqs), freqs) * 0.5
    want_q, want_k = InterleavedRotaryEmbedding.apply(q, k, table)
    if norm:
        want_q, want_k = l2_norm(want_q, 1e-5), l2_norm(want_k, 1e-5)
    got_q, got_k = rotary_pairs(q, k, table, 1e-5 if norm else None)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)


@pytest.mark.parametrize("dtype", [t for t in DTYPES if t != torch.float32], ids=str)
@pytest.mark.parametrize(("experts", "top_k"), [(16, 1), (12, 2), (128, 1)])
def test_router_topk_equals_llama4s_torch_code(dtype, experts, top_k):
    """Llama 4's router in one launch: the top-k of the logits rounded to the dtype (1100 features: three
    programs a token, the last one's range partial), the sigmoid of each rounded to the dtype; the same experts
    and scores as the torch code's, and the per-token counters left zero for the next launch."""
    from portattn.kernels.triton import fused_launch

    g = torch.Generator().manual_seed(experts + top_k)
    x = torch.randn(7, 1100, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(experts, 1100, generator=g) / 1100**0.5).to(DEVICE, dtype)
    logits = (x.float() @ weight.float().T).to(dtype)  # F.linear's sums, rounded once
    top = torch.topk(logits, top_k, dim=1).values
    for _ in range(2):  # the second launch finds the counters as the first left them
        scores, ids = router_topk(x, weight, top_k)
        assert ids.dtype == torch.int64 and scores.dtype == dtype
        # the largest logits, largest first; among equal ones (frequent in bfloat16) the lowest expert first,
        # where torch.topk's order among ties is its implementation's (on an H200 it gave 5 before 0)
        chosen = logits.gather(1, ids)
        assert torch.equal(chosen, top)
        ties = chosen[:, 1:] == chosen[:, :-1]
        assert bool((ids[:, 1:] > ids[:, :-1])[ties].all())
        assert torch.equal(scores, torch.sigmoid(top.float()).to(dtype))
    assert not fused_launch._router_counters[x.device].any()
    tied = weight.clone()
    tied[2] = tied[5] = 1.0  # experts 2 and 5 tie, above the others for positive rows
    scores, ids = router_topk(x.abs() + 1, tied, top_k)
    assert ids.tolist() == [[2, 5][:top_k]] * 7  # the lower expert first
    with pytest.raises(ValueError, match=r"expected top_k in \[1, 12\]"):
        router_topk(x, weight[:12], 13)
    with pytest.raises(ValueError, match=r"at most 64 tokens, got top_k 1 of 12, 65 tokens"):
        router_topk(x[:1].expand(65, -1), weight[:12], 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_write_equals_the_base_write(dtype):
    """One launch stores strided k and v views (a merged q/k/v row split) into their slots of pages of 7,
    bit for bit what ``AttentionBackend.write_kv`` stores, and nothing else (NaN elsewhere stays)."""
    from portattn.backends.base import AttentionBackend
    from portattn.backends.cache import PagedKVCache

    g = torch.Generator().manual_seed(3)
    tokens, heads, head_dim, value_dim = 5, 2, 40, 24
    qkv = torch.randn(tokens, 4 * head_dim + heads * (head_dim + value_dim), generator=g).to(DEVICE, dtype)
    k = qkv[:, 4 * head_dim : (4 + heads) * head_dim].view(tokens, heads, head_dim)
    v = qkv[:, (4 + heads) * head_dim :].view(tokens, heads, value_dim)
    slots = torch.tensor([0, 6, 7, 20, 13], device=DEVICE)
    caches = [torch.full((3, 7, heads, d), float("nan"), device=DEVICE, dtype=dtype) for d in (head_dim, value_dim)]
    want = [c.clone() for c in caches]
    AttentionBackend.write_kv(None, k, v, PagedKVCache(*want), slots)
    kv_write(k, v, *caches, slots)
    for got, ref in zip(caches, want):
        assert torch.equal(got.nan_to_num(7.0), ref.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attn_temperature_equals_llama4s_torch_code(dtype):
    """Llama 4's NoPE-layer query scale in one launch, over positions that cross several floor steps: the
    torch code's values within one rounding step (log1p and the product by another library)."""
    g = torch.Generator().manual_seed(4)
    q = (3 * torch.randn(6, 5, 40, generator=g)).to(DEVICE, dtype)
    positions = torch.tensor([0, 1, 8190, 8191, 40000, 500000], device=DEVICE)
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / 8192.0)) * 0.1 + 1.0
    want = (q * scales[:, None, None]).to(dtype)
    got = attn_temperature(q, positions, 0.1, 8192.0)
    assert got.shape == q.shape and got.is_contiguous()
    close(got, want, dtype)
    with pytest.raises(ValueError, match=r"expected integer positions \[6\]"):
        attn_temperature(q, positions.float(), 0.1, 8192.0)


def test_rotary_pairs_rejects_what_it_does_not_compute():
    q = torch.zeros(3, 4, 8, device=DEVICE, dtype=torch.float16)
    table = torch.polar(torch.ones(3, 4, device=DEVICE), torch.zeros(3, 4, device=DEVICE))
    with pytest.raises(ValueError, match=r"expected q \[T, Hq, D\] and k \[T, Hkv, D\] of one dtype"):
        rotary_pairs(q, q.float(), table)
    with pytest.raises(ValueError, match=r"expected a complex64 table \[3, 4\], got torch.complex64 \(3, 2\)"):
        rotary_pairs(q, q, table[:, :2])


def test_grouped_topk_gives_defined_ids_in_a_compile_ahead_rehearsal(monkeypatch):
    """In the warm-up's rehearsal (``compile_ahead``) no kernel runs, and a prefill's grouped path counts
    the ids on the host: they are zeros then, not whatever the buffer held (negative ids failed a
    DeepSeek-shaped start-up on a GPU)."""
    from portattn.kernels.triton import compile_ahead, fused_launch

    class NotLaunched:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(fused_launch, "grouped_topk_kernel", NotLaunched())
    monkeypatch.setattr(compile_ahead, "_rehearsing", [True])
    logits = torch.randn(300, 32, device=DEVICE)
    _, ids = grouped_topk(logits, torch.zeros(32, device=DEVICE), top_k=8, num_groups=8, topk_group=4,
                          normalize=True, scaling=1.0)  # fmt: skip
    assert ids.shape == (300, 8) and not ids.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("rope_dim", [64, 12])  # 6 pairs: a masked block
def test_latent_rotary_write_equals_the_rope_then_the_backends_write(dtype, interleave, rope_dim):
    """MLA's rope of q_pe and k_pe (strided views of the projections, as the layer splits them) and the
    latent rows' write in one launch: the values of ``PartialRotaryEmbedding.apply`` then
    ``write_latent``, bit for bit under the interpreter (on a GPU within a step: the compiler may
    contract a product and a sum into one FMA); a rank of 40 (a masked block); the other slots of a
    NaN-poisoned cache stay NaN."""
    from types import SimpleNamespace

    from portattn.backends.base import AttentionBackend
    from portattn.backends.cache import LatentKVCache
    from portattn.models.layers.rotary import PartialRotaryEmbedding

    g = torch.Generator().manual_seed(rope_dim + interleave)
    tokens, heads, nope, rank = 5, 3, 16, 40
    q = (3 * torch.randn(tokens, heads, nope + rope_dim, generator=g)).to(DEVICE, dtype)
    kv = (3 * torch.randn(tokens, rank + rope_dim, generator=g)).to(DEVICE, dtype)
    q_pe, (c_kv, k_pe) = q[..., nope:], kv.split([rank, rope_dim], dim=-1)
    config = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    rope = PartialRotaryEmbedding(config, rope_dim, interleave=interleave).to(DEVICE)
    cos, sin = rope.table(torch.tensor([0, 1, 7, 300, 4095], device=DEVICE), dtype)
    slots = torch.tensor([9, 0, 4, 13, 6], device=DEVICE)
    cache = torch.full((4, 4, rank + rope_dim), float("nan"), dtype=dtype, device=DEVICE)
    want_cache = cache.clone()
    AttentionBackend().write_latent(c_kv, rope.apply(k_pe[:, None], cos, sin)[:, 0], LatentKVCache(want_cache), slots)
    got = latent_rotary_write(q_pe, c_kv.contiguous(), k_pe, cos, sin, cache, slots, interleave=interleave)
    want = rope.apply(q_pe, cos, sin)
    assert got.is_contiguous() and torch.equal(cache.isnan(), want_cache.isnan())
    exact = DEVICE.type == "cpu"
    ulp = dict(rtol=0.0, atol=0.0) if exact else dict(rtol=2 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).eps)
    torch.testing.assert_close(got, want, **ulp)
    torch.testing.assert_close(cache.nan_to_num(), want_cache.nan_to_num(), **ulp)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_latent_rotary_write_with_the_latent_norm_stores_the_normed_rows(dtype):
    """``norm_weight``: the latent part of each stored row is ``RMSNorm``'s value of ``c_kv`` (within a
    rounding step; ``add_rmsnorm``'s bit for bit under the interpreter, whose reductions run in the same
    order), the rotated key and query as without the norm; other slots of a NaN-poisoned cache stay NaN."""
    g = torch.Generator().manual_seed(3)
    tokens, heads, rank, rope_dim = 4, 2, 40, 16
    q_pe = (3 * torch.randn(tokens, heads, rope_dim, generator=g)).to(DEVICE, dtype)
    kv = (3 * torch.randn(tokens, rank + rope_dim, generator=g)).to(DEVICE, dtype)
    c_kv, k_pe = kv.split([rank, rope_dim], dim=-1)  # strided views, as the layer splits the projection
    norm = RMSNorm(rank, 1e-6).to(DEVICE, dtype)
    norm.weight.copy_((1 + torch.rand(rank, generator=g)).to(DEVICE, dtype))
    cos, sin = (torch.rand(tokens, rope_dim // 2, generator=g).to(DEVICE, dtype) for _ in range(2))
    slots = torch.tensor([5, 0, 14, 9], device=DEVICE)
    plain, normed = (torch.full((4, 4, rank + rope_dim), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    q_plain = latent_rotary_write(q_pe, c_kv, k_pe, cos, sin, plain, slots, interleave=True)
    q_normed = latent_rotary_write(q_pe, c_kv, k_pe, cos, sin, normed, slots, interleave=True,
                                   norm_weight=norm.weight, eps=norm.eps)  # fmt: skip
    assert torch.equal(q_normed, q_plain) and torch.equal(normed.isnan(), plain.isnan())
    rows, plain_rows = normed.view(-1, rank + rope_dim)[slots], plain.view(-1, rank + rope_dim)[slots]
    assert torch.equal(rows[:, rank:], plain_rows[:, rank:])  # the rotated keys
    close(rows[:, :rank], norm.norm(c_kv), dtype)
    if DEVICE.type == "cpu":
        assert torch.equal(rows[:, :rank], add_rmsnorm(c_kv.contiguous(), norm.weight, norm.eps)[0])
    with pytest.raises(ValueError, match=rf"expected a contiguous norm weight \[{rank}\] of dtype"):
        latent_rotary_write(q_pe, c_kv, k_pe, cos, sin, normed, slots, interleave=True, norm_weight=norm.weight[:8])


def test_latent_rotary_write_rejects_what_it_does_not_compute():
    q_pe, c_kv, k_pe = (torch.zeros(*s, device=DEVICE, dtype=torch.float16) for s in ((2, 3, 8), (2, 16), (2, 8)))
    table = torch.zeros(2, 4, device=DEVICE, dtype=torch.float16)
    cache = torch.zeros(2, 4, 24, device=DEVICE, dtype=torch.float16)
    slots = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="of one dtype"):
        latent_rotary_write(q_pe, c_kv, k_pe, table, table, cache.float(), slots, interleave=True)
    with pytest.raises(ValueError, match=r"expected cos and sin \[2, 8\], got \(2, 4\)"):
        latent_rotary_write(q_pe, c_kv, k_pe, table, table, cache, slots, interleave=False)
    with pytest.raises(ValueError, match=r"contiguous latent cache \[N, P, 24\], got \(2, 4, 12\)"):
        latent_rotary_write(q_pe, c_kv, k_pe, table, table, cache[..., :12], slots, interleave=True)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("shape", [(32, 8, 4, 8), (40, 8, 3, 6), (20, 5, 2, 3)])  # E, groups, kept groups, top_k
def test_grouped_topk_equals_deepseeks_router(shape, normalize):
    """DeepSeek V3's grouped top-k routing in one launch against the router's torch code: the same
    experts (as sets: the torch code's order is unspecified) with the same weights (float32, summed in
    another order); 5 experts a group and 5 groups (each padded to 8)."""
    from types import SimpleNamespace

    from portattn.models.deepseek_v3 import DeepseekV3Router

    experts, groups, kept, top_k = shape
    g = torch.Generator().manual_seed(experts + top_k)
    config = SimpleNamespace(n_routed_experts=experts, num_experts_per_tok=top_k, n_group=groups, topk_group=kept,
                             norm_topk_prob=normalize, routed_scaling_factor=2.5, hidden_size=16)  # fmt: skip
    router = DeepseekV3Router(config)
    router.weight.data.copy_(torch.randn(experts, 16, generator=g))
    router.e_score_correction_bias.data.copy_(0.1 * torch.randn(experts, generator=g))
    router = router.to(DEVICE)
    x = torch.randn(9, 16, generator=g).to(DEVICE)
    want_w, want_ids = router(x)
    logits = torch.nn.functional.linear(x.float(), router.weight.float())
    got_w, got_ids = grouped_topk(logits, router.e_score_correction_bias, top_k=top_k, num_groups=groups,
                                  topk_group=kept, normalize=normalize, scaling=2.5)  # fmt: skip
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32 and got_ids.shape == (9, top_k)
    order_got, order_want = got_ids.sort(dim=1), want_ids.sort(dim=1)
    assert torch.equal(order_got.values, order_want.values)
    torch.testing.assert_close(got_w.gather(1, order_got.indices), want_w.gather(1, order_want.indices),
                               rtol=2e-6, atol=1e-7)  # fmt: skip
    chosen = logits.sigmoid() + router.e_score_correction_bias
    assert torch.all(chosen.gather(1, got_ids).diff(dim=1) <= 0)  # largest choice first


def test_grouped_topk_rejects_what_it_does_not_compute():
    logits, bias = torch.zeros(2, 16, device=DEVICE), torch.zeros(16, device=DEVICE)
    options = {"top_k": 4, "num_groups": 4, "topk_group": 2, "normalize": True, "scaling": 1.0}
    with pytest.raises(ValueError, match=r"expected float32 logits \[T, E\] and bias \[E\]"):
        grouped_topk(logits.half(), bias, **options)
    with pytest.raises(ValueError, match="num_groups groups of 2 or more"):
        grouped_topk(logits, bias, **(options | {"num_groups": 3}))
    with pytest.raises(ValueError, match=r"expected top_k in \[1, 8\] \(the kept groups' experts\), got 9"):
        grouped_topk(logits, bias, **(options | {"top_k": 9}))
