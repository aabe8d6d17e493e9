"""MLA decode for up to 32 heads over an fp8 latent cache, the heads on the products' narrow side (Gluon).

The seesaw kernels (``mla_decode_seesaw_fp8``, ``mla_decode_seesaw_vregs``) put the heads on the rows of their
products, and a warpgroup product has 64 rows: 17-32 heads take 64-head programs, the padding heads' scores,
softmax and value products computed and thrown away, so 17 heads cost about what 64 do (on an H100, 64 sequences
over 4096 keys: 0.069 ms against 0.077). Here both products are transposed, so the heads are their ``N`` side,
32 of them:

* the scores ``S^T = K Q^T`` (``[64 keys, 32 heads]``, ``m64n32k32`` fp8 products): the tile's latent and rope as
  the ring slot holds them (K-major), the e4m3 queries as :func:`mla_decode_wide_fp8._queries_fp8` stores them
  (K-major as the second operand); in two partial sums added in float32, as the seesaw kernel's;
* the output ``O^T = V^T P^T`` (``[256 dims, 32 heads]`` a consuming warpgroup): ``V^T`` from registers as
  ``mla_decode_seesaw_vregs`` loads and regroups it, ``P^T`` the probabilities' ``[heads, keys]`` buffers.

Each product is about half the work of the 64-head one, the softmax half the elements, the output accumulator
64 registers a thread. With the work that small, the two consuming warpgroups do not split the scores between them
as the seesaw kernel's do (each a tile of a pair, then an exchange of maxima and probabilities): each computes the
scores and probabilities of both tiles of a pair itself, both products issued before either is waited for, and
adds both tiles' value products to its 256 dims. So the two never wait for each other, and each warpgroup's chain
(scores, maximum, probabilities, value products) covers two tiles at once. A head's maximum over a pair's keys
crosses the warps of the warpgroup (the keys are the product's rows); the softmax's sums are kept a thread's share
at a time and added across the warps once, at the end. The producer only copies tiles (TMA) into a ring of ``RING``
slots (``mla_decode_seesaw_vregs._produce``), a slot released once both warpgroups have read it.

Requirements, splits, the partial outputs (bfloat16, ``mla_decode_seesaw_fp8.BF16_PARTIALS``) and the merge as the
seesaw kernel's.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from .mla_decode_fp8_mma import RANK, ROPE, _barrier, _key_range, _store_result
from .mla_decode_seesaw_fp8 import LEFT, RIGHT, check_form, supports, tma_launch
from .mla_decode_seesaw_vregs import HALF, HALF_N, _half_tile_values, _produce, _rows_to_dims, values_load
from .mla_decode_wide import PRODUCER_WARPS, nvmma
from .mla_decode_wide_fp8 import P_FP8_SCALE, PROMOTE_EVERY, _queries_fp8, _scores

BLOCK_N = gl.constexpr(64)  # keys a tile
HEADS = gl.constexpr(32)  # heads a program: the products' N
MAX_HEADS = HEADS.value  # more heads take the seesaw kernel's 64-head blocks
RING = 5  # fp8 tiles in flight
PRODUCER_REGS = gl.constexpr(24)  # TMA copies only
CONSUMER_REGS = gl.constexpr(240)
NUM_WARPS = 4  # the default partition: the left warpgroup

__all__ = ["MAX_HEADS", "launch", "launch_arguments", "narrow_constexprs", "shared_bytes", "supports"]


@functools.cache
def narrow_constexprs(ring: int = RING) -> dict:
    """The kernel's layout arguments (each partition one warpgroup)."""
    if ring < 2:
        raise ValueError(f"expected 2+ ring slots, got {ring}")
    ot = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEADS.value, 32])
    return {
        "ST_MMA": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEADS.value, 32]),
        "OT_MMA": ot,
        "V_DOT": gl.DotOperandLayout(operand_index=0, parent=ot, k_width=4),
        "V_LOAD": values_load(HALF_N.value),
        "Q_LOAD": gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0]),
        "C_8": nvmma(RANK, 8),
        "PE_8": nvmma(ROPE, 8),
        "P_S": nvmma(BLOCK_N.value, 8),  # [heads, keys] e4m3
        "RING": ring,
    }


def shared_bytes(ring: int = RING) -> int:
    """Shared memory of the kernel's buffers, before Triton's scratch."""
    queries, tile = HEADS.value * (RANK + ROPE), BLOCK_N.value * (RANK + ROPE)
    probabilities = 4 * HEADS.value * BLOCK_N.value  # two buffers a warpgroup
    return queries + ring * tile + probabilities + 4 * HEADS.value + 8 * 2 * ring


