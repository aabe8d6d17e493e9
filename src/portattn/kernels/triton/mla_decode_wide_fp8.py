"""MLA decode for 64-head blocks over an fp8 latent cache with fp8 scores (Gluon, Hopper's warpgroup MMA).

The warp-specialized wide kernel (``mla_decode_wide.py``) converts every fp8 tile to float16 in registers on its
way into shared memory, so its producer warpgroup holds the bytes it has in flight in registers. Measured on an
H100 (64 sequences over 4096 keys, 64 heads), that producer alone, with no consumer, takes 0.100 ms: 1.5 TB/s in
fp8 bytes, while its consumers alone take 0.084. This form lets the tiles arrive without registers and converts
only what has to be converted:

* The queries are quantized to e4m3 once a program, each head's row by its own power of two (taking its largest
  magnitude into [128, 256): exact products, so the rounding is the e4m3 cast's alone), and the scores
  ``[64 heads, BLOCK_N keys]`` are an fp8 product of those queries and the cache's tile as it lies (e4m3, or e5m2:
  the products take either operand), the row's scale folded into the softmax's.
* The producer warpgroup copies each tile into a ring of ``RING`` fp8 slots, and converts the tile's latent (the
  values, 512 dims) into one float16 buffer that the value product reads; the warpgroup MMA takes an fp8 operand
  only K-major, which the values ``[keys, dims]`` are not. The copies are TMA loads where the cache allows
  (:func:`tma_rows`: a tile in whole pages of 8+ keys, or pages of whole tiles, rows back to back): one
  descriptor of all the cache's rows, a page's share of a tile a box, the slot's mbarrier completed by their
  bytes; a page no key needs takes id -1, outside the descriptor (TMA fills zeros), and rows past the sequence's
  end (whatever a page holds there) are masked in the scores and stored as zeros by the conversion. Otherwise
  ``cp.async`` (16 bytes a lane, zeros past the end). On an H100 (64 sequences over 4096 keys) TMA copies took
  0.0958-0.0965 ms against 0.0973-0.1163 by ``cp.async`` at 64 heads (page 64 and 16), 0.1626-0.1639 against
  0.1646-0.1923 at 128 (benchmarks/results/round53/NOTES.md).
* The two consuming warpgroups run the wide kernel's step: the scores split by keys between them, the values by
  latent dims, the row maximum through shared memory.
* With ``fp8_values`` the value product is fp8 too: the producer transposes each tile's latent bytes into
  ``[512 dims, keys]`` buffers (K-major: 32 KB a 64-key tile instead of 64, so two fit beside a three-slot ring,
  or one beside four), and the probabilities go to e4m3 times ``P_FP8_SCALE`` (a relative 2^-4 each). With two
  values buffers the consumers may run pipelined (``PIPELINED``): tile t+1's scores issued with tile t's value
  product, and its softmax while that product runs. Until round 57 both were slower: at 64 heads the fp8 value
  product took 0.1054-0.1069 ms, pipelined 0.0996-0.1000, against 0.0958-0.0982 for float16 values (128 heads:
  0.1796-0.1804, 0.1712-0.1722, 0.1626-0.1664). The transposition now reads rows and regroups bytes in registers
  (:func:`transposing_load`, the values' rows permuted, ``mla_decode_wide.value_columns``), and fp8 values are the
  launcher's default where each program has many tiles (``mla_decode_launch.WIDE_FP8_VALUES_TILES``), in the seesaw
  kernel (``SEESAW``) where TMA copies the cache: on an H100 (64 sequences over 4096 keys) 128 heads took 0.1079 ms
  against 0.1455 for float16 values and 0.1658 for the bf16 cache (benchmarks/results/round57/NOTES.md).
  Pipelined consumers over float16 values (one buffer) were slower still (0.1028 ms at 64 heads, 0.1785 at 128;
  benchmarks/results/round54/NOTES.md): tile t+1's conversion waits for tile t's value product, and tile t+1's
  product for that conversion.

Since round 56 (benchmarks/results/round56/NOTES.md) no product of the kernel waits for the one before (ptxas had
serialized them all: the scores' promotion read unfinished products' registers) and the producer's float16 stores
take one wavefront a line: on an H100 (64 sequences over 4096 keys, page 64) 64 heads took 0.0876-0.0891 ms,
1.40-1.42x the bf16 cache, and 128 heads 0.1447-0.1448 ms, 1.15x.

Precision: the scores carry the queries' e4m3 rounding (3 mantissa bits, as the cache's own) and the tensor
cores' fp8 accumulation. With float16 values the value product is a float16 one as in the other forms; with fp8
values the probabilities are rounded to e4m3 (times ``P_FP8_SCALE``, a relative 2^-4 each). The GPU tests hold the
output to a reference whose queries are quantized the same way (with fp8 values, within a bound that adds the
probabilities' rounding), and compare its error against the error the fp8 cache itself brings.

Requirements as ``mla_decode_wide.supports`` with an fp8 cache. Splits, partial results and the merge are the
portable kernel's.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .mla_decode_fp8_mma import RANK, ROPE, _barrier, _copy_tile, _key_range, arguments
from .mla_decode_wide import (
    BLOCK_H,
    FP8,
    NUM_WARPS,
    PRODUCER_MAXNREG,
    PRODUCER_WARPS,
    _finish,
    _row_max,
    constexprs,
    nvmma,
)

RING = 3  # fp8 tiles in flight, by default
# the consumers pipelined (tile t+1's scores and softmax beside tile t's value product; the probabilities in two
# buffers)
PIPELINED = False
TMA = True  # the tiles copied by TMA where the cache allows (``tma_rows``), else by cp.async
# fp8 values in 64-key tiles: the launcher takes mla_decode_seesaw_fp8 (the consuming warpgroups on alternate tiles)
# instead, where the cache takes TMA copies
SEESAW = True
# the seesaw kernel's value products read from registers (mla_decode_seesaw_vregs: no transposition by the producer);
# on an H200 1-3% faster at one split, 5-15% slower with more (benchmarks/results/round61/NOTES.md)
SEESAW_VREGS = False
P_FP8_SCALE = gl.constexpr(256.0)  # fp8 values: the probabilities (at most 1) times this in e4m3
# The tensor cores sum fp8 products keeping about 14 bits; the scores' sums are added into float32 every
# PROMOTE_EVERY dims (two-level accumulation, as DeepSeek-V3's fp8 GEMMs): on an H100 (64 sequences over 4096 keys)
# the LSE's error against the float64 reference of the same queries fell from 1.1e-4-1.4e-3 (no promotion) to
# 5e-5-2.1e-4 (every 128 dims; benchmarks/results/round52/NOTES.md). Each partial sum is its own product's
# accumulator, added once all are done (_issue_scores, _scores): asking the product to promote
# (``max_num_imprecise_acc``) made Triton add each partial sum right after issuing its product, an instruction
# reading an unfinished product's registers, and ptxas then serialized every product of the kernel (its note C7514,
# "wgmma.mma_async instructions are serialized"); with five accumulators a tile (every 128 dims) ptxas serialized
# them too, for want of registers (C7512); three compile without. Every 256 dims the LSE's error was 1.2e-4-3.1e-4
# (allowed 5e-4; benchmarks/results/round56/NOTES.md).
PROMOTE_EVERY = gl.constexpr(256)
assert 2 * PROMOTE_EVERY.value == RANK  # _issue_scores' two halves of the latent
# the producer's registers a thread (copies and the values' conversion); the consumers take the rest of
# PRODUCER_MAXNREG x 12 warps
PRODUCER_REGS_FP8_SCORES = gl.constexpr(88)


if hasattr(tma, "async_load"):  # TMA's load into shared memory (Triton 3.6: async_copy_global_to_shared)

    @gluon.jit
    def _tma_load(desc, coord, bar, smem):
        tma.async_load(desc, coord, bar, smem)

else:

    @gluon.jit
    def _tma_load(desc, coord, bar, smem):
        tma.async_copy_global_to_shared(desc, coord, bar, smem)


def transposing_load(block_n: int, warps: int = PRODUCER_WARPS.value) -> gl.DistributedLinearLayout:
    """How the producer loads a ``[block_n keys, 128 dims]`` fp8 chunk to transpose it (fp8 values): a warp reads a
    key's 128 bytes (4 a lane: one row of the swizzled tile, one wavefront), each thread ``block_n / warps`` keys of
    its 4 dims, the warps apart by keys. Transposed in registers (:func:`_convert_values`), a thread's keys of each
    dim are one 16-byte store (8 bytes for 32-key tiles) into the values buffer's row of that dim, and the lanes of
    a quarter warp write consecutive rows (``mla_decode_wide.value_columns``): in the 64-byte swizzled rows of
    64-key tiles, eight bank groups. Triton's ``gl.bank_conflicts`` finds no conflict in the load nor, at 64 keys,
    the store (at 32 keys one a wavefront), against 3 and 1 for round 56's layouts, whose exchange also took 16
    shuffles a chunk (benchmarks/results/round57/NOTES.md)."""
    keys = block_n.bit_length() - 1
    per_warp = keys - (warps.bit_length() - 1)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2]] + [[1 << i, 0] for i in range(per_warp)],
        lane_bases=[[0, 4], [0, 8], [0, 16], [0, 32], [0, 64]],
        warp_bases=[[1 << i, 0] for i in range(per_warp, keys)],
        block_bases=[],
        shape=[block_n, 128],
    )


@functools.cache
def fp8_scores_constexprs(block_n: int, fp8_values: bool = False, ring: int = RING, value_bufs: int = 1) -> dict:
    """The layout arguments for ``block_n`` keys a step, ``ring`` fp8 tiles in flight and ``value_bufs`` buffers of
    the values (``fp8_values``: transposed fp8 values and e4m3 probabilities for an fp8 value product, else
    float16 values)."""
    if block_n not in (32, 64) or ring < 2 or value_bufs not in (1, 2):
        raise ValueError(f"expected 32 or 64 keys a step, 2+ ring slots, 1 or 2 value buffers, got {block_n}, {ring},"
                         f" {value_bufs}")  # fmt: skip
    base = constexprs(block_n, 2, True)
    w = PRODUCER_WARPS.value
    return {
        "BLOCK_N": block_n,
        "S_MMA": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, block_n // 2, 32]),
        **{k: base[k] for k in ("Q_LOAD", "C_16", "ROWS_2", "ROWS_WG")},
        "O_MMA": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 32])
        if fp8_values
        else base["O_MMA"],
        "P_S": nvmma(block_n, 8) if fp8_values else base["P_16"],
        "V_S": nvmma(block_n, 8) if fp8_values else base["C_16"],  # [512, keys] fp8, or [keys, 512] float16
        "TLOAD": transposing_load(block_n),
        "RING": ring,
        "V_BUFS": value_bufs,
        "FP8_VALUES": fp8_values,
        "C_8": nvmma(RANK, 8),
        "PE_8": nvmma(ROPE, 8),
        # the producer's copies (16 bytes a lane: a key's latent a warp, the rope 4 lanes a key) and its
        # conversion of a [keys, 128] chunk of the latent
        "C_COPY": gl.BlockedLayout([1, 16], [1, 32], [w, 1], [1, 0]),
        "PE_COPY": gl.BlockedLayout([1, 16], [8, 4], [w, 1], [1, 0]),
        # eight values a lane: the 16-byte stores of a quarter warp (one phase of shared memory) fill one 128-byte
        # line of the float16 buffer, each a bank group of its own (sixteen a lane put a quarter warp's stores
        # two to a bank group: twice the wavefronts; benchmarks/results/round56/NOTES.md)
        "CVT": gl.BlockedLayout([1, 8], [2, 16], [w, 1], [1, 0]),
        "PRODUCER_REGS": PRODUCER_REGS_FP8_SCORES,
    }


def shared_bytes(block_n: int, fp8_values: bool = False, ring: int = RING, value_bufs: int = 1) -> int:
    """Shared memory of the kernel's buffers, before Triton's scratch."""
    queries, tile, width = BLOCK_H.value * (RANK + ROPE), block_n * (RANK + ROPE), 1 if fp8_values else 2
    values, probabilities = value_bufs * width * block_n * RANK, width * BLOCK_H.value * block_n
    return queries + ring * tile + values + probabilities + 4 * 2 * 64 + 8 * (2 * ring + 2 * value_bufs)


@gluon.jit
def _queries_fp8(QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
                 q_scale, Q_LOAD: gl.constexpr, C_8: gl.constexpr, PE_8: gl.constexpr,
                 RELOAD: gl.constexpr = False):  # fmt: skip
    """The queries times ``q_scale`` in e4m3, each row by its own power of two (its largest magnitude to [128,
    256)), in shared memory as the warpgroup MMA reads them (nope, rope), and the rows' scales (what a row's fp8
    values are multiplied by). ``RELOAD``: the second pass loads the queries again (volatile loads, which the
    compiler does not merge with the first pass's) rather than keeping them in registers."""
    qr, amax = _queries_amax(QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h, stride_qr_b,
                             stride_qr_h, q_scale, Q_LOAD)  # fmt: skip
    return _queries_store(QNope, qr, amax, seq, head_block, num_heads, stride_qn_b, stride_qn_h, q_scale, Q_LOAD, C_8,
                          PE_8, RELOAD)  # fmt: skip


@gluon.jit
def _query_pointers(QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
                    Q_LOAD: gl.constexpr, ROWS: gl.constexpr):  # fmt: skip
    """The addresses of the head block's first ``ROWS`` head rows' first 128 latent dims (``[ROWS, 128]``) and of their
    rope dims (``[ROWS, 64]``), and which of the rows are heads (``[ROWS, 1]``)."""
    offs_h = head_block * BLOCK_H + gl.arange(0, ROWS, gl.SliceLayout(1, Q_LOAD))
    h_ok = offs_h[:, None] < num_heads
    cols = gl.arange(0, 128, gl.SliceLayout(0, Q_LOAD))
    cols_pe = gl.arange(0, 64, gl.SliceLayout(0, Q_LOAD))
    qn_ptr = QNope + seq * stride_qn_b + offs_h[:, None] * stride_qn_h + cols[None, :]
    qr_ptr = QRope + seq * stride_qr_b + offs_h[:, None] * stride_qr_h + cols_pe[None, :]
    return qn_ptr, qr_ptr, h_ok


@gluon.jit
def _queries_amax(QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
                  q_scale, Q_LOAD: gl.constexpr, kept=None, KEEP: gl.constexpr = False):  # fmt: skip
    """:func:`_queries_fp8`'s first pass: the rope queries times ``q_scale`` (float32) and each head row's largest
    magnitude. ``KEEP``: the latent queries also stored as they came into ``kept`` (shared ``[BLOCK_H, 512]``), for the
    second pass to read there."""
    qn_ptr, qr_ptr, h_ok = _query_pointers(QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h,
                                           stride_qr_b, stride_qr_h, Q_LOAD, BLOCK_H)  # fmt: skip
    qr = gl.load(qr_ptr, mask=h_ok, other=0.0)
    qr = qr.to(gl.float32) * q_scale
    amax = gl.max(gl.abs(qr), 1)
    for c in gl.static_range(4):  # a quarter at a time (registers)
        qn = gl.load(qn_ptr + 128 * c, mask=h_ok, other=0.0)
        amax = gl.maximum(amax, gl.max(gl.abs(qn.to(gl.float32)), 1) * q_scale)
        if KEEP:
            kept.slice(128 * c, 128, dim=1).store(qn)
    return qr, amax


@gluon.jit
def _row_scales(amax):
    """Each row's power of two from its largest magnitude ``amax``: what its values are multiplied by on their way to
    e4m3 (``to_fp8``) and what its e4m3 values stand for a unit of (``row_scale``)."""
    # a power of two (exact products, the rounding as any IEEE float to e4m3; ``448 / amax`` divides
    # approximately): with amax in [2^E, 2^(E+1)) the row's values go to [-256, 256), 2^(7 - E) times themselves
    exponent = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF  # E + 127
    exponent = gl.where(amax > 0.0, exponent, 127)  # a row of zeros (or a padding head): scale 1
    exponent = gl.minimum(gl.maximum(exponent, 8), 254)  # both scales normal floats
    to_fp8 = ((261 - exponent) << 23).to(gl.float32, bitcast=True)
    row_scale = ((exponent - 7) << 23).to(gl.float32, bitcast=True)
    return to_fp8, row_scale


@gluon.jit
def _queries_store(QNope, qr, amax, seq, head_block, num_heads, stride_qn_b, stride_qn_h, q_scale,
                   Q_LOAD: gl.constexpr, C_8: gl.constexpr, PE_8: gl.constexpr, RELOAD: gl.constexpr, kept=None,
                   KEEP: gl.constexpr = False):  # fmt: skip
    """:func:`_queries_fp8`'s second pass: each row's power of two from its largest magnitude ``amax``, the queries
    (the latent part loaded again, or read from ``kept`` where the first pass kept it) rounded to e4m3 by it and
    stored."""
    ROWS: gl.constexpr = gl.SliceLayout(1, Q_LOAD)
    offs_h = head_block * BLOCK_H + gl.arange(0, BLOCK_H, ROWS)
    h_ok = offs_h[:, None] < num_heads
    cols = gl.arange(0, 128, gl.SliceLayout(0, Q_LOAD))
    qn_ptr = QNope + seq * stride_qn_b + offs_h[:, None] * stride_qn_h + cols[None, :]
    to_fp8, row_scale = _row_scales(amax)
    to_fp8 = to_fp8[:, None]
    qn_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, 512], C_8)
    for c in gl.static_range(4):
        if KEEP:  # each thread reads back what it stored (the same layout)
            qn = kept.slice(128 * c, 128, dim=1).load(Q_LOAD)
        else:
            qn = gl.load(qn_ptr + 128 * c, mask=h_ok, other=0.0, volatile=RELOAD)
        qn_smem.slice(128 * c, 128, dim=1).store((qn.to(gl.float32) * q_scale * to_fp8).to(gl.float8e4nv))
    qr_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, 64], PE_8, (qr * to_fp8).to(gl.float8e4nv))
    return qn_smem, qr_smem, row_scale


