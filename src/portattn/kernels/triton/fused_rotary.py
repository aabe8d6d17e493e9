"""Rotary embedding of q and k (rotate-half, the whole head) with the K/V cache write, in one launch.

Program ``(t, h)``: ``h < Hq`` rotates query head ``h`` of token ``t`` into ``QOut``; the next ``Hkv``
programs rotate the key heads and store them in the token's cache slot; the last ``Hkv`` copy the
value heads there. The rotation rounds as transformers' ``q * cos + rotate_half(q) * sin`` does in
the model dtype: each product, then the sum. Grid: ``(T, Hq + 2 * Hkv)``.
"""

import triton
import triton.language as tl

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


@triton.jit
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
    PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    DTYPE: tl.constexpr = Q.dtype.element_ty
    if h >= NUM_Q_HEADS + NUM_KV_HEADS:  # a value head: copied to the cache
        head = h - NUM_Q_HEADS - NUM_KV_HEADS
        slot = tl.load(Slots + t).to(tl.int64)
        offs_v = tl.arange(0, BLOCK_V)
        v = tl.load(V + t * stride_vt + head * stride_vh + offs_v, mask=offs_v < VALUE_DIM)
        tl.store(VCache + slot * stride_vs + head * stride_vch + offs_v, v, mask=offs_v < VALUE_DIM)
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    cos1 = tl.load(Cos + t * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(Cos + t * stride_cos + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(Sin + t * stride_sin + offs, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(Sin + t * stride_sin + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if h < NUM_Q_HEADS:
        src = Q + t * stride_qt + h * stride_qh
        dst = QOut + t * stride_ot + h * stride_oh
    else:
        head = h - NUM_Q_HEADS
        slot = tl.load(Slots + t).to(tl.int64)
        src = K + t * stride_kt + head * stride_kh
        dst = KCache + slot * stride_ks + head * stride_kch
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rotate_halves(x1, x2, cos1, cos2, sin1, sin2, DTYPE)
    tl.store(dst + offs, o1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + offs, o2.to(dst.dtype.element_ty), mask=mask)
