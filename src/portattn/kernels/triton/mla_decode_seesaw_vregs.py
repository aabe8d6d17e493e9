"""The seesaw MLA kernel over an fp8 cache with its value products read from registers (Gluon).

``mla_decode_seesaw_fp8``'s producer transposes each tile's latent into ``[dims, keys]`` value buffers, because an
fp8 warpgroup product takes its shared-memory operands K-major only, and the consumers' value products then wait for
that transposition. Here each consuming warpgroup computes its half of the output transposed, ``O^T = V^T P^T``
(``[256 dims, 64 heads]``, ``m64n64k32`` products): ``V^T`` is the product's register operand, each thread loading
the bytes it needs from the tile as the ring slot holds it (8 dims of a key a load) and regrouping them in its
registers to the four keys of a dim each register of the operand holds (a 4x4 byte transpose, two ``prmt`` a
register); ``P^T`` is the probabilities' ``[heads, keys]`` buffer as it lies, K-major. The producer only copies
tiles (TMA) into a ring of ``RING`` slots, which take the value buffers' shared memory; a slot is released once both
warpgroups have read their values of it.

A thread's registers of the operand hold the output rows ``m = r + 8 a + 16 w + 64 b`` (``r`` its lane's row, ``a``
and ``b`` register bits, ``w`` its warp); row ``m`` is the latent dim ``a + 2 b + 8 r + 64 w`` of the warpgroup's
half (:func:`_values`), so a thread's eight dims of a key are one 8-byte load, and the output's rows are put back
in the dims' order in registers before the store.

The softmax is the seesaw kernel's (the left warpgroup's tile ``a`` sets ``m0``, the right's tile ``b`` ``m1``);
the output is rescaled by head, which is its column here, so each warpgroup passes its factors through a small
shared buffer of its own to the output's layout (:func:`_by_head`). Requirements, splits and merge as
``mla_decode_seesaw_fp8``'s.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
)

from .mla_decode_fp8_mma import RANK, ROPE, _barrier, _key_range, _store_result
from .mla_decode_seesaw_fp8 import _masked_scores, check_form, supports, tma_launch
from .mla_decode_wide import BLOCK_H, PRODUCER_WARPS, columns_first, nvmma
from .mla_decode_wide_fp8 import P_FP8_SCALE, _issue_scores_folded, _issue_tile, _queries_fp8, _scores

BLOCK_N = gl.constexpr(64)  # keys a tile
RING = 4  # fp8 tiles in flight
HALF = gl.constexpr(256)  # the latent dims a consuming warpgroup accumulates
HALF_N = gl.constexpr(32)  # the keys of a value product
PRODUCER_REGS = gl.constexpr(24)  # TMA copies only
CONSUMER_REGS = gl.constexpr(240)
NUM_WARPS = 4  # the default partition: the left warpgroup

__all__ = ["launch", "launch_arguments", "shared_bytes", "supports", "vregs_constexprs"]


def values_load(block_n: int = 64) -> gl.DistributedLinearLayout:
    """How a consuming warpgroup loads its ``[block_n keys, 256 dims]`` of a tile: 8 dims of a key a load (the
    register bits), a quarter warp's lanes four keys apart, a warp's 64 dims, the warps apart by 64 dims."""
    keys = [[1, 0], [2, 0]] + [[1 << i, 0] for i in range(4, block_n.bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], *keys],
        lane_bases=[[4, 0], [8, 0], [0, 8], [0, 16], [0, 32]],
        warp_bases=[[0, 64], [0, 128]],
        block_bases=[],
        shape=[block_n, 256],
    )


@functools.cache
def vregs_constexprs(ring: int = RING) -> dict:
    """The kernel's layout arguments (each partition one warpgroup)."""
    if ring < 2:
        raise ValueError(f"expected 2+ ring slots, got {ring}")
    ot = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H.value, 32])
    return {
        "S_MMA": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N.value, 32]),
        "OT_MMA": ot,
        "V_DOT": gl.DotOperandLayout(operand_index=0, parent=ot, k_width=4),
        "V_LOAD": values_load(HALF_N.value),
        "Q_LOAD": gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0]),
        "C_8": nvmma(RANK, 8),
        "PE_8": nvmma(ROPE, 8),
        "P_S": nvmma(HALF_N.value, 8),  # [heads, 32 keys] e4m3
        "RING": ring,
    }