@gluon.jit
def _issue_tile(CDesc, PeDesc, page_row, stride_pt_p, tile_start, end, c_buf, pe_buf, bar, PAGE_SIZE: gl.constexpr,
                BLOCK_N: gl.constexpr, TMA_ROWS: gl.constexpr):  # fmt: skip
    """Start the TMA copies of the latent rows ``[tile_start, tile_start + BLOCK_N)``, ``TMA_ROWS`` rows of one page a
    copy, onto ``bar`` (its bytes expected). A page that no key before ``end`` needs takes id -1, whose rows lie
    outside the descriptor's rows: TMA fills them with zeros."""
    mbarrier.expect(bar, BLOCK_N * 576)  # the latent and its rope, a byte each; out-of-bounds rows count too
    for p in gl.static_range(BLOCK_N // TMA_ROWS):
        key = tile_start + p * TMA_ROWS
        page = gl.load(page_row + (key // PAGE_SIZE) * stride_pt_p, mask=key < end, other=-1)
        row = page * PAGE_SIZE + key % PAGE_SIZE
        _tma_load(CDesc, [row, 0], bar, c_buf.slice(p * TMA_ROWS, TMA_ROWS, dim=0))
        _tma_load(PeDesc, [row, 512], bar, pe_buf.slice(p * TMA_ROWS, TMA_ROWS, dim=0))


@gluon.jit
def _convert_values(c_tile, v_buf, tile_start, end, BLOCK_N: gl.constexpr, CVT: gl.constexpr, TLOAD: gl.constexpr,
                    FP8_VALUES: gl.constexpr, ZERO_TAIL: gl.constexpr):  # fmt: skip
    """The tile's latent into the value buffer: float16, or (``FP8_VALUES``) the fp8 bytes transposed to ``[dims,
    keys]``. ``ZERO_TAIL``: rows from ``end`` on may hold anything (TMA copies whole pages), so a tile that reaches
    past ``end`` stores zeros there (scores masked to -inf give probabilities of 0, and 0 x NaN is NaN)."""
    for c in gl.static_range(4):  # a [keys, 128] chunk at a time (registers)
        if FP8_VALUES:  # [keys, dims] -> [dims, keys], the bytes as they are
            x = c_tile.slice(128 * c, 128, dim=1).load(TLOAD)
            if ZERO_TAIL:
                keys = tile_start + gl.arange(0, BLOCK_N, gl.SliceLayout(1, TLOAD))
                x = gl.where((keys < end)[:, None], x, gl.zeros_like(x))
            # the chunk's dim 4 q + s to its row 32 s + q (value_columns), each lane's bytes regrouped in its registers
            x = gl.reshape(gl.permute(gl.reshape(gl.permute(x, (1, 0)), [32, 4, BLOCK_N]), (1, 0, 2)), [128, BLOCK_N])
            v_buf.slice(128 * c, 128, dim=0).store(x)
        else:
            x = c_tile.slice(128 * c, 128, dim=1).load(CVT).to(v_buf.dtype)
            if ZERO_TAIL:
                keys = tile_start + gl.arange(0, BLOCK_N, gl.SliceLayout(1, CVT))
                x = gl.where((keys < end)[:, None], x, 0.0)
            v_buf.slice(128 * c, 128, dim=1).store(x)


@gluon.jit
def _produce(KV, CDesc, PeDesc, page_row, stride_pt_p, stride_kv_page, stride_kv_slot, start, end, c_ring, pe_ring,
             v_bufs, ready, empty, v_ready, v_empty, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
             C_COPY: gl.constexpr, PE_COPY: gl.constexpr, CVT: gl.constexpr, TLOAD: gl.constexpr,
             RING: gl.constexpr, V_BUFS: gl.constexpr, FP8_VALUES: gl.constexpr,
             TMA: gl.constexpr, TMA_ROWS: gl.constexpr):  # fmt: skip
    """The producer: tiles copied ``RING`` ahead into the fp8 ring (``ready[slot]`` once landed, refilled after
    ``empty[slot]``: the consumers' scores of it), each tile's latent converted to float16 (or, ``FP8_VALUES``,
    transposed) into value buffer ``t % V_BUFS`` (``v_ready``) once the consumers' value product of that buffer's
    last tile is done (``v_empty``). ``TMA``: the copies are the tensor-memory accelerator's (whole pages, ``ready``
    completed by their bytes), else ``cp.async`` (zeros past ``end``)."""
    num_tiles = gl.cdiv(end - start, BLOCK_N)
    for j in gl.static_range(RING):
        if j < num_tiles:
            if TMA:
                _issue_tile(CDesc, PeDesc, page_row, stride_pt_p, start + j * BLOCK_N, end, c_ring.index(j),
                            pe_ring.index(j), ready.index(j), PAGE_SIZE, BLOCK_N, TMA_ROWS)  # fmt: skip
            else:
                _copy_tile(KV, page_row, stride_pt_p, stride_kv_page, stride_kv_slot, start + j * BLOCK_N, end,
                           c_ring.index(j), pe_ring.index(j), PAGE_SIZE, BLOCK_N, C_COPY, PE_COPY)  # fmt: skip
        if not TMA:
            cp.commit_group()
    for t in range(num_tiles):
        slot = t % RING
        tile_start = start + t * BLOCK_N
        if TMA:
            mbarrier.wait(ready.index(slot), (t // RING) & 1)  # tile t's bytes
        else:
            cp.wait_group(RING - 1)  # tile t, this thread's copies ...
            fence_async_shared()
            _barrier()  # ... and every producer thread's
            mbarrier.arrive(ready.index(slot), count=1)
        c_tile = c_ring.index(slot)
        buf = t % V_BUFS
        mbarrier.wait(v_empty.index(buf), ((t // V_BUFS) & 1) ^ 1)  # the value product of tile t - V_BUFS
        v_buf = v_bufs.index(buf)
        if TMA and tile_start + BLOCK_N > end:
            _convert_values(c_tile, v_buf, tile_start, end, BLOCK_N, CVT, TLOAD, FP8_VALUES, True)
        else:
            _convert_values(c_tile, v_buf, tile_start, end, BLOCK_N, CVT, TLOAD, FP8_VALUES, False)
        fence_async_shared()
        _barrier()
        mbarrier.arrive(v_ready.index(buf), count=1)
        mbarrier.wait(empty.index(slot), (t // RING) & 1)  # the consumers' scores of tile t
        ahead = t + RING
        if ahead < num_tiles:
            if TMA:
                _issue_tile(CDesc, PeDesc, page_row, stride_pt_p, start + ahead * BLOCK_N, end, c_tile,
                            pe_ring.index(slot), ready.index(slot), PAGE_SIZE, BLOCK_N, TMA_ROWS)  # fmt: skip
            else:
                _copy_tile(KV, page_row, stride_pt_p, stride_kv_page, stride_kv_slot, start + ahead * BLOCK_N, end,
                           c_tile, pe_ring.index(slot), PAGE_SIZE, BLOCK_N, C_COPY, PE_COPY)  # fmt: skip
        if not TMA:
            cp.commit_group()
    if not TMA:
        cp.wait_group(0)


@gluon.jit
def _issue_latent_halves(qn_smem, c_tile, zero):
    """The latent's two halves of a tile's fp8 scores (``PROMOTE_EVERY`` dims each), issued into accumulators of
    their own (``zero``: their shape and layout)."""
    lo = warpgroup_mma(qn_smem.slice(0, PROMOTE_EVERY, dim=1), c_tile.slice(0, PROMOTE_EVERY, dim=1).permute((1, 0)),
                       zero, use_acc=False, is_async=True)  # fmt: skip
    hi = warpgroup_mma(qn_smem.slice(PROMOTE_EVERY, PROMOTE_EVERY, dim=1),
                       c_tile.slice(PROMOTE_EVERY, PROMOTE_EVERY, dim=1).permute((1, 0)), zero, use_acc=False,
                       is_async=True)  # fmt: skip
    return lo, hi


@gluon.jit
def _issue_scores(qn_smem, qr_smem, c_tile, pe_tile, BLOCK_N: gl.constexpr, S_MMA: gl.constexpr):
    """A tile's fp8 scores, issued as three partial sums, each an fp8 product into its own accumulator: the
    latent's two halves and the rope; :func:`_scores` adds them in float32."""
    zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_MMA)
    lo, hi = _issue_latent_halves(qn_smem, c_tile, zero)
    return lo, hi, warpgroup_mma(qr_smem, pe_tile.permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _issue_scores_folded(qn_smem, qr_smem, c_tile, pe_tile, BLOCK_N: gl.constexpr, S_MMA: gl.constexpr):
    """:func:`_issue_scores` in two partial sums, the rope's products going on in the latent's second half's
    accumulator: for a kernel with fewer registers to spare."""
    lo, hi = _issue_latent_halves(qn_smem, c_tile, gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_MMA))
    return lo, warpgroup_mma(qr_smem, pe_tile.permute((1, 0)), hi, is_async=True)


@gluon.jit
def _scores(parts, PENDING: gl.constexpr):
    """A tile's scores from :func:`_issue_scores`' (or ``_issue_scores_folded``'s) partial sums, once done
    (``PENDING``: how many products issued after them may still run), added in float32."""
    parts = warpgroup_mma_wait(PENDING, deps=parts)
    s = parts[0]
    for k in gl.static_range(1, len(parts)):
        s = s + parts[k]
    return s


@gluon.jit
def _probabilities(s, tile_start, end, scale, m_i, max_smem, empty_bar, BLOCK_N: gl.constexpr, S_MMA: gl.constexpr,
                   ROWS_2: gl.constexpr):  # fmt: skip
    """A tile's online softmax: ``(p, alpha, m_new)``; its ring slot released (``empty_bar``) once both warpgroups'
    scores are read."""
    offs_n = tile_start + gl.arange(0, BLOCK_N, gl.SliceLayout(0, S_MMA))
    s = gl.where(offs_n[None, :] < end, s * scale[:, None], float("-inf"))
    m_new = gl.maximum(m_i, _row_max(s, max_smem, BLOCK_N, ROWS_2))  # a barrier: both warpgroups' scores done
    mbarrier.arrive(empty_bar, count=1)
    alpha = gl.exp2(m_i - m_new)
    return gl.exp2(s - m_new[:, None]), alpha, m_new


@gluon.jit
def _store_probabilities(p, p_smem, FP8_VALUES: gl.constexpr):
    """A tile's probabilities into shared memory: e4m3 times ``P_FP8_SCALE`` (fp8 values), else float16."""
    if FP8_VALUES:
        p_smem.store((p * P_FP8_SCALE).to(p_smem.dtype))
    else:
        p_smem.store(p.to(p_smem.dtype))


@gluon.jit
def _issue_values(p_smem, v_buf, acc, FP8_VALUES: gl.constexpr):
    """A tile's value product, issued: fp8 values lie ``[dims, keys]`` (K-major, as the fp8 product needs)."""
    if FP8_VALUES:
        acc = warpgroup_mma(p_smem, v_buf.permute((1, 0)), acc, is_async=True)
    else:
        acc = warpgroup_mma(p_smem, v_buf, acc, is_async=True)
    return acc


@gluon.jit
def _consume(qn_smem, qr_smem, row_scale, c_ring, pe_ring, v_bufs, p_smem, max_smem, ready, empty, v_ready, v_empty,
             start, end, qk_scale_log2, BLOCK_N: gl.constexpr, S_MMA: gl.constexpr, O_MMA: gl.constexpr,
             ROWS_2: gl.constexpr, ROWS_WG: gl.constexpr, RING: gl.constexpr, V_BUFS: gl.constexpr,
             FP8_VALUES: gl.constexpr):  # fmt: skip
    """The two consuming warpgroups: each tile's fp8 scores, online softmax and value product (float16, or fp8:
    the probabilities times ``P_FP8_SCALE`` in e4m3)."""
    scale = gl.convert_layout(row_scale, gl.SliceLayout(1, S_MMA)) * qk_scale_log2
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S_MMA))
    l_wg = gl.zeros([BLOCK_H, 2], gl.float32, ROWS_WG)  # the softmax's sum, per warpgroup
    acc = gl.zeros([BLOCK_H, 512], gl.float32, O_MMA)
    for t in range(gl.cdiv(end - start, BLOCK_N)):
        slot = t % RING
        mbarrier.wait(ready.index(slot), (t // RING) & 1)
        s = _issue_scores(qn_smem, qr_smem, c_ring.index(slot), pe_ring.index(slot), BLOCK_N, S_MMA)
        s = _scores(s, 0)
        p, alpha, m_new = _probabilities(s, start + t * BLOCK_N, end, scale, m_i, max_smem, empty.index(slot),
                                         BLOCK_N, S_MMA, ROWS_2)  # fmt: skip
        part = gl.convert_layout(gl.sum(gl.reshape(p, [BLOCK_H, 2, BLOCK_N // 2]), 2), ROWS_WG)  # in-warp
        l_wg = l_wg * gl.convert_layout(alpha, gl.SliceLayout(1, ROWS_WG))[:, None] + part
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_MMA))[:, None]
        _store_probabilities(p, p_smem, FP8_VALUES)
        fence_async_shared()
        _barrier()  # both warpgroups' probabilities
        buf = t % V_BUFS
        mbarrier.wait(v_ready.index(buf), (t // V_BUFS) & 1)
        acc = _issue_values(p_smem, v_bufs.index(buf), acc, FP8_VALUES)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _barrier()  # both warpgroups' value products
        mbarrier.arrive(v_empty.index(buf), count=1)
        m_i = m_new
    return acc, m_i, l_wg


@gluon.jit
def _consume_pipelined(qn_smem, qr_smem, row_scale, c_ring, pe_ring, v_bufs, p_bufs, max_smem, ready, empty, v_ready,
                       v_empty, start, end, qk_scale_log2, BLOCK_N: gl.constexpr, S_MMA: gl.constexpr,
                       O_MMA: gl.constexpr, ROWS_2: gl.constexpr, ROWS_WG: gl.constexpr, RING: gl.constexpr,
                       V_BUFS: gl.constexpr, FP8_VALUES: gl.constexpr):  # fmt: skip
    """The consumers pipelined: tile t+1's scores and tile t's value product issued together, tile t+1's softmax
    while that product runs (the probabilities in two buffers; the values fp8 in two buffers, or float16 in one)."""
    scale = gl.convert_layout(row_scale, gl.SliceLayout(1, S_MMA)) * qk_scale_log2
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S_MMA))
    l_wg = gl.zeros([BLOCK_H, 2], gl.float32, ROWS_WG)
    acc = gl.zeros([BLOCK_H, 512], gl.float32, O_MMA)
    num_tiles = gl.cdiv(end - start, BLOCK_N)
    if num_tiles > 0:
        mbarrier.wait(ready.index(0), 0)
        s = _issue_scores(qn_smem, qr_smem, c_ring.index(0), pe_ring.index(0), BLOCK_N, S_MMA)
        s = _scores(s, 0)
        p, alpha, m_i = _probabilities(s, start, end, scale, m_i, max_smem, empty.index(0), BLOCK_N, S_MMA, ROWS_2)
        l_wg = gl.convert_layout(gl.sum(gl.reshape(p, [BLOCK_H, 2, BLOCK_N // 2]), 2), ROWS_WG)
        _store_probabilities(p, p_bufs.index(0), FP8_VALUES)
        fence_async_shared()
        _barrier()  # both warpgroups' probabilities
    for t in range(num_tiles - 1):
        nxt = t + 1
        slot = nxt % RING
        mbarrier.wait(ready.index(slot), (nxt // RING) & 1)
        s = _issue_scores(qn_smem, qr_smem, c_ring.index(slot), pe_ring.index(slot), BLOCK_N, S_MMA)
        buf = t % V_BUFS
        mbarrier.wait(v_ready.index(buf), (t // V_BUFS) & 1)
        acc = _issue_values(p_bufs.index(t % 2), v_bufs.index(buf), acc, FP8_VALUES)
        s = _scores(s, 1)  # the scores (issued first); the value product runs on
        p, alpha, m_new = _probabilities(s, start + nxt * BLOCK_N, end, scale, m_i, max_smem, empty.index(slot),
                                         BLOCK_N, S_MMA, ROWS_2)  # fmt: skip
        part = gl.convert_layout(gl.sum(gl.reshape(p, [BLOCK_H, 2, BLOCK_N // 2]), 2), ROWS_WG)
        l_wg = l_wg * gl.convert_layout(alpha, gl.SliceLayout(1, ROWS_WG))[:, None] + part
        _store_probabilities(p, p_bufs.index(nxt % 2), FP8_VALUES)
        fence_async_shared()
        acc = warpgroup_mma_wait(0, deps=[acc])
        _barrier()  # both warpgroups' value products of tile t, and their probabilities of tile t + 1
        mbarrier.arrive(v_empty.index(buf), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_MMA))[:, None]
        m_i = m_new
    if num_tiles > 0:
        last = num_tiles - 1
        buf = last % V_BUFS
        mbarrier.wait(v_ready.index(buf), (last // V_BUFS) & 1)
        acc = _issue_values(p_bufs.index(last % 2), v_bufs.index(buf), acc, FP8_VALUES)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _barrier()
        mbarrier.arrive(v_empty.index(buf), count=1)
    return acc, m_i, l_wg


@gluon.jit
def _consumers(qn_smem, qr_smem, row_scale, c_ring, pe_ring, v_bufs, p_bufs, max_smem, ready, empty, v_ready, v_empty,
               start, end, qk_scale_log2, BLOCK_N: gl.constexpr, S_MMA: gl.constexpr, O_MMA: gl.constexpr,
               ROWS_2: gl.constexpr, ROWS_WG: gl.constexpr, RING: gl.constexpr, V_BUFS: gl.constexpr,
               FP8_VALUES: gl.constexpr, PIPE: gl.constexpr):  # fmt: skip
    """The consuming warpgroups' partition: pipelined (``PIPE``: ``p_bufs`` two) or not (``p_bufs`` one)."""
    if PIPE:
        acc, m_i, l_wg = _consume_pipelined(qn_smem, qr_smem, row_scale, c_ring, pe_ring, v_bufs, p_bufs, max_smem,
                                            ready, empty, v_ready, v_empty, start, end, qk_scale_log2, BLOCK_N,
                                            S_MMA, O_MMA, ROWS_2, ROWS_WG, RING, V_BUFS, FP8_VALUES)  # fmt: skip
    else:
        acc, m_i, l_wg = _consume(qn_smem, qr_smem, row_scale, c_ring, pe_ring, v_bufs, p_bufs.index(0), max_smem,
                                  ready, empty, v_ready, v_empty, start, end, qk_scale_log2, BLOCK_N, S_MMA, O_MMA,
                                  ROWS_2, ROWS_WG, RING, V_BUFS, FP8_VALUES)  # fmt: skip
    return acc, m_i, l_wg


@gluon.jit
def mla_decode_wide_fp8_kernel(
    QNope, QRope, KV, CDesc, PeDesc, PageTable, SeqLensK, Out, Lse, PartOut, PartLse,
    q_scale, qk_scale_log2, kv_scale, num_heads, num_kv_splits,
    stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
    stride_kv_page, stride_kv_slot, stride_pt_b, stride_pt_p,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    PAGE_SIZE: gl.constexpr, WRITE_PARTIAL: gl.constexpr, WRITE_LSE: gl.constexpr, MIN_SPLIT: gl.constexpr,
    BLOCK_N: gl.constexpr, S_MMA: gl.constexpr, O_MMA: gl.constexpr, Q_LOAD: gl.constexpr, C_16: gl.constexpr,
    P_S: gl.constexpr, V_S: gl.constexpr, ROWS_2: gl.constexpr, ROWS_WG: gl.constexpr, C_8: gl.constexpr,
    PE_8: gl.constexpr, C_COPY: gl.constexpr, PE_COPY: gl.constexpr, CVT: gl.constexpr, TLOAD: gl.constexpr,
    RING: gl.constexpr, V_BUFS: gl.constexpr, FP8_VALUES: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, TMA: gl.constexpr, TMA_ROWS: gl.constexpr, PIPE: gl.constexpr,
):  # fmt: skip
    """A producer warpgroup copies fp8 tiles and converts their values; the two consuming warpgroups (the default
    partition) take fp8 scores and float16 value products."""
    head_block = gl.program_id(0)
    split = gl.program_id(1)
    seq = gl.program_id(2).to(gl.int64)
    start, end = _key_range(SeqLensK, seq, split, num_kv_splits, BLOCK_N, MIN_SPLIT)
    qn_smem, qr_smem, row_scale = _queries_fp8(QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h,
                                               stride_qr_b, stride_qr_h, q_scale, Q_LOAD, C_8, PE_8)  # fmt: skip
    c_ring = gl.allocate_shared_memory(KV.dtype.element_ty, [RING, BLOCK_N, 512], C_8)
    pe_ring = gl.allocate_shared_memory(KV.dtype.element_ty, [RING, BLOCK_N, 64], PE_8)
    P_BUFS: gl.constexpr = 2 if PIPE else 1  # the probabilities' buffers
    if FP8_VALUES:
        v_bufs = gl.allocate_shared_memory(KV.dtype.element_ty, [V_BUFS, 512, BLOCK_N], V_S)
        p_bufs = gl.allocate_shared_memory(gl.float8e4nv, [P_BUFS, BLOCK_H, BLOCK_N], P_S)
    else:
        v_bufs = gl.allocate_shared_memory(gl.float16, [V_BUFS, BLOCK_N, 512], V_S)
        p_bufs = gl.allocate_shared_memory(gl.float16, [P_BUFS, BLOCK_H, BLOCK_N], P_S)
    max_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H, 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_BUFS, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_BUFS, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(RING):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    for j in gl.static_range(V_BUFS):
        mbarrier.init(v_ready.index(j), count=1)
        mbarrier.init(v_empty.index(j), count=1)
    fence_async_shared()  # the queries' stores before the tensor cores read them
    _barrier()

    acc, m_i, l_wg = gl.warp_specialize(
        [
            (_consumers, (qn_smem, qr_smem, row_scale, c_ring, pe_ring, v_bufs, p_bufs, max_smem, ready, empty,
                          v_ready, v_empty, start, end, qk_scale_log2, BLOCK_N, S_MMA, O_MMA, ROWS_2, ROWS_WG, RING,
                          V_BUFS, FP8_VALUES, PIPE)),
            (_produce, (KV, CDesc, PeDesc, PageTable + seq * stride_pt_b, stride_pt_p, stride_kv_page, stride_kv_slot,
                        start, end, c_ring, pe_ring, v_bufs, ready, empty, v_ready, v_empty, PAGE_SIZE, BLOCK_N,
                        C_COPY, PE_COPY, CVT, TLOAD, RING, V_BUFS, FP8_VALUES, TMA, TMA_ROWS)),
        ],
        [PRODUCER_WARPS],
        [PRODUCER_REGS],
    )  # fmt: skip
    if FP8_VALUES:
        kv_scale = kv_scale / P_FP8_SCALE
    _finish(acc, m_i, l_wg, head_block, seq, split, start, end, num_heads, num_kv_splits, kv_scale, Out, Lse, PartOut,
            PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL, WRITE_LSE, O_MMA,
            FP8_VALUES)  # fmt: skip


def tma_rows(kv_cache, block_n: int) -> int | None:
    """Rows a TMA copy takes (one page's share of a tile) where the cache allows TMA copies, else None: pages of a
    multiple of ``block_n`` keys or ``block_n`` a multiple of pages of 8+ keys (whole swizzle atoms), each row's
    latent contiguous, 16-byte aligned rows, pages back to back (one 2-D view of all rows)."""
    pages, page_size, width = kv_cache.shape
    rows = min(page_size, block_n)
    whole = page_size % block_n == 0 or (block_n % page_size == 0 and page_size % 8 == 0)
    flat = kv_cache.stride(2) == 1 and kv_cache.stride(0) == page_size * kv_cache.stride(1)
    aligned = kv_cache.stride(1) % 16 == 0 and kv_cache.data_ptr() % 16 == 0
    return rows if whole and flat and aligned and pages * page_size < 2**31 and width == RANK + ROPE else None


def launch_arguments(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse, *,
                     q_scale, qk_scale_log2, kv_scale, num_kv_splits, write_partial, write_lse, min_split,
                     block_n, fp8_values=False, ring=RING, value_bufs=1, tma=None, pipelined=None):  # fmt: skip
    """``(grid, args, kwargs)`` of one launch over ``[head blocks of 64, splits, sequences]`` (the arguments as
    ``mla_decode_wide.launch_arguments``'; ``tma``: the copies by TMA, None where :func:`tma_rows` allows and
    ``TMA``; ``pipelined``: the consumers pipelined, None where ``PIPELINED``)."""
    pipelined = PIPELINED if pipelined is None else pipelined
    if kv_cache.dtype not in FP8:
        raise ValueError(f"expected an fp8 cache (e4m3 or e5m2) for fp8 scores, got {kv_cache.dtype}")
    rows = tma_rows(kv_cache, block_n)
    if tma and rows is None:
        raise ValueError(f"expected a cache TMA can copy for tma=True (see tma_rows), got shape"
                         f" {tuple(kv_cache.shape)}, strides {kv_cache.stride()}")  # fmt: skip
    tma = TMA and rows is not None if tma is None else tma
    batch, num_heads, _ = q_nope.shape
    grid = (-(-num_heads // BLOCK_H.value), num_kv_splits, batch)
    args = list(arguments(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse,
                          q_scale, qk_scale_log2, kv_scale, num_kv_splits))  # fmt: skip
    const = fp8_scores_constexprs(block_n, fp8_values, ring, value_bufs)
    descriptors = [kv_cache, kv_cache]  # unused by cp.async copies
    if tma:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        shape, strides = [kv_cache.shape[0] * kv_cache.shape[1], RANK + ROPE], [kv_cache.stride(1), 1]
        descriptors = [TensorDescriptor(kv_cache, shape, strides, [rows, RANK], const["C_8"]),
                       TensorDescriptor(kv_cache, shape, strides, [rows, ROPE], const["PE_8"])]  # fmt: skip
    args[3:3] = descriptors
    kwargs = {"PAGE_SIZE": kv_cache.shape[1], "WRITE_PARTIAL": write_partial, "WRITE_LSE": write_lse,
              "MIN_SPLIT": min_split, **const, "TMA": tma, "TMA_ROWS": rows or 8, "PIPE": pipelined,
              "num_warps": NUM_WARPS,
              "maxnreg": PRODUCER_MAXNREG}  # fmt: skip
    return grid, tuple(args), kwargs


def launch(*args, **kwargs) -> None:
    """Launch the kernel (arguments as :func:`launch_arguments`)."""
    grid, args, kwargs = launch_arguments(*args, **kwargs)
    mla_decode_wide_fp8_kernel[grid](*args, **kwargs)
