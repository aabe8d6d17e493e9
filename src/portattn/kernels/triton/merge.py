"""Merge of split-KV partial results ("flash decoding"), with attention sinks added once here.

Split ``s`` of row ``(t, h)`` holds its normalised output ``o_s`` and base-2 log-sum-exp
``lse_s`` (-inf for a split that saw no key). The merged row is
``sum_s 2^(lse_s - M) o_s / (sum_s 2^(lse_s - M) + 2^(sink - M))`` with ``M`` the largest term;
a row with no key and no sink gives zeros. Grid: ``(T, Hq)``.
"""

import triton
import triton.language as tl


@triton.jit
def merge_splits_kernel(
    PartialOut,
    PartialLse,
    Sinks,
    Out,
    num_heads,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_dv = tl.arange(0, BLOCK_DV)
    row = (token * num_heads + head) * NUM_SPLITS
    split_ok = offs_s < NUM_SPLITS

    lse = tl.load(PartialLse + row + offs_s, mask=split_ok, other=float("-inf"))  # [SPLITS_PAD]
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp2(lse - m_safe)  # [SPLITS_PAD]
    denom = tl.sum(weight, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_safe)

    dv_ok = offs_dv < VALUE_DIM  # columns past the value dim are never written by the splits
    partial = tl.load(
        PartialOut + (row + offs_s)[:, None] * BLOCK_DV + offs_dv[None, :],
        mask=split_ok[:, None] & dv_ok[None, :],
        other=0.0,
    )  # [SPLITS_PAD, BLOCK_DV]
    out = tl.sum(partial * weight[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(Out + token * stride_ot + head * stride_oh + offs_dv, out.to(Out.dtype.element_ty), mask=dv_ok)
