"""Merging attention states: split-KV partials ("flash decoding"), and the public two-part merge.

Split ``s`` of row ``(t, h)`` holds its normalised output ``o_s`` and base-2 log-sum-exp
``lse_s`` (-inf for a split that saw no key). The merged row is
``sum_s 2^(lse_s - M) o_s / (sum_s 2^(lse_s - M) + 2^(sink - M))`` with ``M`` the largest term;
a row with no key and no sink gives zeros. Sinks are added once, here. With ``HAS_LSE`` the
row's natural-log LSE ``(M + log2(denominator)) * ln 2`` is written too.

``merge_states_kernel`` merges two states given with natural-log LSEs (the public
``merge_attention_states``) the same way; a part whose LSE is -inf has no weight, whatever its
output holds. Grids: ``(T, H)``.
"""

import triton
import triton.language as tl

from .pdl import wait_for_previous


@triton.jit(do_not_specialize=["num_splits"])  # one variant for every split count
def merge_splits_kernel(
    PartialOut,
    PartialLse,
    Sinks,
    Out,
    Lse,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    SPLITS_PAD: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_LSE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_dv = tl.arange(0, BLOCK_DV)
    row = (token * num_heads + head) * num_splits
    split_ok = offs_s < num_splits

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
    if HAS_LSE:
        row_lse = tl.where(
            denom == 0.0, float("-inf"), (m_safe + tl.log2(tl.where(denom == 0.0, 1.0, denom))) * 0.6931471805599453
        )
        tl.store(Lse + token * stride_lt + head * stride_lh, row_lse)


@triton.jit
def merge_states_kernel(
    OutA,
    LseA,
    OutB,
    LseB,
    Out,
    OutLse,
    stride_at,
    stride_ah,
    stride_lat,
    stride_lah,
    stride_bt,
    stride_bh,
    stride_lbt,
    stride_lbh,
    stride_ot,
    stride_oh,
    stride_lot,
    stride_loh,
    VALUE_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_DV)
    ok = offs < VALUE_DIM
    lse_a = tl.load(LseA + token * stride_lat + head * stride_lah).to(tl.float32) * 1.4426950408889634
    lse_b = tl.load(LseB + token * stride_lbt + head * stride_lbh).to(tl.float32) * 1.4426950408889634
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp2(lse_a - m_safe)
    w_b = tl.exp2(lse_b - m_safe)
    denom = w_a + w_b
    a = tl.load(OutA + token * stride_at + head * stride_ah + offs, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(OutB + token * stride_bt + head * stride_bh + offs, mask=ok, other=0.0).to(tl.float32)
    total = tl.where(w_a > 0.0, a * w_a, 0.0) + tl.where(w_b > 0.0, b * w_b, 0.0)
    out = total / tl.where(denom == 0.0, 1.0, denom)
    tl.store(Out + token * stride_ot + head * stride_oh + offs, out.to(Out.dtype.element_ty), mask=ok)
    lse = tl.where(
        denom == 0.0, float("-inf"), (m_safe + tl.log2(tl.where(denom == 0.0, 1.0, denom))) * 0.6931471805599453
    )
    tl.store(OutLse + token * stride_lot + head * stride_loh, lse)
