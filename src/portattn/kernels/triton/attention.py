"""One forward-attention kernel for paged and contiguous KV: decode, extend, prefill, varlen.

A program owns ``BLOCK_Q`` query tokens of one sequence times the ``GROUP`` query heads that share
one KV head (GQA packing: ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows, row ``r`` is token
``r // GROUP_PAD`` and head ``r % GROUP_PAD``), so every K/V tile it loads serves the whole group.
It walks the keys the block can see in tiles of ``BLOCK_N``, with an online softmax in the base-2
domain. Each query position ``p`` sees the inclusive key range ``[lo(p), hi(p)]`` of ``masks.py``;
the program visits only tiles that intersect ``[lo(first row), hi(last row)]`` and applies the
element mask only to tiles that are not entirely visible to every row.

Keys are addressed by logical index ``j``: paged (``PAGED``) through
``page_table[b, j // PAGE_SIZE]`` and offset ``j % PAGE_SIZE``, which works for every page size;
contiguous (varlen) at ``kv_start[b] + j``. A head dim that is not a power of two is covered by up
to three column tiles of decreasing powers of two, each at least 16 wide (80 = 64 + 16, 224 = 128 +
64 + 32, 72 = 64 + 16 with 8 masked columns), instead of one tile padded to the next power of two:
the dot products then do little or no work on padding columns. The same holds for the value dim.
Grid: ``(q blocks, KV heads, splits)``, the q blocks taken last first (a causal sequence's last block
sees the most keys: it starts first, not last). With ``SPLIT`` (more than one split) each program
covers one share of the block's visible tiles and writes its normalised partial output and base-2
log-sum-exp; ``merge.py`` combines them (and adds sinks). The split count is the grid's, not a
compile-time constant: one compiled kernel serves every count (a captured decode step of each batch
size may choose another).
With ``HAS_LSE`` the natural-log LSE of each row is written too (by the merge when split).
ALiBi (``HAS_ALIBI``) adds ``-slope * |p - j|`` to the scaled, softcapped scores.

K/V in an fp8 cache are converted as they are loaded (exact: every fp8 value is a float16 and a
bfloat16), to the query's dtype, or with ``F16_DOTS`` (bfloat16 queries) to float16, the queries
then scaled by ``q_scale`` and converted too; the launcher folds the cache's K scale into
``qk_scale``, and ``v_scale`` multiplies the normalised output (1.0 for caches in the query's dtype).
Float32 inputs take the dots in ``DOT_PRECISION`` ("ieee" unless TF32 was asked for).
``ROW_ALIGN``: every row stride is a multiple of it, and arrives divided by it (see the kernel).
``PAGES_AHEAD`` (paged K/V; the default tiles of decodes over an fp8 cache): each key tile's page ids are loaded one
tile ahead, in the previous iteration. Loaded in the same iteration, they cost Triton's software
pipeliner two stages per K/V buffer (``floor((num_stages - 1) / 2)`` tiles in flight); loaded ahead,
one (``num_stages - 1``; ``scripts/pipeline_depth.py --pages-ahead``).
``WHOLE_PAGES`` (paged K/V whose key tiles hold whole pages, one K/V column tile; the default tiles
of long query runs): a tile's ``BLOCK_N // PAGE_SIZE`` page ids are loaded, not one a key, and K/V are
addressed as ``[pages, page rows, columns]``, so the 64-bit address arithmetic is one multiply a page
and the row offsets within a page are the same every tile. Compiled for sm_90 (Triton 3.6), a causal
prefill's unmasked key loop (128 x 128 tiles, 8 warps) takes 533 instructions a warp and tile instead
of 752 (the kernel over contiguous K/V: 560), and on an H200 it ran 1.18 ms against 1.39. For decode
tiles the addressing changes how Triton stages V (not used there).
``V_KEYS`` (paged V whose keys are contiguous within a page: stored ``[pages, Hkv, Dv, P]``, the logical
``[pages, P, Hkv, Dv]`` with strides ``(Hkv*Dv*P, 1, Dv*P, P)``; ``runtime/kv_cache.py`` allocates fp8 V
caches so): V's columns are ``stride_vd`` apart, and its strides arrive undivided by ``ROW_ALIGN``.
For one-byte V the second product's operand then holds four consecutive keys a 32-bit register, read
from shared memory with ``ldmatrix`` instead of a byte at a time (``scripts/fp8_v_layout_probe.py``).
``MERGE_IN_KERNEL`` (split launches; off by default, for the probes): the last split program of each
(query block, KV head) to finish merges the block's splits itself (``MergeCounters``: one int32 ticket
counter per such pair, zero between launches), so no merge kernel follows.
"""