@gluon.jit
def _issue_scores(qn_smem, qr_smem, c_tile, pe_tile, ST_MMA: gl.constexpr):
    """A tile's transposed scores ``[keys, heads]`` in two partial sums (the latent's first ``PROMOTE_EVERY`` dims;
    its second and the rope), issued."""
    zero = gl.zeros([BLOCK_N, HEADS], gl.float32, ST_MMA)
    lo = warpgroup_mma(c_tile.slice(0, PROMOTE_EVERY, dim=1), qn_smem.slice(0, PROMOTE_EVERY, dim=1).permute((1, 0)),
                       zero, use_acc=False, is_async=True)  # fmt: skip
    hi = warpgroup_mma(c_tile.slice(PROMOTE_EVERY, PROMOTE_EVERY, dim=1),
                       qn_smem.slice(PROMOTE_EVERY, PROMOTE_EVERY, dim=1).permute((1, 0)), zero, use_acc=False,
                       is_async=True)  # fmt: skip
    return lo, warpgroup_mma(pe_tile, qr_smem.permute((1, 0)), hi, is_async=True)


@gluon.jit
def _masked_scores(s, tile_start, end, scale, ST_MMA: gl.constexpr):
    """A tile's scores ``[keys, heads]`` in base 2, keys from ``end`` on at -inf (only a sequence's last tile)."""
    s = s * scale[None, :]
    if tile_start + BLOCK_N > end:
        keys = tile_start + gl.arange(0, BLOCK_N, gl.SliceLayout(1, ST_MMA))
        s = gl.where(keys[:, None] < end, s, float("-inf"))
    return s


@gluon.jit
def _publish(p_a, p_b, p_own):
    """A pair's probabilities ``[keys, heads]`` (times ``P_FP8_SCALE``, e4m3) into the warpgroup's buffers ``p_own``
    (``[2, heads, keys]``), visible to its tensor cores on return."""
    p_own.index(0).store(gl.permute((p_a * P_FP8_SCALE).to(p_own.dtype), (1, 0)))
    p_own.index(1).store(gl.permute((p_b * P_FP8_SCALE).to(p_own.dtype), (1, 0)))
    fence_async_shared()
    _barrier()


@gluon.jit
def _tile_value_product(acc, c_ring, slot, p_smem, side: gl.constexpr, tile_start, end, ZERO_TAIL: gl.constexpr,
                        V_LOAD: gl.constexpr, V_DOT: gl.constexpr):  # fmt: skip
    """``acc + V^T P^T`` of a tile, two products of 32 keys (``mla_decode_seesaw_vregs._tile_value_product``'s),
    each taking its keys' columns of ``p_smem``."""
    v0 = _half_tile_values(c_ring, slot, 0, side, tile_start, end, ZERO_TAIL, V_LOAD, V_DOT)
    acc = warpgroup_mma(v0, p_smem.slice(0, HALF_N, dim=1).permute((1, 0)), acc, is_async=True)
    v1 = _half_tile_values(c_ring, slot, 1, side, tile_start, end, ZERO_TAIL, V_LOAD, V_DOT)
    return warpgroup_mma(v1, p_smem.slice(HALF_N, HALF_N, dim=1).permute((1, 0)), acc)


@gluon.jit
def _value_product(acc, c_ring, slot, p_smem, side: gl.constexpr, tile_start, end, empty_bar, V_LOAD: gl.constexpr,
                   V_DOT: gl.constexpr):  # fmt: skip
    """``acc + V^T P^T`` of a tile, done on return, the slot's ``empty_bar`` arrived (as
    ``mla_decode_seesaw_vregs._value_product``: the sequence's last tile masked in a branch of its own)."""
    if tile_start + BLOCK_N > end:
        acc = _tile_value_product(acc, c_ring, slot, p_smem, side, tile_start, end, True, V_LOAD, V_DOT)
    else:
        acc = _tile_value_product(acc, c_ring, slot, p_smem, side, tile_start, end, False, V_LOAD, V_DOT)
    _barrier()  # every warp's values read the slot
    mbarrier.arrive(empty_bar, count=1)
    return acc


