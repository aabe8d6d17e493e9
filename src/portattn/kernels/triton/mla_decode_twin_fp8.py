"""MLA decode for 64-head blocks over an fp8 latent cache, each consuming warpgroup on every tile alone (Gluon).

The seesaw kernel (``mla_decode_seesaw_fp8``) computes each tile's scores once: its left warpgroup takes tile ``a``
of a pair, its right one tile ``b``, and each adds both tiles' value products to its half of the output. The two
must then agree on each row's maximum: the right one's softmax waits for the left one's maximum, and each one's
second value product for the other's probabilities, so a pair's two softmaxes run one after the other. On an H200
a 64-key tile took about 1.5 us a program, where its tensor work is about 0.4 us
(benchmarks/results/round61/NOTES.md).

Here both consuming warpgroups compute every tile's scores ``[64 heads, 64 keys]`` (an ``m64n64`` fp8 product each;
the scores' tensor work doubles, 18 of a tile's 26 ``m64n64k32`` products becoming 36 of 44), and each runs its own
online softmax, writes its own probabilities (e4m3 times ``P_FP8_SCALE``) and adds its own half of the output (256
latent dims, ``m64n256k32`` products of the values the producer transposed). They share the tiles and nothing else:
no maximum, probability or sum crosses between them, and their maxima and sums are the same numbers (the same
products and the same instructions on them).

Each warpgroup runs its tiles pipelined (``PIPELINED``, as FlashAttention-3's intra-warpgroup overlap): tile
``t + 1``'s score products are issued before tile ``t``'s value product, and its softmax runs while that product
does; each warpgroup has two probability buffers. The producer is the seesaw kernel's: TMA copies into a ring of
``RING`` fp8 slots (a slot released once both warpgroups' scores of it are done) and each tile's latent transposed
into one of two value buffers (released once both warpgroups' value products of it are done).

The queries, their rounding and the scores' two partial sums are the seesaw kernel's, so are the requirements
(:func:`supports`), the splits, the partial results and the merge.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .mla_decode_fp8_mma import RANK, ROPE, _barrier, _key_range, _store_result
from .mla_decode_seesaw_fp8 import (
    HOPPER_SHARED,
    _masked_scores,
    _produce,
    _scaled,
    check_form,
    seesaw_constexprs,
    supports,
    tma_launch,
)
from .mla_decode_wide import BLOCK_H, PRODUCER_WARPS, value_columns
from .mla_decode_wide_fp8 import P_FP8_SCALE, _issue_scores_folded, _queries_fp8, _scores, keys_as_operand

BLOCK_N = gl.constexpr(64)  # keys a tile
RING = 3  # fp8 tiles in flight
HALF = gl.constexpr(256)  # the latent dims a consuming warpgroup accumulates
PRODUCER_REGS = gl.constexpr(56)  # the producer's registers a thread; the right warpgroup's, the left's as seesaw's
CONSUMER_REGS = gl.constexpr(224)
NUM_WARPS = 4  # the default partition: the left warpgroup
# tile t + 1's scores issued before tile t's value product, its softmax beside that product
PIPELINED = True
# the probabilities stay in registers as the value product's operand (the values' keys reordered to match,
# mla_decode_wide_fp8.keys_as_operand), not stored into shared memory. Only without PIPELINED: with it ptxas has too
# few registers and serializes the products (its note C7512)
P_REGS = False

__all__ = ["HOPPER_SHARED", "PIPELINED", "launch", "launch_arguments", "shared_bytes", "supports", "twin_constexprs"]


@functools.cache
def twin_constexprs(ring: int = RING, pipelined: bool = True, p_regs: bool = False) -> dict:
    """The kernel's layout arguments (the seesaw kernel's: each partition one warpgroup), its overlap and where its
    probabilities go (``p_regs``: the value product's register operand, ``P_DOT``)."""
    const = seesaw_constexprs(ring)
    return {**const, "P_DOT": gl.DotOperandLayout(0, const["O_MMA"], 4), "PIPELINED": pipelined, "P_REGS": p_regs}


def shared_bytes(ring: int = RING) -> int:
    """Shared memory of the kernel's buffers, before Triton's scratch."""
    queries, tile = BLOCK_H.value * (RANK + ROPE), BLOCK_N.value * (RANK + ROPE)
    values, probabilities = 2 * RANK * BLOCK_N.value, 4 * BLOCK_H.value * BLOCK_N.value
    return queries + ring * tile + values + probabilities + 4 * BLOCK_H.value + 8 * (2 * ring + 4)


@gluon.jit
def _issue_tile_scores(t, qn_smem, qr_smem, c_ring, pe_ring, ready, S_MMA: gl.constexpr, RING: gl.constexpr):
    """Tile ``t``'s score products, issued once its bytes are in its ring slot."""
    slot = t % RING
    mbarrier.wait(ready.index(slot), (t // RING) & 1)
    return _issue_scores_folded(qn_smem, qr_smem, c_ring.index(slot), pe_ring.index(slot), BLOCK_N, S_MMA)


@gluon.jit
def _softmax(s, t, m_i, l_i, start, end, scale, p_buf, empty, S_MMA: gl.constexpr, P_DOT: gl.constexpr,
             RING: gl.constexpr, P_REGS: gl.constexpr):  # fmt: skip
    """Tile ``t``'s online softmax from its finished scores: its ring slot released (this warpgroup's share);
    ``(m_new, l_new, alpha, probabilities)``, the probabilities (times ``P_FP8_SCALE``, e4m3) the value product's
    register operand, keys reordered (``P_REGS``), or stored into ``p_buf`` for the tensor cores."""
    _barrier()  # every warp of the warpgroup has its scores: the slot's bytes are read
    mbarrier.arrive(empty.index(t % RING), count=1)
    s = _masked_scores(s, start + t * BLOCK_N, end, scale, S_MMA)
    m_new = gl.maximum(m_i, gl.max(s, 1))  # finite: every tile holds a key
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, 1)
    p8 = (p * P_FP8_SCALE).to(gl.float8e4nv)
    if P_REGS:
        return m_new, l_new, alpha, gl.convert_layout(keys_as_operand(p8, 1), P_DOT)
    else:
        p_buf.store(p8)
        fence_async_shared()
        _barrier()  # every warp's probabilities stored before the product reads them
        return m_new, l_new, alpha, p_buf


@gluon.jit
def _issue_values(t, SIDE: gl.constexpr, p, vt, vt_ready, acc):
    """Tile ``t``'s value product (probabilities ``p``, registers or shared memory) into this warpgroup's half of
    the output, issued once its values are transposed."""
    buf = t % 2
    mbarrier.wait(vt_ready.index(buf), (t // 2) & 1)
    return warpgroup_mma(p, vt.index(buf).slice(SIDE * HALF, HALF, dim=0).permute((1, 0)), acc, is_async=True)


@gluon.jit
def _values_done(t, acc, vt_empty):
    """Wait for this warpgroup's value products; tile ``t``'s value buffer released (its share). (Probabilities in
    registers are not among the wait's operands, which take no 8-bit tensor: ptxas keeps a product's registers
    until its wait, or serializes the products, which the compile test would see.)"""
    acc = warpgroup_mma_wait(0, deps=[acc])
    _barrier()  # every warp's products are done with the buffer
    mbarrier.arrive(vt_empty.index(t % 2), count=1)
    return acc


@gluon.jit
def _consume(SIDE: gl.constexpr, qn_smem, qr_smem, scale_smem, c_ring, pe_ring, vt, p_bufs, ready, empty, vt_ready,
             vt_empty, head_block, seq, split, start, end, num_heads, num_kv_splits, qk_scale_log2, kv_scale, Out, Lse,
             PartOut, PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL: gl.constexpr,
             WRITE_LSE: gl.constexpr, S_MMA: gl.constexpr, O_MMA: gl.constexpr, P_DOT: gl.constexpr,
             RING: gl.constexpr, PIPELINED: gl.constexpr, P_REGS: gl.constexpr):  # fmt: skip
    """A consuming warpgroup: every tile's scores and softmax, and its value products into dims ``[256 SIDE, 256
    SIDE + 256)``."""
    ROWS: gl.constexpr = gl.SliceLayout(1, S_MMA)
    scale = scale_smem.load(ROWS) * qk_scale_log2
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
    l_i = gl.zeros([BLOCK_H], gl.float32, ROWS)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, O_MMA)
    num_tiles = gl.cdiv(end - start, BLOCK_N)
    if PIPELINED:
        if num_tiles > 0:
            s = _scores(_issue_tile_scores(0, qn_smem, qr_smem, c_ring, pe_ring, ready, S_MMA, RING), 0)
            m_i, l_i, alpha, p = _softmax(s, 0, m_i, l_i, start, end, scale, p_bufs.index(2 * SIDE), empty, S_MMA,
                                          P_DOT, RING, P_REGS)  # fmt: skip
            for t in range(num_tiles - 1):
                parts = _issue_tile_scores(t + 1, qn_smem, qr_smem, c_ring, pe_ring, ready, S_MMA, RING)
                acc = _issue_values(t, SIDE, p, vt, vt_ready, acc)
                s = _scores(parts, 1)  # tile t's value product may still run
                m_i, l_i, alpha, p_next = _softmax(s, t + 1, m_i, l_i, start, end, scale,
                                                   p_bufs.index(2 * SIDE + (t + 1) % 2), empty, S_MMA, P_DOT, RING,
                                                   P_REGS)  # fmt: skip
                acc = _scaled(_values_done(t, acc, vt_empty), alpha, O_MMA)
                p = p_next
            acc = _issue_values(num_tiles - 1, SIDE, p, vt, vt_ready, acc)
            acc = _values_done(num_tiles - 1, acc, vt_empty)
    else:
        for t in range(num_tiles):
            s = _scores(_issue_tile_scores(t, qn_smem, qr_smem, c_ring, pe_ring, ready, S_MMA, RING), 0)
            m_i, l_i, alpha, p = _softmax(s, t, m_i, l_i, start, end, scale, p_bufs.index(2 * SIDE + t % 2), empty,
                                          S_MMA, P_DOT, RING, P_REGS)  # fmt: skip
            acc = _issue_values(t, SIDE, p, vt, vt_ready, _scaled(acc, alpha, O_MMA))
            acc = _values_done(t, acc, vt_empty)
    acc = value_columns(acc, HALF)  # the buffers' rows to dims
    rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    offs_h = head_block * BLOCK_H + gl.arange(0, BLOCK_H, rows)
    dims = SIDE * HALF + gl.arange(0, HALF, gl.SliceLayout(0, acc.type.layout))
    # both warpgroups store the LSE: the same number
    _store_result(acc, gl.convert_layout(m_i, rows), gl.convert_layout(l_i, rows), offs_h, dims, seq, split, start,
                  end, num_heads, num_kv_splits, kv_scale / P_FP8_SCALE, Out, Lse, PartOut, PartLse, stride_o_b,
                  stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL, WRITE_LSE)  # fmt: skip


@gluon.jit
def mla_decode_twin_kernel(
    QNope, QRope, KV, CDesc, PeDesc, PageTable, SeqLensK, Out, Lse, PartOut, PartLse,
    q_scale, qk_scale_log2, kv_scale, num_heads, num_kv_splits,
    stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
    stride_kv_page, stride_kv_slot, stride_pt_b, stride_pt_p,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    PAGE_SIZE: gl.constexpr, WRITE_PARTIAL: gl.constexpr, WRITE_LSE: gl.constexpr, MIN_SPLIT: gl.constexpr,
    S_MMA: gl.constexpr, O_MMA: gl.constexpr, Q_LOAD: gl.constexpr, C_8: gl.constexpr, PE_8: gl.constexpr,
    P_S: gl.constexpr, V_S: gl.constexpr, TLOAD: gl.constexpr, CVT: gl.constexpr, P_DOT: gl.constexpr,
    RING: gl.constexpr, TMA_ROWS: gl.constexpr, PIPELINED: gl.constexpr, P_REGS: gl.constexpr,
):  # fmt: skip
    """The two consuming warpgroups (the left the default partition) and the producer (a worker)."""
    head_block = gl.program_id(0)
    split = gl.program_id(1)
    seq = gl.program_id(2).to(gl.int64)
    start, end = _key_range(SeqLensK, seq, split, num_kv_splits, BLOCK_N, MIN_SPLIT)
    qn_smem, qr_smem, row_scale = _queries_fp8(QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h,
                                               stride_qr_b, stride_qr_h, q_scale, Q_LOAD, C_8, PE_8,
                                               True)  # fmt: skip
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    scale_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat, row_scale)
    c_ring = gl.allocate_shared_memory(KV.dtype.element_ty, [RING, BLOCK_N, 512], C_8)
    pe_ring = gl.allocate_shared_memory(KV.dtype.element_ty, [RING, BLOCK_N, 64], PE_8)
    vt = gl.allocate_shared_memory(KV.dtype.element_ty, [2, 512, BLOCK_N], V_S)
    p_bufs = gl.allocate_shared_memory(gl.float8e4nv, [4, BLOCK_H, BLOCK_N], P_S)  # two a warpgroup
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    vt_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    vt_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(RING):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=2)  # both warpgroups' scores
    for j in gl.static_range(2):
        mbarrier.init(vt_ready.index(j), count=1)
        mbarrier.init(vt_empty.index(j), count=2)  # both warpgroups' value products
    fence_async_shared()  # the queries' stores before the tensor cores read them
    _barrier()

    gl.warp_specialize(
        [
            (_consume, (0, qn_smem, qr_smem, scale_smem, c_ring, pe_ring, vt, p_bufs, ready, empty, vt_ready, vt_empty,
                        head_block, seq, split, start, end, num_heads, num_kv_splits, qk_scale_log2, kv_scale, Out,
                        Lse, PartOut, PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL,
                        WRITE_LSE, S_MMA, O_MMA, P_DOT, RING, PIPELINED, P_REGS)),
            (_consume, (1, qn_smem, qr_smem, scale_smem, c_ring, pe_ring, vt, p_bufs, ready, empty, vt_ready, vt_empty,
                        head_block, seq, split, start, end, num_heads, num_kv_splits, qk_scale_log2, kv_scale, Out,
                        Lse, PartOut, PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL,
                        WRITE_LSE, S_MMA, O_MMA, P_DOT, RING, PIPELINED, P_REGS)),
            (_produce, (CDesc, PeDesc, PageTable + seq * stride_pt_b, stride_pt_p, start, end, c_ring, pe_ring, vt,
                        ready, empty, vt_ready, vt_empty, PAGE_SIZE, TMA_ROWS, CVT, TLOAD, RING, P_REGS)),
        ],
        [4, PRODUCER_WARPS],
        [CONSUMER_REGS, PRODUCER_REGS],
    )  # fmt: skip


def launch_arguments(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse, *,
                     q_scale, qk_scale_log2, kv_scale, num_kv_splits, write_partial, write_lse, min_split,
                     block_n=BLOCK_N.value, fp8_values=True, ring=RING, value_bufs=None, tma=None,
                     pipelined=None):  # fmt: skip
    """``(grid, args, kwargs)`` of one launch, the arguments as ``mla_decode_seesaw_fp8.launch_arguments``' (its
    form: 64-key tiles, fp8 values, TMA copies; ``pipelined`` names the fp8-scores form's consumers and may only be
    unset or False; this kernel's own overlap is ``PIPELINED``)."""
    check_form(kv_cache, block_n, fp8_values, tma, pipelined, ring, shared_bytes(ring), RING)
    return tma_launch(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse,
                      (q_scale, qk_scale_log2, kv_scale, num_kv_splits), write_partial, write_lse, min_split,
                      twin_constexprs(ring, PIPELINED, P_REGS), NUM_WARPS)  # fmt: skip


def launch(*args, **kwargs) -> None:
    """Launch the kernel (arguments as :func:`launch_arguments`)."""
    grid, args, kwargs = launch_arguments(*args, **kwargs)
    mla_decode_twin_kernel[grid](*args, **kwargs)
