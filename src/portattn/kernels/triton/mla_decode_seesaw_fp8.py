"""MLA decode for 64-head blocks over an fp8 latent cache, the consuming warpgroups on alternate tiles (Gluon).

The fp8-scores form (``mla_decode_wide_fp8.py``) splits each tile's scores by keys between its two consuming
warpgroups (``m64n32`` products, each re-reading all the queries from shared memory) and its values by latent dims,
so the warpgroups meet twice a tile (the row maximum, the probabilities) and run each step's scores, softmax and
value product one after another. Here the tiles go in pairs ``(a, b)``, as FlashMLA's "seesaw" schedule does
(github.com/deepseek-ai/FlashMLA, docs/20250422-new-kernel-deep-dive.md):

* The left warpgroup (the default partition) takes tile ``a``'s scores ``[64 heads, 64 keys]`` (an ``m64n64``
  fp8 product), the right one (a worker partition) tile ``b``'s, at the same time.
* Each owns half the output, 256 latent dims (128 accumulator registers a thread), and adds both tiles' value
  products to it: fp8 ones (``m64n256k32``), the producer having transposed each tile's latent bytes to ``[dims,
  keys]`` (K-major, as the fp8 product needs) and the probabilities going to e4m3 times ``P_FP8_SCALE``.
* The pair takes one row maximum (since round 63): each warpgroup publishes its tile's row maximum and reads the
  other's, ``m = max(m_prev, rowmax(a), rowmax(b))``, publishes its probabilities ``exp2(s - m)``, scales its output
  once by ``exp2(m_prev - m)`` and issues both tiles' products back to back (``_consume``, one function for both
  sides); the first value buffer is released once its product is done, so the producer may fill it while the
  second runs. The softmax's sums are kept per warpgroup and added at the end. (Until round 63 the left published
  ``m0 = max(m, rowmax(a))``, the right ``m1 = max(m0, rowmax(b))``, and the left's output was rescaled between its
  two products: 0.1051 ms against 0.0966 at 64 heads in one split on an H100, benchmarks/results/round63/NOTES.md.)
* A producer warpgroup copies the tiles by TMA into a ring of ``RING`` fp8 slots (``mla_decode_wide_fp8``'s copies:
  the cache must allow them, ``tma_rows``) and transposes each tile's latent into one of two value buffers (one a
  pair's tile).

The queries are rounded to e4m3 per head row by a power of two, as in the fp8-scores form; the scores are two partial
sums added in float32 (the latent's first ``PROMOTE_EVERY`` dims; its second and the rope,
``_issue_scores_folded``): the form's three 32-register accumulators beside the 128-register output leave ptxas
too few registers, and it then serializes every product of the kernel. Its GPU tests (round 56: pages 64, 16 and 8)
passed with the outputs' errors of the fp8-scores form with fp8 values (at most 0.63 of their bound) and LSE errors
of 1.7e-4 to 2.1e-4 of the largest (that form: 1.6e-4 to 1.9e-4; allowed 5e-4).

Since round 57 its producer's transposition is free of bank conflicts (``mla_decode_wide_fp8.transposing_load``;
the output's columns relabelled back by ``mla_decode_wide.value_columns``) and it is the launcher's default over fp8
caches where each program has many tiles: on an H100 (64 sequences over 4096 keys, page 64) 128 heads took 0.1079
ms (1.54x the bf16 cache), 32 heads 0.0789 (1.51x), 17 heads 0.0738 (1.55x); with few tiles a program its pairs
cost more than they save (benchmarks/results/round57/NOTES.md). Since round 64 the producer transposes with
``ldmatrix``'s transposing loads and one ``prmt`` a word (``TRANS_LOAD``, :func:`_transpose_values`), the keys in
:func:`key_columns`' order in the value buffers and the probabilities.

Requirements as the fp8-scores form's, and TMA copies (:func:`supports`). Splits and partial results are the
portable kernel's, the partial outputs in bfloat16 since round 66 (``BF16_PARTIALS``); so is the merge
(``mla_decode_merge_kernel``). A form whose last split program of a head block merged the splits itself ran 20-27 us
slower and was removed in round 67 (benchmarks/results/round65 and round66; the patch in round67/scripts).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .mla_decode_fp8_mma import RANK, ROPE, _barrier, _key_range, _store_result, arguments
from .mla_decode_wide import BLOCK_H, FP8, PRODUCER_MAXNREG, PRODUCER_WARPS, columns_first, nvmma, value_columns
from .mla_decode_wide_fp8 import (
    P_FP8_SCALE,
    _convert_values,
    _issue_scores_folded,
    _issue_tile,
    _queries_amax,
    _queries_store,
    _query_pointers,
    _row_scales,
    _scores,
    _tma_load,
    tma_rows,
    transposing_load,
)

BLOCK_N = gl.constexpr(64)  # keys a tile
RING = 3  # fp8 tiles in flight
HALF = gl.constexpr(256)  # the latent dims a consuming warpgroup accumulates
# registers a thread: the producer's (TMA copies and the transposition) and the right warpgroup's; the left takes
# what remains of PRODUCER_MAXNREG x 12 warps
PRODUCER_REGS = gl.constexpr(56)
CONSUMER_REGS = gl.constexpr(224)
NUM_WARPS = 4  # the default partition: the left warpgroup
# The producer loads the page id of the tile it refills before waiting for the tile it transposes, so that the
# load's latency is not on its path (pages of 64 keys: one TMA copy a tile). With one maximum a pair, on an H100 (64
# sequences over 4096 keys, page 64, e4m3): 0.0966 ms against 0.1051 at 64 heads in one split, 0.0687 against
# 0.0722 at 17 heads, 0.0740 against 0.0757 at 64 heads with the cache in the L2; 0.0856-0.0865 against 0.0858 at
# 64 heads from DRAM (benchmarks/results/round63/NOTES.md). Outputs equal to the form without, bit for bit.
PAGE_AHEAD = True
# The producer reads each tile's latent with ``ldmatrix``'s transposing form (16-bit elements: two dims of a key)
# and joins each dim's keys in its registers with one ``prmt`` a word (:func:`_transpose_values`: a tile's 16
# loads, 64 prmt and 16 stores a thread, where ``mla_decode_wide_fp8._convert_values`` took 192 prmt), the keys
# in another order in the value buffers and the probabilities (:func:`key_columns`; the probabilities then stored
# 16 bytes at a time, not 2). On an H100 (64 sequences over 4096 keys, page 64, e4m3), against the form without:
# 0.0799-0.0807 ms against 0.0854-0.0864 at 64 heads, 0.0889 against 0.0975 in one split, 0.0588 against 0.0718
# with the cache in the L2, 0.0696 against 0.0715 at 17 heads, 0.0974-0.0977 against 0.1070-0.1095 at 128
# (benchmarks/results/round64/NOTES.md). The keys' order changes the sums' rounding only.
TRANS_LOAD = True
# Split launches write their partial outputs in bfloat16 (:func:`bf16_partials`), half the bytes of float32 ones, which
# each program writes at its end and the merge reads back; the LSEs stay float32. The output, a bfloat16 or float16
# rounding of the merged partials, then carries two 16-bit roundings; the fp8 values' bound is far wider (the GPU
# tests' largest shares of it as with float32 partials). On an H100 (64 sequences over 4096 keys, page 64, e4m3),
# against float32 partials: 0.0764-0.0772 ms against 0.0802-0.0815 at 64 heads, 0.0555-0.0574 against 0.0593 with
# the cache in the L2, 0.0689-0.0694 against 0.0698-0.0704 at 17 heads (benchmarks/results/round66/NOTES.md).
BF16_PARTIALS = True
# The first ``RING`` tiles' copies are started by the program's prologue between the queries' two passes (their rows'
# largest magnitudes, then their rounding), not by the producer after the prologue: the queries' first loads go out
# ahead of the copies' 110 KB, the copies ahead of the second pass. On an H200 (64 sequences over 4096 keys, page 64,
# e4m3, a page table per input set), against copies by the producer: 0.0556-0.0564 ms against 0.0571-0.0583 at 17
# heads, 0.0638-0.0639 against 0.0653-0.0658 at 64. Started before the queries' loads (as round 66's EARLY_TILES), the
# copies delay those loads by 3 us and the first tile is seen no sooner (benchmarks/results/round68/NOTES.md).
EARLY_COPIES = True
# The queries' first pass keeps the latent queries as they came (bfloat16 or float16, 64 KB) in the value buffers,
# which the producer fills only after the prologue, and the second pass reads them there rather than loading them again
# from memory (one round trip less before the first scores). On an H100 (64 sequences over 4096 keys, page 64, e4m3, a
# page table per input set), against the volatile reloads: 0.0731 ms against 0.0746 at 64 heads; `bench.mla --fp8`
# 0.092 ms against 0.100 at 128 heads (benchmarks/results/round69/NOTES.md; no H200 was lent).
KEEP_QUERIES = True
# Where a head block has at most 32 heads, a program loads only its first 16 or 32 head rows (``query_rows``), all at
# once and before the barriers' set-up, and rounds them from its registers (:func:`_queries_rows`,
# :func:`_queries_rounded`): one round trip to memory rather than two, and a half or a quarter of the loads and
# conversions (at 17 heads 18 loads of 16 bytes a thread, not 66); the rows past them are stored as zeros at a row of
# zeros' scale, as the two passes store a padding head. With ``EARLY_COPIES`` the first copies are issued behind the
# queries' loads, before their values are used. On an H100 (as ``KEEP_QUERIES``'): 0.0628 ms against 0.0660 at 17
# heads, 1.79x the bf16 cache against 1.70x. Without ``EARLY_COPIES`` it took 0.0653; the first copies' page ids
# loaded together (one round trip to the page table, not three) changed nothing and were removed
# (benchmarks/results/round69/NOTES.md).
ONE_PASS = True
LEFT = gl.constexpr(0)
RIGHT = gl.constexpr(1)
HOPPER_SHARED = 232_448  # bytes of shared memory a program may take on compute capability 9.0


@functools.cache
def seesaw_constexprs(
    ring: int = RING,
    page_ahead: bool = True,
    trans_load: bool = True,
    early_copies: bool = True,
    keep_queries: bool = True,
) -> dict:
    """The kernel's layout arguments (each partition one warpgroup) and its form (``page_ahead``, ``trans_load``,
    ``early_copies``, ``keep_queries``: ``PAGE_AHEAD``'s, ``TRANS_LOAD``'s, ``EARLY_COPIES``' and ``KEEP_QUERIES``')."""
    if ring < 2:
        raise ValueError(f"expected 2+ ring slots, got {ring}")
    w = PRODUCER_WARPS.value
    return {
        "S_MMA": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N.value, 32]),
        "O_MMA": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 32]),
        "Q_LOAD": gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0]),
        "C_8": nvmma(RANK, 8),
        "PE_8": nvmma(ROPE, 8),
        "P_S": nvmma(BLOCK_N.value, 8),  # [heads, keys] e4m3
        "V_S": nvmma(BLOCK_N.value, 8),  # [dims, keys] fp8
        # the producer's transposition: its load (ldmatrix, transposing), or mla_decode_wide_fp8's
        "TLOAD": pairs_load() if trans_load else transposing_load(BLOCK_N.value),
        "CVT": gl.BlockedLayout([1, 16], [4, 8], [w, 1], [1, 0]),
        "RING": ring,
        "PAGE_AHEAD": page_ahead,
        "TRANS_LOAD": trans_load,
        "EARLY_COPIES": early_copies,
        "KEEP_QUERIES": keep_queries,
    }


def key_columns() -> list[int]:
    """The key each column of a value buffer and of the probabilities holds (``TRANS_LOAD``): column ``c``'s bits,
    the lowest first, are the key's bits ``1, 8, 16, 32, 2, 4``, so that a thread's transposed words (keys ``k, k +
    1, k + 8, k + 9``) and its probabilities are 16 consecutive columns. The value product sums over keys in any
    order; both operands take this one."""
    order = (0, 3, 4, 5, 1, 2)  # column bit i holds key bit order[i]
    return [sum(((c >> i) & 1) << b for i, b in enumerate(order)) for c in range(BLOCK_N.value)]


def pairs_load() -> gl.DistributedLinearLayout:
    """How the producer loads a ``[64 keys, 64 pairs of dims]`` chunk of a tile's latent, 16 bits an element (a key's
    two dims), to transpose it (``TRANS_LOAD``), as ``ldmatrix``'s transposing form delivers it. A thread's register
    holds one pair of dims of keys ``k`` and ``k + 1`` (two rows of an 8 x 8 matrix); its registers keys ``8, 16,
    32`` apart (a load's four matrices and two loads) and pairs ``32`` apart; its lanes keys ``2, 4`` apart (the
    matrix's rows two and four apart: its eight rows, keys ``k .. k + 7``, in the eight bank groups of the 128-byte
    swizzle) and pairs ``1, 2, 4`` apart (its columns); the warps pairs ``8, 16`` apart."""
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0], [0, 32]],
        lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 8], [0, 16]],
        block_bases=[],
        shape=[64, 64],
    )


def shared_bytes(ring: int = RING) -> int:
    """Shared memory of the kernel's buffers, before Triton's scratch."""
    queries, tile = BLOCK_H.value * (RANK + ROPE), BLOCK_N.value * (RANK + ROPE)
    values, probabilities = 2 * RANK * BLOCK_N.value, 4 * BLOCK_H.value * BLOCK_N.value
    return queries + ring * tile + values + probabilities + 4 * 5 * BLOCK_H.value + 8 * (2 * ring + 11)


@gluon.jit
def _masked_scores(s, tile_start, end, scale, S_MMA: gl.constexpr):
    """A tile's scores in base 2, keys from ``end`` on at -inf. Only a sequence's last tile is masked: the keys'
    offsets, short of registers, were each recomputed from the thread's index, a chain of about a dozen ``S2R``
    on every tile's path to its row maximum (round 63's clock64 traces)."""
    s = s * scale[:, None]
    if tile_start + BLOCK_N > end:
        offs_n = tile_start + gl.arange(0, BLOCK_N, gl.SliceLayout(0, S_MMA))
        s = gl.where(offs_n[None, :] < end, s, float("-inf"))
    return s


@gluon.jit
def _publish_probabilities(p, p_smem, bar, TRANS_LOAD: gl.constexpr):
    """A tile's probabilities (times ``P_FP8_SCALE``, e4m3) into shared memory for either warpgroup's product, its
    keys in the value buffers' order (``TRANS_LOAD``: :func:`key_columns`'), ``bar`` arrived once every lane's
    stores are visible to the tensor cores."""
    p = (p * P_FP8_SCALE).to(p_smem.dtype)
    if TRANS_LOAD:  # [heads, k32 k16 k8 k4 k2 k1] to [heads, k4 k2 k32 k16 k8 k1]
        p = gl.reshape(gl.permute(gl.reshape(p, [p.shape[0], 2, 2, 2, 2, 2, 2]), (0, 4, 5, 1, 2, 3, 6)), p.shape)
    p_smem.store(p)
    fence_async_shared()
    _barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _scaled(acc, factor, O_MMA: gl.constexpr):
    return acc * gl.convert_layout(factor, gl.SliceLayout(1, O_MMA))[:, None]


@gluon.jit
def _finish_half(acc, m_i, l_i, l_x, l_done, SIDE: gl.constexpr, head_block, seq, split, start, end, num_heads,
                 num_kv_splits, kv_scale, Out, Lse, PartOut, PartLse, stride_o_b, stride_o_h, stride_lse_b,
                 stride_lse_h, WRITE_PARTIAL: gl.constexpr, WRITE_LSE: gl.constexpr, S_MMA: gl.constexpr,
                 O_MMA: gl.constexpr, TRANS_LOAD: gl.constexpr):  # fmt: skip
    """A warpgroup's half of the result: the softmax's sums of both warpgroups added (through ``l_x``), its 256
    dims normalised and stored."""
    l_x.slice(SIDE * BLOCK_H, BLOCK_H).store(l_i)
    _barrier()
    mbarrier.arrive(l_done, count=1)
    mbarrier.wait(l_done, 0)
    l_i = l_i + l_x.slice((1 - SIDE) * BLOCK_H, BLOCK_H).load(gl.SliceLayout(1, S_MMA))
    acc = _rows_to_dims(acc, TRANS_LOAD)
    rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    offs_h = head_block * BLOCK_H + gl.arange(0, BLOCK_H, rows)
    dims = SIDE * HALF + gl.arange(0, HALF, gl.SliceLayout(0, acc.type.layout))
    _store_result(acc, gl.convert_layout(m_i, rows), gl.convert_layout(l_i, rows), offs_h, dims, seq, split, start,
                  end, num_heads, num_kv_splits, kv_scale / P_FP8_SCALE, Out, Lse, PartOut, PartLse, stride_o_b,
                  stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL, WRITE_LSE)  # fmt: skip


@gluon.jit
def _consume(SIDE: gl.constexpr, qn_smem, qr_smem, scale_smem, c_ring, pe_ring, vt, p_a, p_b, m_x, l_x, ready, empty,
             vt_ready, vt_empty, m0_ready, m1_ready, pa_ready, pb_ready, l_done, head_block, seq, split, start, end,
             num_heads, num_kv_splits, qk_scale_log2, kv_scale, Out, Lse, PartOut, PartLse, stride_o_b, stride_o_h,
             stride_lse_b, stride_lse_h, WRITE_PARTIAL: gl.constexpr, WRITE_LSE: gl.constexpr, S_MMA: gl.constexpr,
             O_MMA: gl.constexpr, RING: gl.constexpr, TRANS_LOAD: gl.constexpr):  # fmt: skip
    """A consuming warpgroup: tile ``2 i + SIDE`` of each pair scored, the pair's row
    maximum taken from both tiles' (its own published in ``m_x``, ``m0_ready`` or ``m1_ready``), its probabilities
    published, and both tiles' products into dims ``[SIDE * 256, SIDE * 256 + 256)`` at one scale."""
    ROWS: gl.constexpr = gl.SliceLayout(1, S_MMA)
    if SIDE == 0:
        own_max, other_max, own_p, own_p_ready = m0_ready, m1_ready, p_a, pa_ready
    else:
        own_max, other_max, own_p, own_p_ready = m1_ready, m0_ready, p_b, pb_ready
    scale = scale_smem.load(ROWS) * qk_scale_log2
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
    l_i = gl.zeros([BLOCK_H], gl.float32, ROWS)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, O_MMA)
    num_tiles = gl.cdiv(end - start, BLOCK_N)
    for i in range(gl.cdiv(num_tiles, 2)):
        t = 2 * i + SIDE
        mine = t < num_tiles  # the left's tile always is
        has_b = 2 * i + 1 < num_tiles
        s = gl.full([BLOCK_H, BLOCK_N], float("-inf"), gl.float32, S_MMA)
        r = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
        if mine:
            slot = t % RING
            mbarrier.wait(ready.index(slot), (t // RING) & 1)
            s = _issue_scores_folded(qn_smem, qr_smem, c_ring.index(slot), pe_ring.index(slot), BLOCK_N, S_MMA)
            s = _scores(s, 0)
            _barrier()  # every warp's share of the product read the slot
            mbarrier.arrive(empty.index(slot), count=1)
            s = _masked_scores(s, start + t * BLOCK_N, end, scale, S_MMA)
            r = gl.max(s, 1)
        m_x.slice(SIDE * BLOCK_H, BLOCK_H).store(r)
        _barrier()
        mbarrier.arrive(own_max, count=1)
        mbarrier.wait(other_max, i & 1)
        m_new = gl.maximum(m_i, gl.maximum(r, m_x.slice((1 - SIDE) * BLOCK_H, BLOCK_H).load(ROWS)))
        alpha = gl.exp2(m_i - m_new)  # finite m_new: tile a holds a key
        l_i = l_i * alpha
        if mine:
            p = gl.exp2(s - m_new[:, None])
            l_i = l_i + gl.sum(p, 1)
            _publish_probabilities(p, own_p.index(i % 2), own_p_ready.index(i % 2), TRANS_LOAD)
        acc = _scaled(acc, alpha, O_MMA)
        mbarrier.wait(pa_ready.index(i % 2), (i // 2) & 1)
        mbarrier.wait(vt_ready.index(0), i & 1)
        acc = warpgroup_mma(p_a.index(i % 2), vt.index(0).slice(SIDE * HALF, HALF, dim=0).permute((1, 0)), acc,
                            is_async=True)  # fmt: skip
        acc = warpgroup_mma_wait(1, deps=[acc])  # waits for nothing: the product left running
        if has_b:
            mbarrier.wait(pb_ready.index(i % 2), (i // 2) & 1)
            mbarrier.wait(vt_ready.index(1), i & 1)
            acc = warpgroup_mma(p_b.index(i % 2), vt.index(1).slice(SIDE * HALF, HALF, dim=0).permute((1, 0)), acc,
                                is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(1, deps=[acc])
            _barrier()  # every warp's product of tile a done: the producer may fill its buffer
            mbarrier.arrive(vt_empty.index(0), count=1)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _barrier()
        if has_b:
            mbarrier.arrive(vt_empty.index(1), count=1)
        else:
            mbarrier.arrive(vt_empty.index(0), count=1)
        m_i = m_new
    _finish_half(acc, m_i, l_i, l_x, l_done, SIDE, head_block, seq, split, start, end, num_heads, num_kv_splits,
                 kv_scale, Out, Lse, PartOut, PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
                 WRITE_PARTIAL, WRITE_LSE, S_MMA, O_MMA, TRANS_LOAD)  # fmt: skip


@gluon.jit
def _issue_first_tiles(CDesc, PeDesc, page_row, stride_pt_p, start, end, c_ring, pe_ring, ready, PAGE_SIZE: gl.constexpr,
                       TMA_ROWS: gl.constexpr, RING: gl.constexpr):  # fmt: skip
    """The copies of the split's first ``RING`` tiles (as many as it has), one into each ring slot."""
    num_tiles = gl.cdiv(end - start, BLOCK_N)
    for j in gl.static_range(RING):
        if j < num_tiles:
            _issue_tile(CDesc, PeDesc, page_row, stride_pt_p, start + j * BLOCK_N, end, c_ring.index(j),
                        pe_ring.index(j), ready.index(j), PAGE_SIZE, BLOCK_N, TMA_ROWS)  # fmt: skip


@gluon.jit
def _queries_rows(QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
                  Q_LOAD: gl.constexpr, Q_ROWS: gl.constexpr):  # fmt: skip
    """The latent queries of the head block's first ``Q_ROWS`` rows in four ``[Q_ROWS, 128]`` quarters and their rope
    queries, as they came (zeros past ``num_heads``); every load issued before any is used."""
    qn_ptr, qr_ptr, h_ok = _query_pointers(QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h,
                                           stride_qr_b, stride_qr_h, Q_LOAD, Q_ROWS)  # fmt: skip
    qr = gl.load(qr_ptr, mask=h_ok, other=0.0)
    qn0 = gl.load(qn_ptr, mask=h_ok, other=0.0)
    qn1 = gl.load(qn_ptr + 128, mask=h_ok, other=0.0)
    qn2 = gl.load(qn_ptr + 256, mask=h_ok, other=0.0)
    qn3 = gl.load(qn_ptr + 384, mask=h_ok, other=0.0)
    return qn0, qn1, qn2, qn3, qr


@gluon.jit
def _queries_rounded(qn0, qn1, qn2, qn3, qr, q_scale, Q_LOAD: gl.constexpr, C_8: gl.constexpr, PE_8: gl.constexpr,
                     Q_ROWS: gl.constexpr):  # fmt: skip
    """:func:`_queries_rows`' queries times ``q_scale`` rounded to e4m3 by each row's power of two in shared memory as
    ``mla_decode_wide_fp8._queries_store`` stores them (the same values, bit for bit), the rows from ``Q_ROWS`` on
    zeros at the scale of a row of zeros; returns the latent's, the rope's and the rows' scales' shared memory."""
    ROWS: gl.constexpr = gl.SliceLayout(1, Q_LOAD)
    qr = qr.to(gl.float32) * q_scale
    amax = gl.max(gl.abs(qr), 1)
    amax = gl.maximum(amax, gl.max(gl.abs(qn0.to(gl.float32)), 1) * q_scale)
    amax = gl.maximum(amax, gl.max(gl.abs(qn1.to(gl.float32)), 1) * q_scale)
    amax = gl.maximum(amax, gl.max(gl.abs(qn2.to(gl.float32)), 1) * q_scale)
    amax = gl.maximum(amax, gl.max(gl.abs(qn3.to(gl.float32)), 1) * q_scale)
    to_fp8, row_scale = _row_scales(amax)
    to_fp8 = to_fp8[:, None]
    qn_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, 512], C_8)
    qr_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, 64], PE_8)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    scale_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    rows = qn_smem.slice(0, Q_ROWS, dim=0)
    rows.slice(0, 128, dim=1).store((qn0.to(gl.float32) * q_scale * to_fp8).to(gl.float8e4nv))
    rows.slice(128, 128, dim=1).store((qn1.to(gl.float32) * q_scale * to_fp8).to(gl.float8e4nv))
    rows.slice(256, 128, dim=1).store((qn2.to(gl.float32) * q_scale * to_fp8).to(gl.float8e4nv))
    rows.slice(384, 128, dim=1).store((qn3.to(gl.float32) * q_scale * to_fp8).to(gl.float8e4nv))
    qr_smem.slice(0, Q_ROWS, dim=0).store((qr * to_fp8).to(gl.float8e4nv))
    scale_smem.slice(0, Q_ROWS).store(row_scale)
    zeros = gl.zeros([Q_ROWS, 128], gl.float32, Q_LOAD).to(gl.float8e4nv)
    zeros_pe = gl.zeros([Q_ROWS, 64], gl.float32, Q_LOAD).to(gl.float8e4nv)
    _, zero_scale = _row_scales(gl.zeros([Q_ROWS], gl.float32, ROWS))
    for r in gl.static_range(Q_ROWS, BLOCK_H, Q_ROWS):  # the padding rows
        for c in gl.static_range(4):
            qn_smem.slice(r, Q_ROWS, dim=0).slice(128 * c, 128, dim=1).store(zeros)
        qr_smem.slice(r, Q_ROWS, dim=0).store(zeros_pe)
        scale_smem.slice(r, Q_ROWS).store(zero_scale)
    return qn_smem, qr_smem, scale_smem


@gluon.jit
def _issue_page(CDesc, PeDesc, page, c_buf, pe_buf, bar, PAGE_SIZE: gl.constexpr, TMA_ROWS: gl.constexpr):
    """:func:`mla_decode_wide_fp8._issue_tile` for a tile that is one copy of page ``page`` (loaded ahead), from its
    first row on."""
    mbarrier.expect(bar, BLOCK_N * 576)
    row = page * PAGE_SIZE
    _tma_load(CDesc, [row, 0], bar, c_buf.slice(0, TMA_ROWS, dim=0))
    _tma_load(PeDesc, [row, 512], bar, pe_buf.slice(0, TMA_ROWS, dim=0))


# Two dims of four keys to the four keys of each dim: ``$2`` holds keys ``a, a + 1`` and ``$3`` keys ``b, b + 1``,
# each a key's two dims, the lower first; ``$0`` gets the lower dim of keys ``a, a + 1, b, b + 1``, ``$1`` the higher.
_PAIRS_TO_DIMS = gl.constexpr("""{
prmt.b32 $0, $2, $3, 0x6420;
prmt.b32 $1, $2, $3, 0x7531;
}""")


# a shared buffer's bytes as elements of another type (Triton 3.6 names the method _reinterpret)
if hasattr(gl.shared_memory_descriptor, "reinterpret"):

    @gluon.jit
    def _as_type(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        return smem.reinterpret(dtype, shape, layout)

else:

    @gluon.jit
    def _as_type(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        return smem._reinterpret(dtype, shape, layout)


@gluon.jit
def _transpose_values(c_tile, v_buf, tile_start, end, TLOAD: gl.constexpr, ZERO_TAIL: gl.constexpr):
    """The tile's latent bytes transposed into the value buffer ``[dims, keys]`` (``TRANS_LOAD``), both seen as
    16-bit elements: a ``[64 keys, 64 pairs of dims]`` chunk at a time loaded as :func:`pairs_load` lays it, each
    thread's keys ``k, k + 1, k + 8, k + 9`` of a pair regrouped by :data:`_PAIRS_TO_DIMS` into a word of each dim.
    The buffer's columns hold the keys in :func:`key_columns`' order, and in each 128-row chunk row ``64 j + q``
    holds dim ``2 q + j``: a quarter warp's 16-byte stores (four key columns, two rows of opposite parity) fill eight
    bank groups of the 64-byte swizzle. :func:`_rows_to_dims` relabels the output's columns back. ``ZERO_TAIL``:
    keys from ``end`` on are zeros (TMA copies whole pages)."""
    pairs = _as_type(c_tile, gl.int16, [BLOCK_N, 256], gl.NVMMASharedLayout(128, 16, 2))
    rows = _as_type(v_buf, gl.int16, [512, BLOCK_N // 2], gl.NVMMASharedLayout(64, 16, 2))
    for c in gl.static_range(4):
        x = pairs.slice(64 * c, 64, dim=1).load(TLOAD)  # [keys, pairs]
        if ZERO_TAIL:
            keys = tile_start + gl.arange(0, BLOCK_N, gl.SliceLayout(1, TLOAD))
            x = gl.where((keys < end)[:, None], x, gl.zeros_like(x))
        y = gl.permute(gl.reshape(x, [2, 2, 2, 2, 2, 2, 64]), (0, 1, 3, 4, 5, 6, 2))  # [k32 k16 k4 k2 k1, pairs, k8]
        keys_01, keys_89 = gl.split(y)
        lower, higher = gl.inline_asm_elementwise(
            _PAIRS_TO_DIMS, "=r,=r,r,r", [keys_01, keys_89], (gl.int16, gl.int16), is_pure=True, pack=2
        )
        # an element: keys k, k + 1 of pair q's lower (higher) dim, the axis k1 now k8
        j = gl.join(lower, higher)  # [k32 k16 k4 k2 k8, q, j]: dim 2 q + j to row 64 j + q, keys to key_columns'
        rows.slice(128 * c, 128, dim=0).store(gl.reshape(gl.permute(j, (6, 5, 2, 3, 0, 1, 4)), [128, BLOCK_N // 2]))


@gluon.jit
def _rows_to_dims(acc, TRANS_LOAD: gl.constexpr):
    """A warpgroup's output ``[heads, 256]`` whose columns are value-buffer rows, its columns put in the dims' order
    (``TRANS_LOAD``: row ``64 j + q`` of each 128-row chunk holds dim ``2 q + j``; else ``value_columns``')."""
    if TRANS_LOAD:
        acc = gl.reshape(acc, [acc.shape[0], HALF // 128, 2, 64])
        acc = gl.reshape(gl.permute(acc, (0, 1, 3, 2)), [acc.shape[0], HALF])
        acc = gl.convert_layout(acc, columns_first(acc.type.layout))
    else:
        acc = value_columns(acc, HALF)
    return acc


@gluon.jit
def _produce(CDesc, PeDesc, page_row, stride_pt_p, start, end, c_ring, pe_ring, vt, ready, empty, vt_ready, vt_empty,
             PAGE_SIZE: gl.constexpr, TMA_ROWS: gl.constexpr, CVT: gl.constexpr, TLOAD: gl.constexpr,
             RING: gl.constexpr, PAGE_AHEAD: gl.constexpr, TRANS_LOAD: gl.constexpr,
             EARLY_COPIES: gl.constexpr):  # fmt: skip
    """The producer: tiles copied by TMA ``RING`` ahead (``ready[slot]`` by their bytes; a slot refilled once its
    tile's scores are read, ``empty``), each tile's latent transposed into value buffer ``t % 2`` (``vt_ready``)
    once both warpgroups' products of that buffer's last tile are done (``vt_empty``). The first ``RING`` copies are
    its own unless the prologue started them (``EARLY_COPIES``)."""
    num_tiles = gl.cdiv(end - start, BLOCK_N)
    if not EARLY_COPIES:
        _issue_first_tiles(CDesc, PeDesc, page_row, stride_pt_p, start, end, c_ring, pe_ring, ready, PAGE_SIZE,
                           TMA_ROWS, RING)  # fmt: skip
    for t in range(num_tiles):
        slot = t % RING
        tile_start = start + t * BLOCK_N
        ahead = t + RING
        if PAGE_AHEAD and TMA_ROWS == BLOCK_N and PAGE_SIZE == BLOCK_N:  # one copy a tile, one page
            # the page id of the tile refilled below, loaded before the waits and the transposition (not after)
            page_ahead = gl.load(page_row + ((start + ahead * BLOCK_N) // PAGE_SIZE) * stride_pt_p,
                                 mask=ahead < num_tiles, other=0)  # fmt: skip
        mbarrier.wait(ready.index(slot), (t // RING) & 1)
        buf = t % 2
        mbarrier.wait(vt_empty.index(buf), ((t // 2) & 1) ^ 1)
        if TRANS_LOAD:
            if tile_start + BLOCK_N > end:
                _transpose_values(c_ring.index(slot), vt.index(buf), tile_start, end, TLOAD, True)
            else:
                _transpose_values(c_ring.index(slot), vt.index(buf), tile_start, end, TLOAD, False)
        elif tile_start + BLOCK_N > end:
            _convert_values(c_ring.index(slot), vt.index(buf), tile_start, end, BLOCK_N, CVT, TLOAD, True, True)
        else:
            _convert_values(c_ring.index(slot), vt.index(buf), tile_start, end, BLOCK_N, CVT, TLOAD, True,
                            False)  # fmt: skip
        fence_async_shared()
        _barrier()
        mbarrier.arrive(vt_ready.index(buf), count=1)
        mbarrier.wait(empty.index(slot), (t // RING) & 1)
        if ahead < num_tiles:
            if PAGE_AHEAD and TMA_ROWS == BLOCK_N and PAGE_SIZE == BLOCK_N:
                _issue_page(CDesc, PeDesc, page_ahead, c_ring.index(slot), pe_ring.index(slot), ready.index(slot),
                            PAGE_SIZE, TMA_ROWS)  # fmt: skip
            else:
                _issue_tile(CDesc, PeDesc, page_row, stride_pt_p, start + ahead * BLOCK_N, end, c_ring.index(slot),
                            pe_ring.index(slot), ready.index(slot), PAGE_SIZE, BLOCK_N, TMA_ROWS)  # fmt: skip


@gluon.jit
def mla_decode_seesaw_kernel(
    QNope, QRope, KV, CDesc, PeDesc, PageTable, SeqLensK, Out, Lse, PartOut, PartLse,
    q_scale, qk_scale_log2, kv_scale, num_heads, num_kv_splits,
    stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
    stride_kv_page, stride_kv_slot, stride_pt_b, stride_pt_p,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    PAGE_SIZE: gl.constexpr, WRITE_PARTIAL: gl.constexpr, WRITE_LSE: gl.constexpr, MIN_SPLIT: gl.constexpr,
    S_MMA: gl.constexpr, O_MMA: gl.constexpr, Q_LOAD: gl.constexpr, C_8: gl.constexpr, PE_8: gl.constexpr,
    P_S: gl.constexpr, V_S: gl.constexpr, TLOAD: gl.constexpr, CVT: gl.constexpr,
    RING: gl.constexpr, TMA_ROWS: gl.constexpr, PAGE_AHEAD: gl.constexpr,
    TRANS_LOAD: gl.constexpr, EARLY_COPIES: gl.constexpr, KEEP_QUERIES: gl.constexpr, Q_ROWS: gl.constexpr = 64,
):  # fmt: skip
    """The left consuming warpgroup (the default partition), the right one and the producer (workers)."""
    head_block = gl.program_id(0)
    split = gl.program_id(1)
    seq = gl.program_id(2).to(gl.int64)
    start, end = _key_range(SeqLensK, seq, split, num_kv_splits, BLOCK_N, MIN_SPLIT)
    page_row = PageTable + seq * stride_pt_b
    if Q_ROWS < BLOCK_H:  # one pass over the block's first Q_ROWS rows (ONE_PASS), loaded before the barriers' set-up
        qn0, qn1, qn2, qn3, qr = _queries_rows(QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h,
                                               stride_qr_b, stride_qr_h, Q_LOAD, Q_ROWS)  # fmt: skip
    c_ring = gl.allocate_shared_memory(KV.dtype.element_ty, [RING, BLOCK_N, 512], C_8)
    pe_ring = gl.allocate_shared_memory(KV.dtype.element_ty, [RING, BLOCK_N, 64], PE_8)
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    vt_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    vt_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pa_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pb_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    m0_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    m1_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    l_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for j in gl.static_range(RING):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    for j in gl.static_range(2):
        mbarrier.init(vt_ready.index(j), count=1)
        mbarrier.init(vt_empty.index(j), count=2)  # both warpgroups' products
        mbarrier.init(pa_ready.index(j), count=1)
        mbarrier.init(pb_ready.index(j), count=1)
    mbarrier.init(m0_ready, count=1)
    mbarrier.init(m1_ready, count=1)
    mbarrier.init(l_done, count=2)
    if EARLY_COPIES:
        fence_async_shared()  # the barriers' initialisation before the prologue's copies arrive on them
        _barrier()
    vt = gl.allocate_shared_memory(KV.dtype.element_ty, [2, 512, BLOCK_N], V_S)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    if Q_ROWS < BLOCK_H:
        if EARLY_COPIES:  # behind the queries' loads, before their values are used
            _issue_first_tiles(CDesc, PeDesc, page_row, stride_pt_p, start, end, c_ring, pe_ring, ready, PAGE_SIZE,
                               TMA_ROWS, RING)  # fmt: skip
        qn_smem, qr_smem, scale_smem = _queries_rounded(qn0, qn1, qn2, qn3, qr, q_scale, Q_LOAD, C_8, PE_8, Q_ROWS)
    else:
        # the raw latent queries in the value buffers' bytes (KEEP_QUERIES), free until the producer's first
        # transposition
        kept = _as_type(vt, QNope.dtype.element_ty, [BLOCK_H, 512], gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
        qr, amax = _queries_amax(QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h, stride_qr_b,
                                 stride_qr_h, q_scale, Q_LOAD, kept, KEEP_QUERIES)  # fmt: skip
        if EARLY_COPIES:
            _issue_first_tiles(CDesc, PeDesc, page_row, stride_pt_p, start, end, c_ring, pe_ring, ready, PAGE_SIZE,
                               TMA_ROWS, RING)  # fmt: skip
        qn_smem, qr_smem, row_scale = _queries_store(QNope, qr, amax, seq, head_block, num_heads, stride_qn_b,
                                                     stride_qn_h, q_scale, Q_LOAD, C_8, PE_8, True, kept,
                                                     KEEP_QUERIES)  # fmt: skip
        scale_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat, row_scale)
    p_a = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_H, BLOCK_N], P_S)
    p_b = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_H, BLOCK_N], P_S)
    m_x = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], flat)  # m0, m1
    l_x = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], flat)  # the sums, left and right
    fence_async_shared()  # the queries' stores before the tensor cores read them
    _barrier()

    # one function for both consuming warpgroups
    gl.warp_specialize(
        [
            (_consume, (LEFT, qn_smem, qr_smem, scale_smem, c_ring, pe_ring, vt, p_a, p_b, m_x, l_x, ready, empty, vt_ready,
                  vt_empty, m0_ready, m1_ready, pa_ready, pb_ready, l_done, head_block, seq, split, start, end,
                  num_heads, num_kv_splits, qk_scale_log2, kv_scale, Out, Lse, PartOut, PartLse, stride_o_b,
                  stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL, WRITE_LSE, S_MMA, O_MMA, RING,
                  TRANS_LOAD)),
            (_consume, (RIGHT, qn_smem, qr_smem, scale_smem, c_ring, pe_ring, vt, p_a, p_b, m_x, l_x, ready, empty, vt_ready,
                  vt_empty, m0_ready, m1_ready, pa_ready, pb_ready, l_done, head_block, seq, split, start, end,
                  num_heads, num_kv_splits, qk_scale_log2, kv_scale, Out, Lse, PartOut, PartLse, stride_o_b,
                  stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL, WRITE_LSE, S_MMA, O_MMA, RING,
                  TRANS_LOAD)),
            (_produce, (CDesc, PeDesc, page_row, stride_pt_p, start, end, c_ring, pe_ring, vt,
                    ready, empty, vt_ready, vt_empty, PAGE_SIZE, TMA_ROWS, CVT, TLOAD, RING, PAGE_AHEAD,
                    TRANS_LOAD, EARLY_COPIES)),
        ],
        [4, PRODUCER_WARPS],
        [CONSUMER_REGS, PRODUCER_REGS],
    )  # fmt: skip


def supports(kv_cache) -> str | None:
    """None where the kernel can take ``kv_cache`` (fp8, TMA copies), else what it needs."""
    if kv_cache.dtype not in FP8:
        return f"expected an fp8 cache (e4m3 or e5m2), got {kv_cache.dtype}"
    if tma_rows(kv_cache, BLOCK_N.value) is None:
        return (f"expected a cache TMA can copy (see mla_decode_wide_fp8.tma_rows), got shape {tuple(kv_cache.shape)},"
                f" strides {kv_cache.stride()}")  # fmt: skip
    return None


def launch_arguments(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse, *,
                     q_scale, qk_scale_log2, kv_scale, num_kv_splits, write_partial, write_lse, min_split,
                     block_n=BLOCK_N.value, fp8_values=True, ring=RING, value_bufs=None, tma=None,
                     pipelined=None):  # fmt: skip
    """``(grid, args, kwargs)`` of one launch over ``[head blocks of 64, splits, sequences]`` (the arguments as
    ``mla_decode_wide_fp8.launch_arguments``'; the kernel's own form: 64-key tiles, fp8 values in its two buffers,
    TMA copies, its consumers' order, so ``value_bufs`` is not used and ``tma``, ``pipelined`` may only agree)."""
    check_form(kv_cache, block_n, fp8_values, tma, pipelined, ring, shared_bytes(ring), RING)
    grid, args, kwargs = tma_launch(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse,
                                    (q_scale, qk_scale_log2, kv_scale, num_kv_splits), write_partial, write_lse,
                                    min_split, seesaw_constexprs(ring, PAGE_AHEAD, TRANS_LOAD, EARLY_COPIES,
                                                                 KEEP_QUERIES), NUM_WARPS)  # fmt: skip
    return grid, args, {**kwargs, "Q_ROWS": query_rows(q_nope.shape[1])}


def query_rows(num_heads: int) -> int:
    """The head rows a program of ``num_heads`` heads loads and rounds: 16 or 32 where a head block has no more
    (``ONE_PASS``), else the block's 64 in two passes."""
    if not ONE_PASS or num_heads > 32:
        return BLOCK_H.value
    return 16 if num_heads <= 16 else 32


def bf16_partials(part_out: torch.Tensor) -> torch.Tensor:
    """The bfloat16 partial outputs a split launch writes (``BF16_PARTIALS``): the first half of the contiguous float32
    buffer ``part_out``'s bytes, in its shape."""
    return part_out.view(-1).view(torch.bfloat16)[: part_out.numel()].view(part_out.shape)


def check_form(kv_cache, block_n, fp8_values, tma, pipelined, ring, ring_bytes, max_ring) -> None:
    """Refuse what a seesaw kernel does not run, with what it expects: another tile or form, a cache TMA cannot copy
    (:func:`supports`), a ring of ``ring`` slots (``ring_bytes`` of shared memory) past Hopper's shared memory."""
    if block_n != BLOCK_N.value or not fp8_values or tma is False or pipelined:
        raise ValueError(f"expected 64-key tiles, fp8 values, TMA copies and no pipelined consumers, got block_n="
                         f"{block_n}, fp8_values={fp8_values}, tma={tma}, pipelined={pipelined}")  # fmt: skip
    need = supports(kv_cache)
    if need:
        raise ValueError(need)
    if ring_bytes > HOPPER_SHARED:
        raise ValueError(f"expected a ring of at most {max_ring} slots (Hopper's shared memory), got {ring}")


def tma_launch(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse, scalars,
               write_partial, write_lse, min_split, const, num_warps):  # fmt: skip
    """``(grid, args, kwargs)`` of a seesaw kernel's launch: the portable kernel's arguments with the TMA descriptors
    of the cache's latent and rope (layouts ``C_8``, ``PE_8`` of ``const``) after its first three; ``scalars`` are
    ``(q_scale, qk_scale_log2, kv_scale, num_kv_splits)``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    batch, num_heads, _ = q_nope.shape
    grid = (-(-num_heads // BLOCK_H.value), scalars[3], batch)
    args = list(arguments(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse,
                          *scalars))  # fmt: skip
    rows = tma_rows(kv_cache, BLOCK_N.value)
    shape, strides = [kv_cache.shape[0] * kv_cache.shape[1], RANK + ROPE], [kv_cache.stride(1), 1]
    args[3:3] = [TensorDescriptor(kv_cache, shape, strides, [rows, RANK], const["C_8"]),
                 TensorDescriptor(kv_cache, shape, strides, [rows, ROPE], const["PE_8"])]  # fmt: skip
    kwargs = {"PAGE_SIZE": kv_cache.shape[1], "WRITE_PARTIAL": write_partial, "WRITE_LSE": write_lse,
              "MIN_SPLIT": min_split, **const, "TMA_ROWS": rows, "num_warps": num_warps,
              "maxnreg": PRODUCER_MAXNREG}  # fmt: skip
    return grid, tuple(args), kwargs


def launch(*args, **kwargs) -> None:
    """Launch the kernel (arguments as :func:`launch_arguments`)."""
    grid, args, kwargs = launch_arguments(*args, **kwargs)
    mla_decode_seesaw_kernel[grid](*args, **kwargs)
