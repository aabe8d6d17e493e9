"""Triton kernels of MLA decode: split-KV attention over the paged latent cache, then a merge.

One program of ``mla_decode_split_kernel`` covers a block of query heads of one sequence over one
contiguous range (split) of its keys. All heads share the single latent head, so each latent row
``[c_kv | k_pe]`` is loaded once per program and used twice: in the scores (against
``[q_nope | q_rope]``) and, as ``c_kv``, in the value product. Head blocks of one split are
adjacent in the grid so that, when a problem needs several, they run together and share the rows
through the L2 cache.

Split ``s`` of a sequence of ``L`` keys covers keys ``[s·len, min((s+1)·len, L))`` with
``len = max(ceil(ceil(L / S) / SPLIT_ALIGN), ceil(MIN_SPLIT / SPLIT_ALIGN)) · SPLIT_ALIGN``: short
sequences leave trailing splits empty. With the floor ``MIN_SPLIT`` (the plan's
``min_split_keys``: ``mla_workspace.MIN_SPLIT_TOKENS`` when the split count was chosen from the problem),
a sequence is cut alike under any split count from ``ceil(L / MIN_SPLIT)`` up: an engine's captured
graph, planned for its longest context, and an eager step, planned for the batch's, cut it the same. A split writes its normalised output and base-2 log-sum-exp to the workspace (or, with a
single split, the output itself); ``mla_decode_merge_kernel`` combines a sequence's non-empty
splits. With ``WRITE_LSE`` the natural-log LSE of each (sequence, head) is written too, by the
split kernel when there is one split and by the merge otherwise. Launchers are in
``mla_decode_launch.py``.

An fp8 latent cache is converted as it is loaded: to the query's dtype, or with ``F16_DOTS``
(bfloat16 queries) to float16, the one-instruction conversion, the queries then scaled by
``q_scale`` and converted too. The cache's scale is folded into ``qk_scale_log2`` by the launcher
and multiplies each split's output (``kv_scale``, 1.0 otherwise).

``SEPARATE_VALUES`` (off by default, for the probes) loads the latent rows a second time for the value
product. Used by both products, an fp8 tile is taken in two register layouts, and Triton 3.6 then
loads it without its software pipeline (compiled for sm_90: 3 asynchronous copies in the loop against
54 for a bfloat16 cache); loaded twice, each load feeds one product and both are pipelined (75
asynchronous copies), at the price of a second read (from L2) and more shared memory.

``DEQUANTIZE_ONCE`` (off, for the probes) converts an fp8 tile where it is loaded and keeps it in 16 bits
for both products: compiled for sm_90 the byte-wise shared loads of the value product are gone (72
conversions a thread and tile, each value converted once), but the 16-bit copy of the tile needs
120 KB of shared memory at 32-key tiles in 3 stages, and on an H200 (16 heads, B=64 over 4096 keys) it
ran 1.5-2.3x slower than the default (benchmarks/results/round20_h200/NOTES.md).
"""

import triton
import triton.language as tl

from .pdl import wait_for_previous


