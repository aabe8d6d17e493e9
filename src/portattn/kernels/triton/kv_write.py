"""New tokens' keys and values into a paged cache of their dtype in one launch, where ``index_put`` takes two.

Program ``(t, h)`` copies ``K[t, h]`` and ``V[t, h]`` to slot ``Slots[t]`` (``page * P + offset``) of the caches
``[N, P, Hkv, D]`` / ``[N, P, Hkv, Dv]`` (rows of a key; the slot and head strides given).
"""

import triton
import triton.language as tl

from .pdl import wait_for_previous


@triton.jit
def kv_write_kernel(
    K,
    V,
    Slots,
    KCache,
    VCache,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_slot,
    stride_kc_h,
    stride_vc_slot,
    stride_vc_h,
    HEAD_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=d < HEAD_DIM)
    tl.store(KCache + slot * stride_kc_slot + h * stride_kc_h + d, k.to(KCache.dtype.element_ty), mask=d < HEAD_DIM)
    dv = tl.arange(0, BLOCK_V)
    v = tl.load(V + t * stride_vt + h * stride_vh + dv, mask=dv < VALUE_DIM)
    tl.store(VCache + slot * stride_vc_slot + h * stride_vc_h + dv, v.to(VCache.dtype.element_ty), mask=dv < VALUE_DIM)