def shared_bytes(ring: int = RING) -> int:
    """Shared memory of the kernel's buffers, before Triton's scratch."""
    queries, tile = BLOCK_H.value * (RANK + ROPE), BLOCK_N.value * (RANK + ROPE)
    probabilities = 4 * BLOCK_H.value * BLOCK_N.value
    floats = 9 * BLOCK_H.value  # the row scales; m0, m1; both sums; each warpgroup's two factors
    return queries + ring * tile + probabilities + 4 * floats + 8 * (2 * ring + 7)


# A 4x4 byte transpose: $4..$7 hold four dims of keys 0..3 each, $0..$3 the four keys of dims 0..3 each.
_TRANSPOSE_4X4 = gl.constexpr("""{
.reg .b32 t<4>;
prmt.b32 t0, $4, $5, 0x5140;
prmt.b32 t1, $6, $7, 0x5140;
prmt.b32 t2, $4, $5, 0x7362;
prmt.b32 t3, $6, $7, 0x7362;
prmt.b32 $0, t0, t1, 0x5410;
prmt.b32 $1, t0, t1, 0x7632;
prmt.b32 $2, t2, t3, 0x5410;
prmt.b32 $3, t2, t3, 0x7632;
}""")


@gluon.jit
def _keys_together(x):
    """``x`` (``[32 keys, 256 dims]`` as :func:`values_load` lays it) with each thread's bytes regrouped so that
    each register holds four keys of a dim (two ``prmt`` a register): the four keys' tensors go through
    :data:`_TRANSPOSE_4X4` four dims at a time, and the results are relabelled (a dim's position among its four is
    its key's, and the tensor's is the dim's)."""
    y = gl.permute(gl.reshape(x, [2, 2, 2, 2, 2, HALF]), (0, 1, 2, 5, 3, 4))  # [k16 k8 k4, dims, k2 k1]
    k_even, k_odd = gl.split(y)
    k0, k2 = gl.split(k_even)
    k1, k3 = gl.split(k_odd)
    d0, d1, d2, d3 = gl.inline_asm_elementwise(
        _TRANSPOSE_4X4, "=r,=r,=r,=r,r,r,r,r", [k0, k1, k2, k3], (x.dtype,) * 4, is_pure=True, pack=4
    )
    j = gl.join(gl.join(d0, d1), gl.join(d2, d3))  # [k16 k8 k4, 4 c + e, j0, j1]: key e of dim 4 c + j
    j = gl.reshape(j, [2, 2, 2, HALF // 4, 2, 2, 2, 2])
    return gl.reshape(gl.permute(j, (0, 1, 2, 4, 5, 3, 7, 6)), [HALF_N, HALF])


@gluon.jit
def _values(c_tile, side: gl.constexpr, key0, end, ZERO_TAIL: gl.constexpr, V_LOAD: gl.constexpr,
            V_DOT: gl.constexpr):  # fmt: skip
    """A warpgroup's ``V^T`` of 32 keys (``[256 rows, 32 keys]``, the product's register operand): its half of the
    latent loaded 8 dims of a key at a time, each dim's keys regrouped in the thread's registers. ``ZERO_TAIL``:
    keys from ``end`` on are zeros (TMA copies whole pages, whose rows past the sequence may hold anything)."""
    x = c_tile.slice(side * HALF, HALF, dim=1).load(V_LOAD)  # [keys, dims]
    if ZERO_TAIL:
        keys = key0 + gl.arange(0, HALF_N, gl.SliceLayout(1, V_LOAD))
        x = gl.where((keys < end)[:, None], x, gl.zeros_like(x))
    x = _keys_together(x)
    # dim d = a + 2 b + 8 r + 64 w (bits, lowest first: a b0 b1 r0 r1 r2 w0 w1) to row m = r + 8 a + 16 w + 64 b
    # (bits m0..m7 = r0 r1 r2 a w0 w1 b0 b1); reshaped, the highest bit first: [w1 w0 r2 r1 r0 b1 b0 a, keys]
    y = gl.reshape(gl.permute(x, (1, 0)), [2, 2, 2, 2, 2, 2, 2, 2, HALF_N])
    y = gl.permute(y, (5, 6, 0, 1, 7, 2, 3, 4, 8))  # [b1 b0 w1 w0 a r2 r1 r0, keys]
    return gl.convert_layout(gl.reshape(y, [HALF, HALF_N]), V_DOT)


@gluon.jit
def _half_tile_values(c_ring, slot, h: gl.constexpr, side: gl.constexpr, tile_start, end, ZERO_TAIL: gl.constexpr,
                      V_LOAD: gl.constexpr, V_DOT: gl.constexpr):  # fmt: skip
    """:func:`_values` of keys ``[32 h, 32 h + 32)`` of the tile in ring slot ``slot``."""
    c_tile = c_ring.index(slot).slice(h * HALF_N, HALF_N, dim=0)
    return _values(c_tile, side, tile_start + h * HALF_N, end, ZERO_TAIL, V_LOAD, V_DOT)


@gluon.jit
def _tile_value_product(acc, c_ring, slot, p_buf, parity, side: gl.constexpr, tile_start, end,
                        ZERO_TAIL: gl.constexpr, V_LOAD: gl.constexpr, V_DOT: gl.constexpr):  # fmt: skip
    """:func:`_value_product`'s two products."""
    v0 = _half_tile_values(c_ring, slot, 0, side, tile_start, end, ZERO_TAIL, V_LOAD, V_DOT)
    acc = warpgroup_mma(v0, p_buf.index(2 * parity).permute((1, 0)), acc, is_async=True)
    v1 = _half_tile_values(c_ring, slot, 1, side, tile_start, end, ZERO_TAIL, V_LOAD, V_DOT)
    return warpgroup_mma(v1, p_buf.index(2 * parity + 1).permute((1, 0)), acc)


@gluon.jit
def _value_product(acc, c_ring, slot, p_buf, parity, side: gl.constexpr, tile_start, end, empty_bar,
                   V_LOAD: gl.constexpr, V_DOT: gl.constexpr):  # fmt: skip
    """``acc + V^T P^T`` of a tile, done on return: two products of 32 keys (each operand 16 registers a thread),
    the second's operand loaded while the first runs and the second waited for at once (with both in flight, ptxas
    serialized every product of the kernel for want of registers); the slot's ``empty_bar`` arrived once both are
    read. The tile that reaches past the sequence's end (its last) takes the other branch, both halves masked: a
    branch that chose between masked and unmasked operands would join them byte by byte before the products and
    cost the regrouping's savings."""
    if tile_start + BLOCK_N > end:
        acc = _tile_value_product(acc, c_ring, slot, p_buf, parity, side, tile_start, end, True, V_LOAD, V_DOT)
    else:
        acc = _tile_value_product(acc, c_ring, slot, p_buf, parity, side, tile_start, end, False, V_LOAD, V_DOT)
    _barrier()  # every warp's values read the slot
    mbarrier.arrive(empty_bar, count=1)
    return acc


@gluon.jit
def _publish_halves(p, p_buf, parity, bar):
    """A tile's probabilities (times ``P_FP8_SCALE``, e4m3) into the two ``[heads, 32 keys]`` buffers of
    ``p_buf`` for pair ``parity``, ``bar`` arrived once every lane's stores are visible to the tensor cores."""
    p = (p * P_FP8_SCALE).to(p_buf.dtype)
    lo, hi = gl.split(gl.permute(gl.reshape(p, [BLOCK_H, 2, HALF_N]), (0, 2, 1)))
    p_buf.index(2 * parity).store(lo)
    p_buf.index(2 * parity + 1).store(hi)
    fence_async_shared()
    _barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _rows_to_dims(acc):
    """The transposed output ``[256 rows, heads]`` as ``[heads, 256 dims]`` (:func:`_values`' relabelling undone in
    registers), a thread's consecutive dims in consecutive registers for vector stores."""
    y = gl.reshape(acc, [2, 2, 2, 2, 2, 2, 2, 2, BLOCK_H])  # [b1 b0 w1 w0 a r2 r1 r0, heads]
    y = gl.permute(y, (2, 3, 5, 6, 7, 0, 1, 4, 8))  # [w1 w0 r2 r1 r0 b1 b0 a, heads]
    y = gl.permute(gl.reshape(y, [HALF, BLOCK_H]), (1, 0))
    return gl.convert_layout(y, columns_first(y.type.layout))


@gluon.jit
def _by_head(acc, factor, f_smem, HEADS: gl.constexpr):
    """``acc`` (``[rows, heads]``) times ``factor`` (a head's, in the scores' row layout), which reaches the output's
    columns through ``f_smem``."""
    f_smem.store(factor)
    _barrier()
    return acc * f_smem.load(HEADS)[None, :]


@gluon.jit
def _finish_half(acc, m_i, l_i, l_x, l_done, SIDE: gl.constexpr, head_block, seq, split, start, end, num_heads,
                 num_kv_splits, kv_scale, Out, Lse, PartOut, PartLse, stride_o_b, stride_o_h, stride_lse_b,
                 stride_lse_h, WRITE_PARTIAL: gl.constexpr, WRITE_LSE: gl.constexpr, S_MMA: gl.constexpr):  # fmt: skip
    """A warpgroup's half of the result: both warpgroups' sums added (through ``l_x``), its 256 dims normalised and
    stored."""
    l_x.slice(SIDE * BLOCK_H, BLOCK_H).store(l_i)
    _barrier()
    mbarrier.arrive(l_done, count=1)
    mbarrier.wait(l_done, 0)
    l_i = l_i + l_x.slice((1 - SIDE) * BLOCK_H, BLOCK_H).load(gl.SliceLayout(1, S_MMA))
    out = _rows_to_dims(acc)
    rows: gl.constexpr = gl.SliceLayout(1, out.type.layout)
    offs_h = head_block * BLOCK_H + gl.arange(0, BLOCK_H, rows)
    dims = SIDE * HALF + gl.arange(0, HALF, gl.SliceLayout(0, out.type.layout))
    _store_result(out, gl.convert_layout(m_i, rows), gl.convert_layout(l_i, rows), offs_h, dims, seq, split, start,
                  end, num_heads, num_kv_splits, kv_scale / P_FP8_SCALE, Out, Lse, PartOut, PartLse, stride_o_b,
                  stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL, WRITE_LSE)  # fmt: skip


@gluon.jit
def _left(qn_smem, qr_smem, scale_smem, c_ring, pe_ring, p_a, p_b, m_x, l_x, f_x, ready, empty, m0_ready, m1_ready,
          pa_ready, pb_ready, l_done, head_block, seq, split, start, end, num_heads, num_kv_splits, qk_scale_log2,
          kv_scale, Out, Lse, PartOut, PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
          WRITE_PARTIAL: gl.constexpr, WRITE_LSE: gl.constexpr, S_MMA: gl.constexpr, OT_MMA: gl.constexpr,
          V_LOAD: gl.constexpr, V_DOT: gl.constexpr, RING: gl.constexpr):  # fmt: skip
    """The left warpgroup: each pair's tile ``a`` (its scores, ``m0`` and ``p_a`` published), both tiles' products
    into dims [0, 256)."""
    ROWS: gl.constexpr = gl.SliceLayout(1, S_MMA)
    HEADS: gl.constexpr = gl.SliceLayout(0, OT_MMA)
    scale = scale_smem.load(ROWS) * qk_scale_log2
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
    l_i = gl.zeros([BLOCK_H], gl.float32, ROWS)
    acc = gl.zeros([HALF, BLOCK_H], gl.float32, OT_MMA)
    num_tiles = gl.cdiv(end - start, BLOCK_N)
    for i in range(gl.cdiv(num_tiles, 2)):
        a = 2 * i
        slot = a % RING
        mbarrier.wait(ready.index(slot), (a // RING) & 1)
        s = _issue_scores_folded(qn_smem, qr_smem, c_ring.index(slot), pe_ring.index(slot), BLOCK_N, S_MMA)
        s = _scores(s, 0)
        s = _masked_scores(s, start + a * BLOCK_N, end, scale, S_MMA)
        m0 = gl.maximum(m_i, gl.max(s, 1))  # finite: every tile holds a key
        m_x.slice(0, BLOCK_H).store(m0)
        _barrier()
        mbarrier.arrive(m0_ready, count=1)
        p = gl.exp2(s - m0[:, None])
        alpha = gl.exp2(m_i - m0)
        l_i = l_i * alpha + gl.sum(p, 1)
        _publish_halves(p, p_a, i % 2, pa_ready.index(i % 2))
        acc = _by_head(acc, alpha, f_x.slice(0, BLOCK_H), HEADS)
        acc = _value_product(acc, c_ring, slot, p_a, i % 2, 0, start + a * BLOCK_N, end,
                             empty.index(slot), V_LOAD, V_DOT)  # fmt: skip
        m_i = m0
        if a + 1 < num_tiles:  # tile b: rescaled to m1, its probabilities the right warpgroup's
            b = a + 1
            mbarrier.wait(m1_ready, i & 1)
            m1 = m_x.slice(BLOCK_H, BLOCK_H).load(ROWS)
            beta = gl.exp2(m0 - m1)
            l_i = l_i * beta
            acc = _by_head(acc, beta, f_x.slice(BLOCK_H, BLOCK_H), HEADS)
            mbarrier.wait(pb_ready.index(i % 2), (i // 2) & 1)
            mbarrier.wait(ready.index(b % RING), (b // RING) & 1)
            acc = _value_product(acc, c_ring, b % RING, p_b, i % 2, 0, start + b * BLOCK_N, end,
                                 empty.index(b % RING), V_LOAD, V_DOT)  # fmt: skip
            m_i = m1
    _finish_half(acc, m_i, l_i, l_x, l_done, 0, head_block, seq, split, start, end, num_heads, num_kv_splits,
                 kv_scale, Out, Lse, PartOut, PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
                 WRITE_PARTIAL, WRITE_LSE, S_MMA)  # fmt: skip


@gluon.jit
def _right(qn_smem, qr_smem, scale_smem, c_ring, pe_ring, p_a, p_b, m_x, l_x, f_x, ready, empty, m0_ready, m1_ready,
           pa_ready, pb_ready, l_done, head_block, seq, split, start, end, num_heads, num_kv_splits, qk_scale_log2,
           kv_scale, Out, Lse, PartOut, PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
           WRITE_PARTIAL: gl.constexpr, WRITE_LSE: gl.constexpr, S_MMA: gl.constexpr, OT_MMA: gl.constexpr,
           V_LOAD: gl.constexpr, V_DOT: gl.constexpr, RING: gl.constexpr):  # fmt: skip
    """The right warpgroup: each pair's tile ``b`` (its scores, ``m1`` and ``p_b`` published), both tiles' products
    into dims [256, 512)."""
    ROWS: gl.constexpr = gl.SliceLayout(1, S_MMA)
    HEADS: gl.constexpr = gl.SliceLayout(0, OT_MMA)
    scale = scale_smem.load(ROWS) * qk_scale_log2
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
    l_i = gl.zeros([BLOCK_H], gl.float32, ROWS)
    acc = gl.zeros([HALF, BLOCK_H], gl.float32, OT_MMA)
    num_tiles = gl.cdiv(end - start, BLOCK_N)
    for i in range(gl.cdiv(num_tiles, 2)):
        a = 2 * i
        b = a + 1
        has_b = b < num_tiles
        s = gl.full([BLOCK_H, BLOCK_N], float("-inf"), gl.float32, S_MMA)
        m_b = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
        if has_b:
            mbarrier.wait(ready.index(b % RING), (b // RING) & 1)
            s = _issue_scores_folded(qn_smem, qr_smem, c_ring.index(b % RING), pe_ring.index(b % RING), BLOCK_N,
                                     S_MMA)  # fmt: skip
            s = _scores(s, 0)
            s = _masked_scores(s, start + b * BLOCK_N, end, scale, S_MMA)
            m_b = gl.max(s, 1)
        mbarrier.wait(m0_ready, i & 1)
        m0 = m_x.slice(0, BLOCK_H).load(ROWS)
        m1 = gl.maximum(m0, m_b)
        alpha = gl.exp2(m_i - m0)
        beta = gl.exp2(m0 - m1)
        l_i = l_i * alpha
        if has_b:
            m_x.slice(BLOCK_H, BLOCK_H).store(m1)
            _barrier()
            mbarrier.arrive(m1_ready, count=1)
            p = gl.exp2(s - m1[:, None])
            l_i = l_i * beta + gl.sum(p, 1)
            _publish_halves(p, p_b, i % 2, pb_ready.index(i % 2))
        acc = _by_head(acc, alpha, f_x.slice(0, BLOCK_H), HEADS)
        mbarrier.wait(pa_ready.index(i % 2), (i // 2) & 1)
        mbarrier.wait(ready.index(a % RING), (a // RING) & 1)
        acc = _value_product(acc, c_ring, a % RING, p_a, i % 2, 1, start + a * BLOCK_N, end,
                             empty.index(a % RING), V_LOAD, V_DOT)  # fmt: skip
        if has_b:
            acc = _by_head(acc, beta, f_x.slice(BLOCK_H, BLOCK_H), HEADS)
            acc = _value_product(acc, c_ring, b % RING, p_b, i % 2, 1, start + b * BLOCK_N, end,
                                 empty.index(b % RING), V_LOAD, V_DOT)  # fmt: skip
        m_i = m1
    _finish_half(acc, m_i, l_i, l_x, l_done, 1, head_block, seq, split, start, end, num_heads, num_kv_splits,
                 kv_scale, Out, Lse, PartOut, PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
                 WRITE_PARTIAL, WRITE_LSE, S_MMA)  # fmt: skip


@gluon.jit
def _produce(CDesc, PeDesc, page_row, stride_pt_p, start, end, c_ring, pe_ring, ready, empty,
             PAGE_SIZE: gl.constexpr, TMA_ROWS: gl.constexpr, RING: gl.constexpr):  # fmt: skip
    """The producer: tiles copied by TMA ``RING`` ahead (``ready[slot]`` by their bytes), a slot refilled once both
    warpgroups have read it (``empty``)."""
    num_tiles = gl.cdiv(end - start, BLOCK_N)
    for j in gl.static_range(RING):
        if j < num_tiles:
            _issue_tile(CDesc, PeDesc, page_row, stride_pt_p, start + j * BLOCK_N, end, c_ring.index(j),
                        pe_ring.index(j), ready.index(j), PAGE_SIZE, BLOCK_N, TMA_ROWS)  # fmt: skip
    for t in range(num_tiles - RING):
        slot = t % RING
        mbarrier.wait(empty.index(slot), (t // RING) & 1)
        _issue_tile(CDesc, PeDesc, page_row, stride_pt_p, start + (t + RING) * BLOCK_N, end, c_ring.index(slot),
                    pe_ring.index(slot), ready.index(slot), PAGE_SIZE, BLOCK_N, TMA_ROWS)  # fmt: skip


@gluon.jit
def mla_decode_seesaw_vregs_kernel(
    QNope, QRope, KV, CDesc, PeDesc, PageTable, SeqLensK, Out, Lse, PartOut, PartLse,
    q_scale, qk_scale_log2, kv_scale, num_heads, num_kv_splits,
    stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
    stride_kv_page, stride_kv_slot, stride_pt_b, stride_pt_p,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    PAGE_SIZE: gl.constexpr, WRITE_PARTIAL: gl.constexpr, WRITE_LSE: gl.constexpr, MIN_SPLIT: gl.constexpr,
    S_MMA: gl.constexpr, OT_MMA: gl.constexpr, V_DOT: gl.constexpr, V_LOAD: gl.constexpr, Q_LOAD: gl.constexpr,
    C_8: gl.constexpr, PE_8: gl.constexpr, P_S: gl.constexpr, RING: gl.constexpr, TMA_ROWS: gl.constexpr,
):  # fmt: skip
    """The left consuming warpgroup (the default partition), the right one and the producer (workers)."""
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
    p_a = gl.allocate_shared_memory(gl.float8e4nv, [4, BLOCK_H, HALF_N], P_S)  # 2 x pair parity + key half
    p_b = gl.allocate_shared_memory(gl.float8e4nv, [4, BLOCK_H, HALF_N], P_S)
    m_x = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], flat)  # m0, m1
    l_x = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], flat)  # the sums, left and right
    f_left = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], flat)  # each side's rescaling factors
    f_right = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], flat)
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    pa_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pb_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    m0_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    m1_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    l_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for j in gl.static_range(RING):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=2)  # both warpgroups' values read
    for j in gl.static_range(2):
        mbarrier.init(pa_ready.index(j), count=1)
        mbarrier.init(pb_ready.index(j), count=1)
    mbarrier.init(m0_ready, count=1)
    mbarrier.init(m1_ready, count=1)
    mbarrier.init(l_done, count=2)
    fence_async_shared()  # the queries' stores before the tensor cores read them
    _barrier()

    gl.warp_specialize(
        [
            (_left, (qn_smem, qr_smem, scale_smem, c_ring, pe_ring, p_a, p_b, m_x, l_x, f_left, ready, empty,
                     m0_ready, m1_ready, pa_ready, pb_ready, l_done, head_block, seq, split, start, end, num_heads,
                     num_kv_splits, qk_scale_log2, kv_scale, Out, Lse, PartOut, PartLse, stride_o_b, stride_o_h,
                     stride_lse_b, stride_lse_h, WRITE_PARTIAL, WRITE_LSE, S_MMA, OT_MMA, V_LOAD, V_DOT, RING)),
            (_right, (qn_smem, qr_smem, scale_smem, c_ring, pe_ring, p_a, p_b, m_x, l_x, f_right, ready, empty,
                      m0_ready, m1_ready, pa_ready, pb_ready, l_done, head_block, seq, split, start, end, num_heads,
                      num_kv_splits, qk_scale_log2, kv_scale, Out, Lse, PartOut, PartLse, stride_o_b, stride_o_h,
                      stride_lse_b, stride_lse_h, WRITE_PARTIAL, WRITE_LSE, S_MMA, OT_MMA, V_LOAD, V_DOT, RING)),
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
    """``(grid, args, kwargs)`` of one launch (the arguments as ``mla_decode_seesaw_fp8.launch_arguments``'; the
    ring's slots are this kernel's ``RING`` where ``ring`` is None or the other forms' 3)."""
    ring = RING if ring in (None, 3) else ring
    check_form(kv_cache, block_n, fp8_values, tma, pipelined, ring, shared_bytes(ring), RING)
    return tma_launch(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse,
                      (q_scale, qk_scale_log2, kv_scale, num_kv_splits), write_partial, write_lse, min_split,
                      vregs_constexprs(ring), NUM_WARPS)  # fmt: skip


def launch(*args, **kwargs) -> None:
    """Launch the kernel (arguments as :func:`launch_arguments`)."""
    grid, args, kwargs = launch_arguments(*args, **kwargs)
    mla_decode_seesaw_vregs_kernel[grid](*args, **kwargs)