@triton.jit
def _split_range(num_keys, split, num_kv_splits, SPLIT_ALIGN: tl.constexpr, MIN_SPLIT: tl.constexpr):
    per_split = tl.cdiv(tl.cdiv(num_keys, num_kv_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    # at least MIN_SPLIT keys (and one step: an empty sequence still gets a step > 0)
    per_split = tl.maximum(per_split, tl.cdiv(tl.maximum(MIN_SPLIT, 1), SPLIT_ALIGN) * SPLIT_ALIGN)
    start = split * per_split
    end = tl.minimum(start + per_split, num_keys)
    return start, end, per_split


@triton.jit
def mla_decode_split_kernel(
    QNope,
    QRope,
    KV,
    PageTable,
    SeqLensK,
    Out,
    Lse,
    PartOut,
    PartLse,
    q_scale,
    qk_scale_log2,
    kv_scale,
    num_heads,
    num_kv_splits,
    stride_qn_b,
    stride_qn_h,
    stride_qn_d,
    stride_qr_b,
    stride_qr_h,
    stride_qr_d,
    stride_kv_page,
    stride_kv_slot,
    stride_kv_d,
    stride_pt_b,
    stride_pt_p,
    stride_o_b,
    stride_o_h,
    stride_o_d,
    stride_lse_b,
    stride_lse_h,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_RP: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    F16_DOTS: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    SEPARATE_VALUES: tl.constexpr = False,
    DEQUANTIZE_ONCE: tl.constexpr = False,
):
    tl.static_assert(BLOCK_H >= 16 and BLOCK_N >= 16 and BLOCK_R >= 16 and BLOCK_RP >= 16, "tl.dot tiles are >= 16")
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)

    num_keys = tl.load(SeqLensK + seq)
    start, end, _ = _split_range(num_keys, split, num_kv_splits, BLOCK_N, MIN_SPLIT)

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_rp = tl.arange(0, BLOCK_RP)
    head_ok = offs_h < num_heads
    r_ok = offs_r < KV_LORA_RANK
    rp_ok = offs_rp < ROPE_DIM

    q_nope = tl.load(
        QNope + seq * stride_qn_b + offs_h[:, None] * stride_qn_h + offs_r[None, :] * stride_qn_d,
        mask=head_ok[:, None] & r_ok[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_R]
    q_rope = tl.load(
        QRope + seq * stride_qr_b + offs_h[:, None] * stride_qr_h + offs_rp[None, :] * stride_qr_d,
        mask=head_ok[:, None] & rp_ok[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_RP]
    if F16_DOTS:
        q_nope = (q_nope.to(tl.float32) * q_scale).to(tl.float16)
        q_rope = (q_rope.to(tl.float32) * q_scale).to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    page_row = PageTable + seq * stride_pt_b
    # Page ids are read one block ahead: a latent load whose address comes from a load in the same
    # iteration is not software-pipelined, one whose address is carried from the last iteration is.
    offs_first = start + tl.arange(0, BLOCK_N)
    next_page = tl.load(page_row + (offs_first // PAGE_SIZE) * stride_pt_p, mask=offs_first < end, other=0)
    for block_start in tl.range(start, end, BLOCK_N):
        offs_n = block_start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        page = next_page.to(tl.int64)
        offs_next = offs_n + BLOCK_N
        next_page = tl.load(page_row + (offs_next // PAGE_SIZE) * stride_pt_p, mask=offs_next < end, other=0)
        rows = KV + page * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_slot  # [BLOCK_N] row starts
        c_kv = tl.load(
            rows[:, None] + offs_r[None, :] * stride_kv_d, mask=n_ok[:, None] & r_ok[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_R]
        if DEQUANTIZE_ONCE:  # converted where loaded, then kept in 16 bits for both products (see above)
            c_kv = tl.where(n_ok[:, None], c_kv.to(q_nope.dtype), 0.0)
        k_pe = tl.load(
            rows[:, None] + (KV_LORA_RANK + offs_rp[None, :]) * stride_kv_d,
            mask=n_ok[:, None] & rp_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_RP]
        c_kv = c_kv.to(q_nope.dtype)  # an fp8 cache is dequantised here (no-op otherwise)
        k_pe = k_pe.to(q_nope.dtype)
        c_kv_v = c_kv  # the value product's rows
        if SEPARATE_VALUES:  # the same rows again (their last read: evict first)
            c_kv_v = tl.load(
                rows[:, None] + offs_r[None, :] * stride_kv_d,
                mask=n_ok[:, None] & r_ok[None, :],
                other=0.0,
                eviction_policy="evict_first",
            ).to(q_nope.dtype)

        scores = tl.dot(q_nope, tl.trans(c_kv), input_precision=DOT_PRECISION)
        scores = tl.dot(q_rope, tl.trans(k_pe), acc=scores, input_precision=DOT_PRECISION)
        scores = tl.where(n_ok[None, :], scores * qk_scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N]

        m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: every block holds a key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(c_kv.dtype), c_kv_v, acc=acc, input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_R]
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc * kv_scale / tl.where(has_keys, l_i, 1.0)[:, None]  # an empty range gives zeros
    if WRITE_PARTIAL:
        if start < end:  # empty splits (past the end of a short sequence) write nothing; the merge skips them
            row = (seq * num_heads + offs_h) * num_kv_splits + split  # [BLOCK_H] rows of [B, H, S]
            tl.store(
                PartOut + row[:, None] * KV_LORA_RANK + offs_r[None, :], out, mask=head_ok[:, None] & r_ok[None, :]
            )
            tl.store(PartLse + row, m_i + tl.log2(l_i), mask=head_ok)
    else:
        tl.store(
            Out + seq * stride_o_b + offs_h[:, None] * stride_o_h + offs_r[None, :] * stride_o_d,
            out.to(Out.dtype.element_ty),
            mask=head_ok[:, None] & r_ok[None, :],
        )
        if WRITE_LSE:  # natural log; -inf for a sequence without keys
            lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
            tl.store(Lse + seq * stride_lse_b + offs_h * stride_lse_h, lse, mask=head_ok)


@triton.jit
def mla_decode_merge_kernel(
    PartOut,
    PartLse,
    SeqLensK,
    Out,
    Lse,
    num_heads,
    num_kv_splits,
    stride_o_b,
    stride_o_h,
    stride_o_d,
    stride_lse_b,
    stride_lse_h,
    KV_LORA_RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)  # the splits' partials written and visible
    head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    num_keys = tl.load(SeqLensK + seq)
    _, _, per_split = _split_range(num_keys, 0, num_kv_splits, SPLIT_ALIGN, MIN_SPLIT)
    num_active = tl.cdiv(num_keys, per_split)  # splits that saw keys; the others wrote nothing

    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < KV_LORA_RANK
    row0 = (seq * num_heads + head) * num_kv_splits
    m = float("-inf")
    denom = 0.0
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for split in range(0, num_active):
        lse = tl.load(PartLse + row0 + split)
        part = tl.load(PartOut + (row0 + split) * KV_LORA_RANK + offs_r, mask=r_ok, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        denom = denom * alpha + weight
        acc = acc * alpha + weight * part
        m = m_new
    out = acc / tl.where(denom > 0.0, denom, 1.0)
    tl.store(Out + seq * stride_o_b + head * stride_o_h + offs_r * stride_o_d, out.to(Out.dtype.element_ty), mask=r_ok)
    if WRITE_LSE:
        lse = tl.where(
            denom > 0.0, (m + tl.log2(tl.where(denom > 0.0, denom, 1.0))) * 0.6931471805599453, float("-inf")
        )
        tl.store(Lse + seq * stride_lse_b + head * stride_lse_h, lse)