@gluon.jit
def _consume(SIDE: gl.constexpr, qn_smem, qr_smem, scale_smem, c_ring, pe_ring, p_own, ready, empty, head_block,
             seq, split, start, end, num_heads, num_kv_splits, qk_scale_log2, kv_scale, Out, Lse, PartOut, PartLse,
             stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL: gl.constexpr,
             WRITE_LSE: gl.constexpr, ST_MMA: gl.constexpr, OT_MMA: gl.constexpr, V_LOAD: gl.constexpr,
             V_DOT: gl.constexpr, RING: gl.constexpr):  # fmt: skip
    """A consuming warpgroup: the whole softmax over a pair of tiles at a time (both tiles' scores issued before
    either is waited for), their value products into dims ``[256 SIDE, 256 SIDE + 256)``. Both warpgroups compute
    the same scores and probabilities, so neither waits for the other; the probabilities go to its own buffers
    ``p_own``. A pair's second tile past the sequence's end (an odd count) is scored from its ring slot as it lies
    (not waited for, masked to -inf) and not multiplied."""
    COLS: gl.constexpr = gl.SliceLayout(0, ST_MMA)  # a head's
    OUT_COLS: gl.constexpr = gl.SliceLayout(0, OT_MMA)
    scale = scale_smem.load(COLS) * qk_scale_log2
    m_i = gl.full([HEADS], float("-inf"), gl.float32, COLS)
    l_t = gl.zeros([BLOCK_N, HEADS], gl.float32, ST_MMA)  # the sums, a thread's share
    acc = gl.zeros([HALF, HEADS], gl.float32, OT_MMA)
    num_tiles = gl.cdiv(end - start, BLOCK_N)
    for i in range(gl.cdiv(num_tiles, 2)):
        a = 2 * i
        b = a + 1
        has_b = b < num_tiles
        mbarrier.wait(ready.index(a % RING), (a // RING) & 1)
        if has_b:
            mbarrier.wait(ready.index(b % RING), (b // RING) & 1)
        s_a = _issue_scores(qn_smem, qr_smem, c_ring.index(a % RING), pe_ring.index(a % RING), ST_MMA)
        s_b = _issue_scores(qn_smem, qr_smem, c_ring.index(b % RING), pe_ring.index(b % RING), ST_MMA)
        s_a = _masked_scores(_scores(s_a, 3), start + a * BLOCK_N, end, scale, ST_MMA)  # b's three may run
        s_b = _masked_scores(_scores(s_b, 0), start + b * BLOCK_N, end, scale, ST_MMA)
        m_new = gl.maximum(m_i, gl.max(gl.maximum(s_a, s_b), 0))  # finite: tile a holds a key
        alpha = gl.exp2(m_i - m_new)
        p_a = gl.exp2(s_a - m_new[None, :])
        p_b = gl.exp2(s_b - m_new[None, :])
        l_t = l_t * alpha[None, :] + p_a + p_b
        _publish(p_a, p_b, p_own)
        acc = acc * gl.convert_layout(alpha, OUT_COLS)[None, :]
        acc = _value_product(acc, c_ring, a % RING, p_own.index(0), SIDE, start + a * BLOCK_N, end,
                             empty.index(a % RING), V_LOAD, V_DOT)  # fmt: skip
        if has_b:
            acc = _value_product(acc, c_ring, b % RING, p_own.index(1), SIDE, start + b * BLOCK_N, end,
                                 empty.index(b % RING), V_LOAD, V_DOT)  # fmt: skip
        m_i = m_new
    l_i = gl.sum(l_t, 0)  # a thread's share added across the warpgroup: the same in both warpgroups
    out = _rows_to_dims(acc)  # [heads, 256 dims]
    rows: gl.constexpr = gl.SliceLayout(1, out.type.layout)
    offs_h = head_block * HEADS + gl.arange(0, HEADS, rows)
    dims = SIDE * HALF + gl.arange(0, HALF, gl.SliceLayout(0, out.type.layout))
    _store_result(out, gl.convert_layout(m_i, rows), gl.convert_layout(l_i, rows), offs_h, dims, seq, split, start,
                  end, num_heads, num_kv_splits, kv_scale / P_FP8_SCALE, Out, Lse, PartOut, PartLse, stride_o_b,
                  stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL, WRITE_LSE)  # fmt: skip


@gluon.jit
def mla_decode_narrow_kernel(
    QNope, QRope, KV, CDesc, PeDesc, PageTable, SeqLensK, Out, Lse, PartOut, PartLse,
    q_scale, qk_scale_log2, kv_scale, num_heads, num_kv_splits,
    stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
    stride_kv_page, stride_kv_slot, stride_pt_b, stride_pt_p,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    PAGE_SIZE: gl.constexpr, WRITE_PARTIAL: gl.constexpr, WRITE_LSE: gl.constexpr, MIN_SPLIT: gl.constexpr,
    ST_MMA: gl.constexpr, OT_MMA: gl.constexpr, V_DOT: gl.constexpr, V_LOAD: gl.constexpr, Q_LOAD: gl.constexpr,
    C_8: gl.constexpr, PE_8: gl.constexpr, P_S: gl.constexpr, RING: gl.constexpr, TMA_ROWS: gl.constexpr,
):  # fmt: skip
    """The left consuming warpgroup (the default partition), the right one and the producer (workers)."""
    head_block = gl.program_id(0)
    split = gl.program_id(1)
    seq = gl.program_id(2).to(gl.int64)
    start, end = _key_range(SeqLensK, seq, split, num_kv_splits, BLOCK_N, MIN_SPLIT)
    qn_smem, qr_smem, row_scale = _queries_fp8(QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h,
                                               stride_qr_b, stride_qr_h, q_scale, Q_LOAD, C_8, PE_8, True,
                                               HEADS)  # fmt: skip
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    scale_smem = gl.allocate_shared_memory(gl.float32, [HEADS], flat, row_scale)
    c_ring = gl.allocate_shared_memory(KV.dtype.element_ty, [RING, BLOCK_N, 512], C_8)
    pe_ring = gl.allocate_shared_memory(KV.dtype.element_ty, [RING, BLOCK_N, 64], PE_8)
    p_left = gl.allocate_shared_memory(gl.float8e4nv, [2, HEADS, BLOCK_N], P_S)  # a pair's, each warpgroup's own
    p_right = gl.allocate_shared_memory(gl.float8e4nv, [2, HEADS, BLOCK_N], P_S)
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(RING):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=2)  # both warpgroups' scores and values read
    fence_async_shared()  # the queries' stores before the tensor cores read them
    _barrier()

    gl.warp_specialize(
        [
            (_consume, (LEFT, qn_smem, qr_smem, scale_smem, c_ring, pe_ring, p_left, ready, empty, head_block, seq,
                        split, start, end, num_heads, num_kv_splits, qk_scale_log2, kv_scale, Out, Lse, PartOut,
                        PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL, WRITE_LSE,
                        ST_MMA, OT_MMA, V_LOAD, V_DOT, RING)),
            (_consume, (RIGHT, qn_smem, qr_smem, scale_smem, c_ring, pe_ring, p_right, ready, empty, head_block, seq,
                        split, start, end, num_heads, num_kv_splits, qk_scale_log2, kv_scale, Out, Lse, PartOut,
                        PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL, WRITE_LSE,
                        ST_MMA, OT_MMA, V_LOAD, V_DOT, RING)),
            (_produce, (CDesc, PeDesc, PageTable + seq * stride_pt_b, stride_pt_p, start, end, c_ring, pe_ring,
                        ready, empty, PAGE_SIZE, TMA_ROWS, RING)),
        ],
        [4, PRODUCER_WARPS],
        [CONSUMER_REGS, PRODUCER_REGS],
    )  # fmt: skip


def launch_arguments(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse, *,
                     q_scale, qk_scale_log2, kv_scale, num_kv_splits, write_partial, write_lse, min_split,
                     block_n=BLOCK_N.value, fp8_values=True, ring=None, value_bufs=None, tma=None,
                     pipelined=None):  # fmt: skip
    """``(grid, args, kwargs)`` of one launch over ``[head blocks of 32, splits, sequences]`` (the arguments as
    ``mla_decode_seesaw_fp8.launch_arguments``'; the ring's slots are this kernel's ``RING`` where ``ring`` is None
    or the other forms' 3)."""
    ring = RING if ring in (None, 3) else ring
    check_form(kv_cache, block_n, fp8_values, tma, pipelined, ring, shared_bytes(ring), RING)
    return tma_launch(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse,
                      (q_scale, qk_scale_log2, kv_scale, num_kv_splits), write_partial, write_lse, min_split,
                      narrow_constexprs(ring), NUM_WARPS, HEADS.value)  # fmt: skip


def launch(*args, **kwargs) -> None:
    """Launch the kernel (arguments as :func:`launch_arguments`)."""
    grid, args, kwargs = launch_arguments(*args, **kwargs)
    mla_decode_narrow_kernel[grid](*args, **kwargs)