import triton
import triton.language as tl

from .pdl import wait_for_previous

# log2(e) is written out in the kernels: base-2 exponentials are the fast ones on every GPU.


@triton.jit
def _find_sequence(CuSeqlensQ, block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence owning global q block ``block_idx``; sequence b's blocks start at cu[b] // BLOCK_Q + b."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(CuSeqlensQ + mid) // BLOCK_Q + mid
        if first_block <= block_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _key_bounds(
    pos,
    num_keys,
    window_left,
    window_right,
    chunk_size,
    CAUSAL: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
):
    """Inclusive key range [lo, hi] seen by position ``pos`` (scalar or vector), clipped to [0, L-1]."""
    lo = pos * 0
    if HAS_WINDOW_LEFT:
        lo = tl.maximum(lo, pos - window_left)
    if CAUSAL:
        hi = pos
    elif HAS_WINDOW_RIGHT:
        hi = pos + window_right
    else:
        hi = pos * 0 + num_keys - 1
    if HAS_CHUNK:
        chunk_start = (pos // chunk_size) * chunk_size
        lo = tl.maximum(lo, chunk_start)
        hi = tl.minimum(hi, chunk_start + chunk_size - 1)
    hi = tl.minimum(hi, num_keys - 1)
    return lo, hi


@triton.jit
def _key_slots(offs_n, num_keys, PageTableRow, kv_start, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr):
    """(page, offset within page) of logical keys ``offs_n``, and which of them exist."""
    in_range = offs_n < num_keys
    if PAGED:
        page = tl.load(PageTableRow + offs_n // PAGE_SIZE, mask=in_range, other=0).to(tl.int64)
        offset = offs_n % PAGE_SIZE
    else:
        page = tl.zeros_like(offs_n).to(tl.int64)
        offset = kv_start + offs_n
    return page, offset.to(tl.int64), in_range


@triton.jit
def _load_columns(rows, row_ok, START: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr):
    """Columns ``[START, START + BLOCK)`` of the rows at pointers ``rows`` (column 0), zero past ``DIM``."""
    offs = START + tl.arange(0, BLOCK)
    return tl.load(rows[:, None] + offs[None, :], mask=row_ok[:, None] & (offs < DIM)[None, :], other=0.0)


@triton.jit
def _store_columns(rows, row_ok, values, START: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr):
    offs = START + tl.arange(0, BLOCK)
    tl.store(rows[:, None] + offs[None, :], values, mask=row_ok[:, None] & (offs < DIM)[None, :])


@triton.jit
def _attend_tiles(
    acc,
    acc2,
    acc3,
    l_i,
    m_i,
    q,
    q2,
    q3,
    K,
    V,
    PageTableRow,
    kv_start,
    num_keys,
    tile_base,
    tile_begin,
    tile_end,
    row_lo,
    row_hi,
    row_pos,
    row_slope,
    qk_scale,
    softcap,
    stride_kp,
    stride_ks,
    stride_vp,
    stride_vs,
    stride_vd,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_D3: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DV2: tl.constexpr,
    BLOCK_DV3: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PAGES_AHEAD: tl.constexpr,
    WHOLE_PAGES: tl.constexpr,
    V_KEYS: tl.constexpr,
):
    """Online softmax over key tiles ``tile_begin .. tile_end - 1`` (tile i starts at tile_base + i * BLOCK_N).

    Columns ``[0, BLOCK_D)`` of q/K are in ``q``, the next ``BLOCK_D2`` in ``q2`` and the next
    ``BLOCK_D3`` in ``q3`` (a zero width: no such tile); likewise ``acc``, ``acc2``, ``acc3`` for
    the value columns. ``row_pos`` / ``row_slope`` (slope * log2(e)) are read only with ALiBi.
    V's columns are ``stride_vd`` apart with ``V_KEYS`` (a page's keys contiguous), else adjacent.
    """
    # Loads are written out here rather than through _load_columns: under the CPU interpreter
    # every call in this loop costs as much as the arithmetic.
    offs_tile = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    if V_KEYS:  # V's element (key j, column c) at j * stride_vs + c * stride_vd
        v_cols = offs_dv.to(tl.int64) * stride_vd
    else:
        v_cols = offs_dv
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
    if BLOCK_D3 > 0:
        offs_d3 = BLOCK_D + BLOCK_D2 + tl.arange(0, BLOCK_D3)
    if BLOCK_DV2 > 0:
        offs_dv2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
    if BLOCK_DV3 > 0:
        offs_dv3 = BLOCK_DV + BLOCK_DV2 + tl.arange(0, BLOCK_DV3)
    if WHOLE_PAGES:  # see the module doc
        PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE
        offs_pages = tl.arange(0, PAGES)
        offs_in_page = tl.arange(0, PAGE_SIZE)
        k_in_page = (offs_in_page * stride_ks).to(tl.int64)[None, :, None] + offs_d[None, None, :]
        v_in_page = (offs_in_page * stride_vs).to(tl.int64)[None, :, None] + v_cols[None, None, :]
        if PAGES_AHEAD:  # the first tile's page ids; each iteration loads the next tile's
            ahead = (tile_base + tile_begin * BLOCK_N) // PAGE_SIZE + offs_pages
            next_pages = tl.load(PageTableRow + ahead, mask=ahead * PAGE_SIZE < num_keys, other=0)
    elif PAGES_AHEAD:  # the first tile's page ids; each iteration loads the next tile's
        offs_ahead = tile_base + tile_begin * BLOCK_N + offs_tile
        next_page = tl.load(PageTableRow + offs_ahead // PAGE_SIZE, mask=offs_ahead < num_keys, other=0)
    for tile in range(tile_begin, tile_end):
        offs_n = tile_base + tile * BLOCK_N + offs_tile
        if WHOLE_PAGES:
            tile_pages = (tile_base + tile * BLOCK_N) // PAGE_SIZE + offs_pages
            if PAGES_AHEAD:
                pages = next_pages.to(tl.int64)
                ahead = tile_pages + PAGES
                next_pages = tl.load(PageTableRow + ahead, mask=ahead * PAGE_SIZE < num_keys, other=0)
            else:
                pages = tl.load(PageTableRow + tile_pages, mask=tile_pages * PAGE_SIZE < num_keys, other=0)
                pages = pages.to(tl.int64)
            k_pages = (K + pages * stride_kp)[:, None, None] + k_in_page  # [pages, page rows, columns]
            v_pages = (V + pages * stride_vp)[:, None, None] + v_in_page
            if MASKED:
                page_ok = (tile_pages[:, None] * PAGE_SIZE + offs_in_page[None, :] < num_keys)[:, :, None]
                k = tl.load(k_pages, mask=page_ok, other=0.0)
                v = tl.load(v_pages, mask=page_ok, other=0.0)
            else:
                k = tl.load(k_pages)
                v = tl.load(v_pages)
            k = tl.reshape(k, (BLOCK_N, BLOCK_D))
            v = tl.reshape(v, (BLOCK_N, BLOCK_DV))
            in_range = offs_n < num_keys
            row_ok = in_range if MASKED else offs_tile < BLOCK_N  # unmasked tiles: every key exists
        else:
            if PAGES_AHEAD:
                page = next_page.to(tl.int64)
                offset = (offs_n % PAGE_SIZE).to(tl.int64)
                in_range = offs_n < num_keys
                offs_ahead = offs_n + BLOCK_N
                next_page = tl.load(PageTableRow + offs_ahead // PAGE_SIZE, mask=offs_ahead < num_keys, other=0)
            else:
                page, offset, in_range = _key_slots(
                    offs_n, num_keys, PageTableRow, kv_start, PAGE_SIZE=PAGE_SIZE, PAGED=PAGED
                )
            k_rows = K + page * stride_kp + offset * stride_ks  # [BLOCK_N] pointers to the first column
            v_rows = V + page * stride_vp + offset * stride_vs
            row_ok = in_range if MASKED else offs_tile < BLOCK_N  # unmasked tiles: every key exists
            k_ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
            k = tl.load(k_rows[:, None] + offs_d[None, :], mask=k_ok, other=0.0)
            v_ok = row_ok[:, None] & (offs_dv < VALUE_DIM)[None, :]
            v = tl.load(v_rows[:, None] + v_cols[None, :], mask=v_ok, other=0.0)
        k = k.to(q.dtype)  # fp8 caches are dequantised here (no-op otherwise)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if BLOCK_D2 > 0:
            k2_ok = row_ok[:, None] & (offs_d2 < HEAD_DIM)[None, :]
            k2 = tl.load(k_rows[:, None] + offs_d2[None, :], mask=k2_ok, other=0.0).to(q.dtype)
            s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
        if BLOCK_D3 > 0:
            k3_ok = row_ok[:, None] & (offs_d3 < HEAD_DIM)[None, :]
            k3 = tl.load(k_rows[:, None] + offs_d3[None, :], mask=k3_ok, other=0.0).to(q.dtype)
            s = tl.dot(q3, tl.trans(k3), s, input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:
            # c * tanh(x / c), with tanh written through exp2 so that every Triton backend has it
            x = s * (qk_scale / softcap)
            e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0, -t, t) * (softcap * 1.4426950408889634)
            scale = 1.0
        else:
            # the scale (positive) is applied in the exponent's fused multiply-add, not as its own pass
            scale = qk_scale * 1.4426950408889634
        if HAS_ALIBI:
            if not HAS_SOFTCAP:
                s = s * scale
            distance = tl.abs(row_pos[:, None] - offs_n[None, :]).to(tl.float32)
            s = s - row_slope[:, None] * distance
            scale = 1.0
        if MASKED:
            visible = (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] <= row_hi[:, None]) & in_range[None, :]
            s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s * scale - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        if BLOCK_DV2 > 0:
            v2_ok = row_ok[:, None] & (offs_dv2 < VALUE_DIM)[None, :]
            v2_cols = offs_dv2.to(tl.int64) * stride_vd if V_KEYS else offs_dv2
            v2 = tl.load(v_rows[:, None] + v2_cols[None, :], mask=v2_ok, other=0.0).to(q.dtype)
            acc2 = tl.dot(p, v2, acc2 * alpha[:, None], input_precision=DOT_PRECISION)
        if BLOCK_DV3 > 0:
            v3_ok = row_ok[:, None] & (offs_dv3 < VALUE_DIM)[None, :]
            v3_cols = offs_dv3.to(tl.int64) * stride_vd if V_KEYS else offs_dv3
            v3 = tl.load(v_rows[:, None] + v3_cols[None, :], mask=v3_ok, other=0.0).to(q.dtype)
            acc3 = tl.dot(p, v3, acc3 * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, acc2, acc3, l_i, m_i


@triton.jit
def _merge_splits_of_rows(
    PartialOut,
    PartialLse,
    Sinks,
    Out,
    Lse,
    part_rows,
    stride_ws,
    num_splits,
    out_rows,
    lse_rows,
    head,
    row_ok,
    BLOCK_M: tl.constexpr,
    PARTIAL_DV: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    """``merge.merge_splits_kernel``'s arithmetic for the ``BLOCK_M`` rows of one program (their splits
    at ``part_rows + s * stride_ws``), read through L2 (``.cg``): other programs wrote them."""
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for s in range(num_splits):
        lse_s = tl.load(PartialLse + part_rows + s * stride_ws, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        m = tl.maximum(m, lse_s)
    if HAS_SINKS:
        sink = tl.load(Sinks + head, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    offs_dv = tl.arange(0, PARTIAL_DV)
    dv_ok = row_ok[:, None] & (offs_dv < VALUE_DIM)[None, :]
    denom = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, PARTIAL_DV), tl.float32)
    for s in range(num_splits):
        row = part_rows + s * stride_ws
        weight = tl.exp2(tl.load(PartialLse + row, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - m_safe)
        part = tl.load(
            PartialOut + row[:, None] * PARTIAL_DV + offs_dv[None, :], mask=dv_ok, other=0.0, cache_modifier=".cg"
        )
        acc += part * weight[:, None]
        denom += weight
    if HAS_SINKS:
        denom += tl.exp2(sink - m_safe)
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(Out + out_rows[:, None] + offs_dv[None, :], out.to(Out.dtype.element_ty), mask=dv_ok)
    if HAS_LSE:
        lse = tl.where(
            denom == 0.0, float("-inf"), (m_safe + tl.log2(tl.where(denom == 0.0, 1.0, denom))) * 0.6931471805599453
        )
        tl.store(Lse + lse_rows, lse, mask=row_ok)


# num_seqs changes every step, and so does an eager step's split count (stride_wt, stride_wh: the partial
# LSEs' strides): one compiled variant for every value (not one for 1, multiples of 16 and the rest). A
# served engine compiled a variant after its warm-up for a split count 16 did not divide
# (benchmarks/results/engine_h200/round23/NOTES.md); the page table's width is kept a multiple of 16
# pages instead (backends.base.TABLE_PAGES), so that its row stride stays specialized.
@triton.jit(do_not_specialize=["num_seqs", "stride_wt", "stride_wh"])
def attention_fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    PartialOut,
    PartialLse,
    PageTable,
    CuSeqlensQ,
    SeqLensK,
    KvStart,
    Sinks,
    AlibiSlopes,
    MergeCounters,
    num_seqs,
    q_scale,
    qk_scale,
    v_scale,
    softcap,
    window_left,
    window_right,
    chunk_size,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    stride_pt,
    stride_wt,
    stride_wh,
    stride_ws,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_D3: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DV2: tl.constexpr,
    BLOCK_DV3: tl.constexpr,
    PARTIAL_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_LSE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    F16_DOTS: tl.constexpr,
    PAGES_AHEAD: tl.constexpr,
    MERGE_IN_KERNEL: tl.constexpr,
    PDL: tl.constexpr = False,
    WHOLE_PAGES: tl.constexpr = False,
    V_KEYS: tl.constexpr = False,
):
    tl.static_assert(BLOCK_M == BLOCK_Q * GROUP_PAD)
    wait_for_previous(PDL)
    if ROW_ALIGN > 1:
        # The row strides arrive divided by ROW_ALIGN: multiplied back here, the compiler knows that
        # every row starts at a multiple of ROW_ALIGN elements, and moves rows in 16-byte vectors
        # through the asynchronous-copy pipeline even where a stride is not a multiple of 16.
        stride_qt = stride_qt * ROW_ALIGN
        stride_qh = stride_qh * ROW_ALIGN
        stride_kp = stride_kp * ROW_ALIGN
        stride_ks = stride_ks * ROW_ALIGN
        stride_kh = stride_kh * ROW_ALIGN
        if not V_KEYS:  # V's strides arrive undivided with its keys contiguous
            stride_vp = stride_vp * ROW_ALIGN
            stride_vs = stride_vs * ROW_ALIGN
            stride_vh = stride_vh * ROW_ALIGN
        stride_ot = stride_ot * ROW_ALIGN
        stride_oh = stride_oh * ROW_ALIGN
    block_idx = tl.num_programs(0) - 1 - tl.program_id(0)  # last blocks first
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(CuSeqlensQ, block_idx, num_seqs, BLOCK_Q=BLOCK_Q)
    q_begin = tl.load(CuSeqlensQ + seq)
    num_queries = tl.load(CuSeqlensQ + seq + 1) - q_begin
    q_start = (block_idx - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_start >= num_queries:
        return
    num_keys = tl.load(SeqLensK + seq)
    kv_start = 0
    if not PAGED:
        kv_start = tl.load(KvStart + seq)
    PageTableRow = PageTable + seq.to(tl.int64) * stride_pt

    offs_m = tl.arange(0, BLOCK_M)
    token = q_start + offs_m // GROUP_PAD  # within the sequence
    head_in_group = offs_m % GROUP_PAD
    row_ok = (token < num_queries) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    q_row = (q_begin + token).to(tl.int64)

    q_rows = Q + q_row * stride_qt + head * stride_qh  # [BLOCK_M] pointers to the first column
    q = _load_columns(q_rows, row_ok, 0, BLOCK_D, HEAD_DIM)
    q2 = q  # no second column tile: unused
    q3 = q
    if BLOCK_D2 > 0:
        q2 = _load_columns(q_rows, row_ok, BLOCK_D, BLOCK_D2, HEAD_DIM)
    if BLOCK_D3 > 0:
        q3 = _load_columns(q_rows, row_ok, BLOCK_D + BLOCK_D2, BLOCK_D3, HEAD_DIM)
    if F16_DOTS:
        # An fp8 cache read by bfloat16 queries: the dots run in float16, to which fp8 K/V convert in
        # one instruction (two for bfloat16). The queries are scaled first by the power of two below
        # the softmax scale (``launch.f16_query_scale``: exact), so float16's range bounds about
        # q * scale rather than q.
        q = (q.to(tl.float32) * q_scale).to(tl.float16)
        if BLOCK_D2 > 0:
            q2 = (q2.to(tl.float32) * q_scale).to(tl.float16)
        if BLOCK_D3 > 0:
            q3 = (q3.to(tl.float32) * q_scale).to(tl.float16)

    # Key ranges: per row for the element mask, per block for which tiles to visit.
    row_pos = num_keys - num_queries + token
    first_pos = num_keys - num_queries + q_start
    last_pos = num_keys - num_queries + tl.minimum(q_start + BLOCK_Q, num_queries) - 1
    row_lo, row_hi = _key_bounds(
        row_pos,
        num_keys,
        window_left,
        window_right,
        chunk_size,
        CAUSAL=CAUSAL,
        HAS_WINDOW_LEFT=HAS_WINDOW_LEFT,
        HAS_WINDOW_RIGHT=HAS_WINDOW_RIGHT,
        HAS_CHUNK=HAS_CHUNK,
    )
    first_lo, first_hi = _key_bounds(
        first_pos,
        num_keys,
        window_left,
        window_right,
        chunk_size,
        CAUSAL=CAUSAL,
        HAS_WINDOW_LEFT=HAS_WINDOW_LEFT,
        HAS_WINDOW_RIGHT=HAS_WINDOW_RIGHT,
        HAS_CHUNK=HAS_CHUNK,
    )
    last_lo, last_hi = _key_bounds(
        last_pos,
        num_keys,
        window_left,
        window_right,
        chunk_size,
        CAUSAL=CAUSAL,
        HAS_WINDOW_LEFT=HAS_WINDOW_LEFT,
        HAS_WINDOW_RIGHT=HAS_WINDOW_RIGHT,
        HAS_CHUNK=HAS_CHUNK,
    )
    # lo and hi never decrease with the position: the block sees [first_lo, last_hi], and every row
    # sees all of [last_lo, first_hi].
    # Integer division truncates in Triton: keep every dividend non-negative.
    tile_base = (first_lo // BLOCK_N) * BLOCK_N
    num_tiles = tl.cdiv(tl.maximum(last_hi + 1 - tile_base, 0), BLOCK_N)
    full_begin = tl.minimum(tl.cdiv(last_lo - tile_base, BLOCK_N), num_tiles)
    full_end = tl.minimum(tl.maximum(tl.maximum(first_hi + 1 - tile_base, 0) // BLOCK_N, full_begin), num_tiles)

    # This split's share of the tiles.
    tiles_per_split = tl.cdiv(num_tiles, tl.num_programs(2))
    split_begin = tl.minimum(split * tiles_per_split, num_tiles)
    split_end = tl.minimum(split_begin + tiles_per_split, num_tiles)

    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_slope = l_i  # no ALiBi: unused
    if HAS_ALIBI:
        row_slope = tl.load(AlibiSlopes + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc2 = l_i  # no second value tile: unused
    acc3 = l_i
    if BLOCK_DV2 > 0:
        acc2 = tl.zeros([BLOCK_M, BLOCK_DV2], dtype=tl.float32)
    if BLOCK_DV3 > 0:
        acc3 = tl.zeros([BLOCK_M, BLOCK_DV3], dtype=tl.float32)
    K = K + kv_head * stride_kh
    V = V + kv_head * stride_vh
    # Three phases: masked tiles before the fully visible ones, the fully visible ones, masked after.
    # Without a left window or chunks every row sees key 0: no tile lies before the visible ones, and
    # the first phase is not compiled (a third loop's registers and pipeline buffers).
    for phase in tl.static_range(3):
        if phase != 0 or HAS_WINDOW_LEFT or HAS_CHUNK:
            if phase == 0:
                begin = split_begin
                end = tl.minimum(full_begin, split_end)
            elif phase == 1:
                begin = tl.maximum(full_begin, split_begin)
                end = tl.minimum(full_end, split_end)
            else:
                begin = tl.maximum(full_end, split_begin)
                end = split_end
            acc, acc2, acc3, l_i, m_i = _attend_tiles(
                acc,
                acc2,
                acc3,
                l_i,
                m_i,
                q,
                q2,
                q3,
                K,
                V,
                PageTableRow,
                kv_start,
                num_keys,
                tile_base,
                begin,
                end,
                row_lo,
                row_hi,
                row_pos,
                row_slope,
                qk_scale,
                softcap,
                stride_kp,
                stride_ks,
                stride_vp,
                stride_vs,
                stride_vd,
                BLOCK_N=BLOCK_N,
                HEAD_DIM=HEAD_DIM,
                BLOCK_D=BLOCK_D,
                BLOCK_D2=BLOCK_D2,
                BLOCK_D3=BLOCK_D3,
                VALUE_DIM=VALUE_DIM,
                BLOCK_DV=BLOCK_DV,
                BLOCK_DV2=BLOCK_DV2,
                BLOCK_DV3=BLOCK_DV3,
                PAGE_SIZE=PAGE_SIZE,
                PAGED=PAGED,
                MASKED=phase != 1,
                HAS_SOFTCAP=HAS_SOFTCAP,
                HAS_ALIBI=HAS_ALIBI,
                DOT_PRECISION=DOT_PRECISION,
                PAGES_AHEAD=PAGES_AHEAD and PAGED,
                WHOLE_PAGES=WHOLE_PAGES
                and PAGED
                and PAGE_SIZE > 1
                and BLOCK_N % PAGE_SIZE == 0
                and HEAD_DIM == BLOCK_D
                and VALUE_DIM == BLOCK_DV,
                V_KEYS=V_KEYS,
            )

    if not SPLIT:
        if HAS_SINKS:
            sink = tl.load(Sinks + head, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
            m_new = tl.maximum(m_i, sink)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.exp2(sink - m_safe)
            m_i = m_safe
            acc = acc * alpha[:, None]
            if BLOCK_DV2 > 0:
                acc2 = acc2 * alpha[:, None]
            if BLOCK_DV3 > 0:
                acc3 = acc3 * alpha[:, None]
        inv_l = v_scale / tl.where(l_i == 0.0, 1.0, l_i)  # a row that sees no key gives zeros
        o_rows = Out + q_row * stride_ot + head * stride_oh
        _store_columns(o_rows, row_ok, (acc * inv_l[:, None]).to(Out.dtype.element_ty), 0, BLOCK_DV, VALUE_DIM)
        if BLOCK_DV2 > 0:
            o2 = (acc2 * inv_l[:, None]).to(Out.dtype.element_ty)
            _store_columns(o_rows, row_ok, o2, BLOCK_DV, BLOCK_DV2, VALUE_DIM)
        if BLOCK_DV3 > 0:
            o3 = (acc3 * inv_l[:, None]).to(Out.dtype.element_ty)
            _store_columns(o_rows, row_ok, o3, BLOCK_DV + BLOCK_DV2, BLOCK_DV3, VALUE_DIM)
        if HAS_LSE:  # natural log: the base-2 running max and sum times ln(2)
            lse = (m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))) * 0.6931471805599453
            lse = tl.where(l_i == 0.0, float("-inf"), lse)
            tl.store(Lse + q_row * stride_lt + head * stride_lh, lse, mask=row_ok)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        w_row = q_row * stride_wt + head * stride_wh + split * stride_ws
        w_rows = PartialOut + w_row * PARTIAL_DV
        _store_columns(w_rows, row_ok, acc * v_scale / l_safe[:, None], 0, BLOCK_DV, VALUE_DIM)
        if BLOCK_DV2 > 0:
            _store_columns(w_rows, row_ok, acc2 * v_scale / l_safe[:, None], BLOCK_DV, BLOCK_DV2, VALUE_DIM)
        if BLOCK_DV3 > 0:
            o3 = acc3 * v_scale / l_safe[:, None]
            _store_columns(w_rows, row_ok, o3, BLOCK_DV + BLOCK_DV2, BLOCK_DV3, VALUE_DIM)
        tl.store(PartialLse + w_row, lse, mask=row_ok)
        if MERGE_IN_KERNEL:
            # The last of the block's splits to finish merges them: a ticket per (query block, KV
            # head), taken after every thread's stores (the barrier) with release semantics, read
            # with acquire semantics, and put back to 0 for the next launch by the merging program.
            tl.debug_barrier()
            counter = MergeCounters + tl.program_id(0) * tl.num_programs(1) + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == tl.num_programs(2) - 1:
                _merge_splits_of_rows(
                    PartialOut, PartialLse, Sinks, Out, Lse, q_row * stride_wt + head * stride_wh, stride_ws,
                    tl.num_programs(2), q_row * stride_ot + head * stride_oh, q_row * stride_lt + head * stride_lh,
                    head, row_ok, BLOCK_M=BLOCK_M, PARTIAL_DV=PARTIAL_DV, VALUE_DIM=VALUE_DIM,
                    HAS_SINKS=HAS_SINKS, HAS_LSE=HAS_LSE,
                )  # fmt: skip
                tl.atomic_xchg(counter, 0)
