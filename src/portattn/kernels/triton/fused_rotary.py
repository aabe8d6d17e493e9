"""Rotary embedding of q and k (rotate-half, the whole head) with the K/V cache write, in one launch.

Program ``(i, g)`` takes ``BLOCK_T`` tokens from ``i * BLOCK_T`` and a block of ``BLOCK_H`` heads of one
kind: the first ``cdiv(Hq, BLOCK_H)`` blocks rotate query heads into ``QOut``, the next
``cdiv(Hkv, BLOCK_H)`` rotate key heads and store them in each token's cache slot, the last as many
copy value heads there (heads past a kind's count are masked). The rotation rounds as transformers'
``q * cos + rotate_half(q) * sin`` does in the model dtype: each product, then the sum. Grid:
``(cdiv(T, BLOCK_T), cdiv(Hq, BLOCK_H) + 2 * cdiv(Hkv, BLOCK_H))`` (``fused_launch.rotary_tiles`` picks
the blocks).

:func:`rotary_table_kernel` makes the ``cos, sin`` rows that it and the fused q/k/v projection read, from
the tokens' positions, in one launch where torch's code takes nine.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .pdl import wait_for_previous


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def rotate_halves(x1, x2, cos1, cos2, sin1, sin2, DTYPE: tl.constexpr):
    """``x * cos + rotate_half(x) * sin`` of a head's halves ``x1, x2`` (float32, any shape), with
    ``rotate_half(x) = [-x2, x1]``, rounded as transformers rounds it in ``DTYPE``: each product, then
    the sum (returned in float32)."""
    o1 = _rounded(x1 * cos1, DTYPE) - _rounded(x2 * sin1, DTYPE)
    o2 = _rounded(x2 * cos2, DTYPE) + _rounded(x1 * sin2, DTYPE)
    return o1, o2


@triton.jit(do_not_specialize=["T"])  # one compiled variant for every token count
def rotary_kv_write_kernel(
    Q,
    K,
    V,
    Cos,
    Sin,
    Slots,
    QOut,
    KCache,
    VCache,
    T,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_ot,
    stride_oh,
    stride_ks,
    stride_kch,
    stride_vs,
    stride_vch,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr = 1,
    BLOCK_H: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = ts < T
    ts64 = ts.to(tl.int64)
    g = tl.program_id(1)
    Q_BLOCKS: tl.constexpr = (NUM_Q_HEADS + BLOCK_H - 1) // BLOCK_H
    KV_BLOCKS: tl.constexpr = (NUM_KV_HEADS + BLOCK_H - 1) // BLOCK_H
    hs = tl.arange(0, BLOCK_H)
    DTYPE: tl.constexpr = Q.dtype.element_ty
    if g >= Q_BLOCKS + KV_BLOCKS:  # value heads: copied to the cache
        heads = (g - Q_BLOCKS - KV_BLOCKS) * BLOCK_H + hs
        slots = tl.load(Slots + ts64, mask=t_ok, other=0).to(tl.int64)
        offs_v = tl.arange(0, BLOCK_V)
        mask_v = t_ok[:, None, None] & (heads < NUM_KV_HEADS)[None, :, None] & (offs_v < VALUE_DIM)[None, None, :]
        src_v = V + ts64[:, None, None] * stride_vt + heads[None, :, None] * stride_vh + offs_v[None, None, :]
        dst_v = VCache + slots[:, None, None] * stride_vs + heads[None, :, None] * stride_vch + offs_v[None, None, :]
        tl.store(dst_v, tl.load(src_v, mask=mask_v), mask=mask_v)
        return
    offs = tl.arange(0, BLOCK)
    rows = t_ok[:, None] & (offs < HALF)[None, :]
    cos1 = tl.load(Cos + ts64[:, None] * stride_cos + offs[None, :], mask=rows, other=0.0).to(tl.float32)
    cos2 = tl.load(Cos + ts64[:, None] * stride_cos + HALF + offs[None, :], mask=rows, other=0.0).to(tl.float32)
    sin1 = tl.load(Sin + ts64[:, None] * stride_sin + offs[None, :], mask=rows, other=0.0).to(tl.float32)
    sin2 = tl.load(Sin + ts64[:, None] * stride_sin + HALF + offs[None, :], mask=rows, other=0.0).to(tl.float32)
    if g < Q_BLOCKS:
        heads = g * BLOCK_H + hs
        h_ok = heads < NUM_Q_HEADS
        src = Q + ts64[:, None, None] * stride_qt + heads[None, :, None] * stride_qh
        dst = QOut + ts64[:, None, None] * stride_ot + heads[None, :, None] * stride_oh
    else:
        heads = (g - Q_BLOCKS) * BLOCK_H + hs
        h_ok = heads < NUM_KV_HEADS
        slots = tl.load(Slots + ts64, mask=t_ok, other=0).to(tl.int64)
        src = K + ts64[:, None, None] * stride_kt + heads[None, :, None] * stride_kh
        dst = KCache + slots[:, None, None] * stride_ks + heads[None, :, None] * stride_kch
    mask = t_ok[:, None, None] & h_ok[None, :, None] & (offs < HALF)[None, None, :]
    x1 = tl.load(src + offs[None, None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs[None, None, :], mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rotate_halves(x1, x2, cos1[:, None, :], cos2[:, None, :], sin1[:, None, :], sin2[:, None, :], DTYPE)
    tl.store(dst + offs[None, None, :], o1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + offs[None, None, :], o2.to(dst.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T"])
def rotary_table_kernel(
    Positions, InvFreq, Cos, Sin, T, scaling, stride_pos, stride_cos, stride_sin,
    HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Rows ``cos, sin [T, 2 * HALF]`` of the rotate-half embedding at ``Positions [T]`` (integers):
    ``cos(p * inv_freq) * scaling`` in float32, rounded once to the outputs' dtype, each row's halves
    equal; as ``RotaryEmbedding.cos_sin`` computes it in torch (its float32 product, the scaling's
    product). ``LIBDEVICE``: ``cos`` and ``sin`` from the device library, accurate over the whole range
    as torch's (``tl.cos`` may compile to a hardware approximation that loses digits at large
    arguments); off under the interpreter, which has no device library. Program ``i`` takes ``BLOCK_T``
    tokens from ``i * BLOCK_T``."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs = tl.arange(0, BLOCK)
    row_ok = rows < T
    col_ok = offs < HALF
    rows64 = rows.to(tl.int64)
    inv_freq = tl.load(InvFreq + offs, mask=col_ok, other=0.0)
    wait_for_previous(PDL)
    pos = tl.load(Positions + rows64 * stride_pos, mask=row_ok, other=0).to(tl.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # [BLOCK_T, BLOCK]
    if LIBDEVICE:
        cos, sin = libdevice.cos(freqs), libdevice.sin(freqs)
    else:
        cos, sin = tl.cos(freqs), tl.sin(freqs)
    cos = (cos * scaling).to(Cos.dtype.element_ty)
    sin = (sin * scaling).to(Sin.dtype.element_ty)
    mask = row_ok[:, None] & col_ok[None, :]
    for half in tl.static_range(2):
        tl.store(Cos + rows64[:, None] * stride_cos + half * HALF + offs[None, :], cos, mask=mask)
        tl.store(Sin + rows64[:, None] * stride_sin + half * HALF + offs[None, :], sin, mask=mask)


@triton.jit
def rotary_pairs_kernel(
    Q,
    K,
    Freqs,
    QOut,
    KOut,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_f,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    NUM_Q_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Llama 4's rotation of consecutive pairs ``(x[2i], x[2i + 1])`` by ``Freqs[t, i] = (cos, sin)``
    (a complex table as float32 pairs) of one head of one token, in float32 and rounded to the dtype as
    transformers' complex product rounds it; with ``NORM`` then the head's RMS norm without a weight
    (``l2_norm``: float32, ``eps``), rounded again. Program ``(t, h)``: query head ``h`` below
    ``NUM_Q_HEADS``, key head ``h - NUM_Q_HEADS`` above."""
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < NUM_Q_HEADS:
        src = Q + t * stride_qt + h * stride_qh
        dst = QOut + t * stride_qot + h * stride_qoh
    else:
        src = K + t * stride_kt + (h - NUM_Q_HEADS) * stride_kh
        dst = KOut + t * stride_kot + (h - NUM_Q_HEADS) * stride_koh
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    dtype = QOut.dtype.element_ty
    x0 = tl.load(src + 2 * i, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(src + 2 * i + 1, mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(Freqs + t * stride_f + 2 * i, mask=ok, other=0.0)
    sin = tl.load(Freqs + t * stride_f + 2 * i + 1, mask=ok, other=0.0)
    r0 = _rounded(x0 * cos - x1 * sin, dtype)
    r1 = _rounded(x0 * sin + x1 * cos, dtype)
    if NORM:
        inv_rms = 1.0 / tl.sqrt(tl.sum(r0 * r0 + r1 * r1, axis=0) / (2 * HALF) + eps)
        r0 = r0 * inv_rms
        r1 = r1 * inv_rms
    tl.store(dst + 2 * i, r0.to(dtype), mask=ok)
    tl.store(dst + 2 * i + 1, r1.to(dtype), mask=ok)


@triton.jit
def latent_rotary_write_kernel(
    QPe,
    CKv,
    KPe,
    Cos,
    Sin,
    Slots,
    QOut,
    Latent,
    NormWeight,
    eps,
    stride_qt,
    stride_qh,
    stride_ct,
    stride_kt,
    stride_cos,
    stride_sin,
    stride_ot,
    stride_oh,
    stride_row,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    NORM: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Multi-head latent attention's decoupled rope with its latent cache write, one token a program
    row: program ``(t, h)`` rotates query head ``h`` of ``QPe [T, H, Dr]`` into ``QOut``; program ``(t,
    H)`` rotates the token's shared key ``KPe [T, Dr]`` and stores ``[CKv[t] | rotated key]`` in cache
    row ``Slots[t]`` of ``Latent [N * P, R + Dr]``. ``INTERLEAVE``: pairs ``(x[2i], x[2i + 1])`` by
    ``Cos, Sin [T, Dr / 2]``, written back as ``[rotated evens | rotated odds]``; else rotate-half by
    ``Cos, Sin [T, Dr]``. Rounded as ``PartialRotaryEmbedding.apply`` rounds in the dtype
    (:func:`rotate_halves`). ``NORM``: ``CKv[t]`` goes through the RMSNorm of ``NormWeight [R]`` and
    ``eps`` before it is stored, rounded as ``RMSNorm`` rounds (the normed row in the dtype, then times
    the weight: ``add_rmsnorm_kernel``'s mode 0)."""
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    dtype = QOut.dtype.element_ty
    if h < NUM_HEADS:
        src = QPe + t * stride_qt + h * stride_qh
    else:
        src = KPe + t * stride_kt
    if INTERLEAVE:
        x1 = tl.load(src + 2 * i, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + 2 * i + 1, mask=ok, other=0.0).to(tl.float32)
        cos1 = tl.load(Cos + t * stride_cos + i, mask=ok, other=0.0).to(tl.float32)
        sin1 = tl.load(Sin + t * stride_sin + i, mask=ok, other=0.0).to(tl.float32)
        cos2, sin2 = cos1, sin1
    else:
        x1 = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=ok, other=0.0).to(tl.float32)
        cos1 = tl.load(Cos + t * stride_cos + i, mask=ok, other=0.0).to(tl.float32)
        cos2 = tl.load(Cos + t * stride_cos + HALF + i, mask=ok, other=0.0).to(tl.float32)
        sin1 = tl.load(Sin + t * stride_sin + i, mask=ok, other=0.0).to(tl.float32)
        sin2 = tl.load(Sin + t * stride_sin + HALF + i, mask=ok, other=0.0).to(tl.float32)
    o1, o2 = rotate_halves(x1, x2, cos1, cos2, sin1, sin2, dtype)
    if h < NUM_HEADS:
        dst = QOut + t * stride_ot + h * stride_oh
    else:
        row = Latent + tl.load(Slots + t).to(tl.int64) * stride_row
        r = tl.arange(0, BLOCK_R)
        c = tl.load(CKv + t * stride_ct + r, mask=r < RANK, other=0.0)
        if NORM:
            f = c.to(tl.float32)
            normed = (f * (1.0 / tl.sqrt(tl.sum(f * f, axis=0) / RANK + eps))).to(dtype)
            c = (tl.load(NormWeight + r, mask=r < RANK, other=0.0).to(tl.float32) * normed.to(tl.float32)).to(dtype)
        tl.store(row + r, c, mask=r < RANK)
        dst = row + RANK
    tl.store(dst + i, o1.to(dtype), mask=ok)
    tl.store(dst + HALF + i, o2.to(dtype), mask=ok)
