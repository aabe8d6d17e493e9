"""MLA decode for 64-head blocks on Hopper's warpgroup MMA, over a 16-bit or an fp8 latent cache (Gluon).

Many heads (DeepSeek-V3's 128 on one GPU) make MLA decode compute-bound: each latent row feeds a tall matrix
product. The portable kernel (``mla_decode.py``) gives such heads 64-head blocks on eight warps, and Triton's
``tl`` places the warps of a chained product along its rows (so that the softmax's reductions stay inside a
warp): with 64 rows on two warpgroups, both warpgroups compute the same scores. Compiled for sm_90 by Triton
3.6 (64 heads, 32 keys a step) each warpgroup issues 72 ``m64n16k16`` MMAs for the scores, every one reading
its 2 KB of queries from shared memory again, against 2 ``m64n256k16`` for the values: the scores take about
nine tenths of the MMAs' shared-memory reads, and half of them are duplicates.

Here the layouts are written out (Triton's Gluon dialect):

* The scores ``[64 heads, BLOCK_N keys]`` are split by keys between the two warpgroups (``m64n{BLOCK_N/2}``,
  no duplicate), the values ``[64, 512]`` by latent dims (``m64n256``, 128 accumulator registers a thread);
  the row maximum crosses the warpgroups through shared memory (one barrier), the probabilities go through
  shared memory to both.
* The queries stay in shared memory (Hopper's tensor-core layout), the latent tile arrives by ``cp.async``
  (16 bytes a lane, ``STAGES`` buffers), and both products read it where it lies: the scores through a
  transposed view (dims contiguous, the operand's K), the values as it is (dims contiguous, the operand's N:
  allowed for 16-bit operands).
* An fp8 cache (e4m3 or e5m2) is converted once a tile into a 16-bit tile in shared memory (float16: one
  ``cvt.rn.f16x2.e4m3x2`` a pair), the queries scaled by ``q_scale`` into float16 as the portable kernel's
  ``F16_DOTS``; a 16-bit cache is read in its own dtype (the queries'). The conversion goes in two halves
  (registers), the softmax's sum is kept per warpgroup and added across them once at the end.

Compiled for sm_90 by Triton 3.6 (64 keys a step, two buffers; ``scripts/mla_sass.py``) the key loop takes 621
SASS instructions a warp over a bf16 cache and 693 over an e4m3 one (the portable kernel's 64-head blocks:
1,688, and 1,449 with 360 bytes a thread spilled), 222 registers, 229,888 bytes of shared memory (Hopper's
limit: 232,448), five barriers a step (seven converting).

The warp-specialized form (``mla_decode_wide_ws_kernel``, ``MLATileConfig(..., producer=True)``: the launcher's
default) adds a producer warpgroup beside the two consuming ones. It loads each tile into a two-slot ring of
16-bit tiles, with a ``ready`` and an ``empty`` mbarrier a slot. A 16-bit tile is copied by ``cp.async``; an fp8
one is loaded into registers, converted to float16 and stored, its lanes laid out so that those stores are free
of bank conflicts. The consumers run the plain form's step (``_attend``) over each ready slot. ``setmaxnreg``
gives the producer ``PRODUCER_REGS`` (``PRODUCER_REGS_FP8`` over fp8) and the consumers the rest.

Requirements (:func:`supports`): NVIDIA compute capability 9.x, a Triton with Gluon's Hopper operations, a
latent of 512 + 64 (DeepSeek-V2/V3's), 16-bit queries, a cache in the queries' dtype or fp8 whose rows are
16-byte aligned and contiguous. Splits, partial results and the merge are the portable kernel's.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .mla_decode_fp8_mma import RANK, ROPE, _barrier, _copy_tile, _key_range, _store_result, _tile_pages, arguments

BLOCK_H = gl.constexpr(64)
NUM_WARPS = 8
PRODUCER_WARPS = gl.constexpr(4)  # the warp-specialized form's loading (and converting) warpgroup
# its registers a thread over a 16-bit cache (a copy) and over fp8 (loads, conversions and stores: at 88 it kept 8
# bytes of stack, and the step took 3-7% longer); the consumers take the rest of PRODUCER_MAXNREG x 12 warps (208
# and 200 a thread)
PRODUCER_REGS = gl.constexpr(88)
PRODUCER_REGS_FP8 = gl.constexpr(104)
PRODUCER_MAXNREG = 168
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def nvmma(row_bytes: int, width: int) -> gl.NVMMASharedLayout:
    """The warpgroup MMA's shared layout of rows of ``row_bytes`` bytes, ``width``-bit elements."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, row_bytes), element_bitwidth=width, rank=2)


@functools.cache
def constexprs(block_n: int, stages: int, fp8: bool, producer: bool = False) -> dict:
    """The kernel's layout arguments for ``block_n`` keys a step, ``stages`` buffers and an fp8 (``fp8``) or a
    16-bit cache (``producer``: the warp-specialized form's, with its loads' layouts)."""
    if block_n not in (32, 64) or stages < 2:
        raise ValueError(f"expected 32 or 64 keys a step and at least 2 stages, got {block_n} and {stages}")
    bits = 8 if fp8 else 16
    per_lane = 128 // bits  # 16 bytes a lane

    # the producer's loads, 16 bytes a lane: a [keys, 128] chunk of the latent, the rope [keys, 64]. Over fp8 a lane's
    # 16 bytes become 32 in float16, two 16-byte stores; a quarter-warp's lanes take 64 bytes of two keys each (in
    # the swizzled tile their chunks differ; 128 bytes of one key would share four chunks and take two wavefronts),
    # and each key's 128 bytes are still one warp's load (the lanes' bits: 16 bytes, 32, a key, 64 bytes, a key; the
    # four warps' 4 and 8 keys: PRODUCER_WARPS)
    if fp8:
        ld = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8]] + [[rows, 0] for rows in (16, 32) if rows < block_n],
            lane_bases=[[0, 16], [0, 32], [1, 0], [0, 64], [2, 0]],
            warp_bases=[[4, 0], [8, 0]],
            block_bases=[],
            shape=[block_n, 128],
        )
    else:
        ld = gl.BlockedLayout([1, per_lane], [32 * per_lane // 128, 128 // per_lane], [PRODUCER_WARPS.value, 1], [1, 0])
    loads = {
        "LD": ld,
        "LD_PE": gl.BlockedLayout([1, per_lane], [32 * per_lane // ROPE, ROPE // per_lane], [PRODUCER_WARPS.value, 1],
                                  [1, 0]),
    }  # fmt: skip
    layouts = {
        "BLOCK_N": block_n,
        "STAGES": stages,
        "CONVERT": fp8,
        # the scores split by keys between the two warpgroups, the values by latent dims
        "S_MMA": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, block_n // 2, 16]),
        "O_MMA": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]),
        "C_COPY": gl.BlockedLayout([1, per_lane], [1, 32], [NUM_WARPS, 1], [1, 0]),
        "PE_COPY": gl.BlockedLayout([1, per_lane], [32 * per_lane // ROPE, ROPE // per_lane], [NUM_WARPS, 1], [1, 0]),
        "Q_LOAD": gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0]),
        "CVT": gl.BlockedLayout([1, 16], [2, 16], [NUM_WARPS, 1], [1, 0]),  # half the fp8 tile [keys, 256]
        # the fp8 rope tile [keys, 64], each value once: 16 a lane for 64 keys, 8 for 32
        "CVT_PE": gl.BlockedLayout([1, block_n // 4], [block_n // 8, 256 // block_n], [NUM_WARPS, 1], [1, 0]),
        "C_RAW": nvmma(RANK * bits // 8, bits),
        "PE_RAW": nvmma(ROPE * bits // 8, bits),
        "C_16": nvmma(2 * RANK, 16),
        "PE_16": nvmma(2 * ROPE, 16),
        "P_16": nvmma(2 * block_n, 16),
        # the two warpgroups' row maxima [heads, warpgroups] as every lane of a row's MMA fragment holds them
        "ROWS_2": gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [8, 0]],
            lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0], [0, 0]],
            block_bases=[],
            shape=[64, 2],
        ),
        # a row's sum over one warpgroup's keys [heads, warpgroups], held by that warpgroup's lanes of the row
        "ROWS_WG": gl.DistributedLinearLayout(
            reg_bases=[[8, 0]],
            lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0], [0, 1]],
            block_bases=[],
            shape=[64, 2],
        ),
    }
    if producer:  # the copy's and the conversion's layouts are the producer's loads there
        unused = ("STAGES", "CONVERT", "C_COPY", "PE_COPY", "CVT", "CVT_PE", "C_RAW", "PE_RAW")
        regs = PRODUCER_REGS_FP8 if fp8 else PRODUCER_REGS
        return {**{k: v for k, v in layouts.items() if k not in unused}, **loads, "PRODUCER_REGS": regs}
    return layouts


def shared_bytes(block_n: int, stages: int, fp8: bool, producer: bool = False) -> int:
    """Shared memory of the kernel's buffers (queries, tiles, probabilities, row maxima; ``producer``: the
    warp-specialized form's ring and barriers instead of the copies), before Triton's scratch."""
    tile = block_n * (RANK + ROPE)
    queries, probabilities, maxima = 2 * BLOCK_H.value * (RANK + ROPE), 2 * BLOCK_H.value * block_n, 4 * 2 * 64
    if producer:
        return queries + 2 * 2 * tile + probabilities + maxima + 4 * 8
    copied = stages * tile * (1 if fp8 else 2)
    return queries + copied + (2 * tile if fp8 else 0) + probabilities + maxima


def supports(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor):
    """``None`` when this kernel can run the problem, else ``(what it needs, what it got)``."""
    device = kv_cache.device
    if device.type != "cuda" or torch.version.hip is not None:
        return "an NVIDIA GPU", device if device.type != "cuda" else f"HIP {torch.version.hip}"
    capability = torch.cuda.get_device_capability(device)
    if capability[0] != 9:
        return "compute capability 9.x (the warpgroup MMA)", capability
    if q_nope.dtype not in (torch.float16, torch.bfloat16):
        return "float16 or bfloat16 queries", q_nope.dtype
    if kv_cache.dtype not in (q_nope.dtype, *FP8):
        return f"a cache in {q_nope.dtype} or fp8", kv_cache.dtype
    if q_nope.shape[2] != RANK or kv_cache.shape[2] != RANK + ROPE:
        return f"a latent of {RANK} + {ROPE}", f"{q_nope.shape[2]} + {kv_cache.shape[2] - q_nope.shape[2]}"
    size = kv_cache.element_size()
    if (
        kv_cache.stride(2) != 1
        or (kv_cache.stride(1) * size) % 16
        or (kv_cache.stride(0) * size) % 16
        or kv_cache.data_ptr() % 16
    ):
        return "cache rows contiguous and 16-byte aligned", f"strides {kv_cache.stride()}"
    if q_nope.stride(2) != 1 or q_rope.stride(2) != 1 or out.stride(2) != 1:
        return "queries and output contiguous in their last dim", (q_nope.stride(), q_rope.stride(), out.stride())
    return None


@gluon.jit
def _queries(QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
             q_scale, DOT: gl.constexpr, Q_LOAD: gl.constexpr, C_16: gl.constexpr, PE_16: gl.constexpr):  # fmt: skip
    """The queries times ``q_scale`` in ``DOT``, in shared memory as the warpgroup MMA reads them (nope, rope)."""
    offs_h = head_block * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, Q_LOAD))
    h_ok = offs_h[:, None] < num_heads
    cols = gl.arange(0, 128, gl.SliceLayout(0, Q_LOAD))
    qn_smem = gl.allocate_shared_memory(DOT, [BLOCK_H, 512], C_16)
    for c in gl.static_range(4):  # a quarter at a time (registers)
        qn = gl.load(QNope + seq * stride_qn_b + offs_h[:, None] * stride_qn_h + 128 * c + cols[None, :], mask=h_ok,
                     other=0.0)  # fmt: skip
        qn_smem.slice(128 * c, 128, dim=1).store((qn.to(gl.float32) * q_scale).to(DOT))
    cols_pe = gl.arange(0, 64, gl.SliceLayout(0, Q_LOAD))
    qr = gl.load(QRope + seq * stride_qr_b + offs_h[:, None] * stride_qr_h + cols_pe[None, :], mask=h_ok, other=0.0)
    qr_smem = gl.allocate_shared_memory(DOT, [BLOCK_H, 64], PE_16, (qr.to(gl.float32) * q_scale).to(DOT))
    return qn_smem, qr_smem


@gluon.jit
def _program(QNope, QRope, SeqLensK, num_heads, num_kv_splits, stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
             q_scale, MIN_SPLIT: gl.constexpr, DOT: gl.constexpr, BLOCK_N: gl.constexpr, Q_LOAD: gl.constexpr,
             C_16: gl.constexpr, PE_16: gl.constexpr, P_16: gl.constexpr):  # fmt: skip
    """What both forms' programs start from: their head block, split and sequence, the split's keys, the queries
    in shared memory and the probabilities' and row maxima's buffers."""
    head_block = gl.program_id(0)
    split = gl.program_id(1)
    seq = gl.program_id(2).to(gl.int64)
    start, end = _key_range(SeqLensK, seq, split, num_kv_splits, BLOCK_N, MIN_SPLIT)
    qn_smem, qr_smem = _queries(
        QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h, q_scale,
        DOT, Q_LOAD, C_16, PE_16,
    )  # fmt: skip
    p_smem = gl.allocate_shared_memory(DOT, [BLOCK_H, BLOCK_N], P_16)
    max_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H, 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    return head_block, split, seq, start, end, qn_smem, qr_smem, p_smem, max_smem


@gluon.jit
def _row_max(s, max_smem, BLOCK_N: gl.constexpr, ROWS_2: gl.constexpr):
    """The maximum of each row of ``s`` (its keys split between the two warpgroups) with one barrier: each
    warpgroup's own maximum through shared memory (the barrier at the top of the step keeps the buffer free)."""
    parts = gl.max(gl.reshape(s, [BLOCK_H, 2, BLOCK_N // 2]), 2)  # [heads, warpgroups], in-warp
    max_smem.store(parts)
    _barrier()
    return gl.convert_layout(gl.max(max_smem.load(ROWS_2), 1), gl.SliceLayout(1, s.type.layout))


@gluon.jit
def _attend(qn_smem, qr_smem, c_tile, pe_tile, p_smem, max_smem, acc, m_i, l_wg, tile_start, end, qk_scale_log2,
            BLOCK_N: gl.constexpr, S_MMA: gl.constexpr, O_MMA: gl.constexpr, ROWS_2: gl.constexpr,
            ROWS_WG: gl.constexpr):  # fmt: skip
    """One tile's scores, online softmax and value product: ``(acc, m_i, l_wg)`` updated (the tile's keys from
    ``tile_start``, those from ``end`` masked)."""
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_MMA)
    s = warpgroup_mma(qn_smem, c_tile.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(qr_smem, pe_tile.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s])
    offs_n = tile_start + gl.arange(0, BLOCK_N, gl.SliceLayout(0, S_MMA))
    s = gl.where(offs_n[None, :] < end, s * qk_scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, _row_max(s, max_smem, BLOCK_N, ROWS_2))  # finite: every tile holds a key
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    part = gl.convert_layout(gl.sum(gl.reshape(p, [BLOCK_H, 2, BLOCK_N // 2]), 2), ROWS_WG)  # in-warp
    l_wg = l_wg * gl.convert_layout(alpha, gl.SliceLayout(1, ROWS_WG))[:, None] + part
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_MMA))[:, None]
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    _barrier()  # both warpgroups' probabilities
    acc = warpgroup_mma(p_smem, c_tile, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    return acc, m_new, l_wg


@gluon.constexpr_function
def columns_first(layout):
    """``layout`` (a 2-D ``DistributedLinearLayout``) with its register bases along the columns first, the lowest
    first: a thread's consecutive columns in consecutive registers, which Triton stores as vectors."""
    regs = sorted(layout.reg_bases, key=lambda base: (base[1] == 0, base[1] or base[0]))
    return gl.DistributedLinearLayout(regs, layout.lane_bases, layout.warp_bases, layout.block_bases, layout.shape)


@gluon.jit
def value_columns(acc, COLUMNS: gl.constexpr):
    """A value product's output ``[heads, COLUMNS]`` whose columns are the rows of transposed fp8 values
    (``mla_decode_wide_fp8``'s fp8 values: in each 128-row chunk, row ``32 s + q`` holds dim ``4 q + s``, so that
    the transposition's lanes store consecutive rows, ``mla_decode_wide_fp8.transposing_load``), its columns put in
    the dims' order: the registers relabelled and reordered in each thread, no data moved between threads. (Only
    relabelled, a thread's consecutive dims lay 16 registers apart or more, and Triton stored them one float at a
    time, each lane in a sector of its own: 0.026 ms more at 64 heads on an H100,
    benchmarks/results/round57/NOTES.md.)"""
    acc = gl.reshape(acc, [acc.shape[0], COLUMNS // 128, 4, 32])
    acc = gl.reshape(gl.permute(acc, (0, 1, 3, 2)), [acc.shape[0], COLUMNS])
    return gl.convert_layout(acc, columns_first(acc.type.layout))


@gluon.jit
def _finish(acc, m_i, l_wg, head_block, seq, split, start, end, num_heads, num_kv_splits, kv_scale, Out, Lse, PartOut,
            PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL: gl.constexpr,
            WRITE_LSE: gl.constexpr, O_MMA: gl.constexpr, VALUE_ROWS: gl.constexpr = False):  # fmt: skip
    """The program's result: the warpgroups' sums added, the output normalised and stored (``_store_result``;
    ``VALUE_ROWS``: the output's columns are the rows of transposed fp8 values, :func:`value_columns`)."""
    if VALUE_ROWS:
        acc = value_columns(acc, 512)
    l_i = gl.convert_layout(gl.sum(l_wg, 1), gl.SliceLayout(1, acc.type.layout))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, acc.type.layout))
    offs_ho = head_block * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, acc.type.layout))
    dims_o = gl.arange(0, 512, gl.SliceLayout(0, acc.type.layout))
    _store_result(acc, m_o, l_i, offs_ho, dims_o, seq, split, start, end, num_heads, num_kv_splits, kv_scale, Out,
                  Lse, PartOut, PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL,
                  WRITE_LSE)  # fmt: skip


@gluon.jit
def mla_decode_wide_kernel(
    QNope, QRope, KV, PageTable, SeqLensK, Out, Lse, PartOut, PartLse,
    q_scale, qk_scale_log2, kv_scale, num_heads, num_kv_splits,
    stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
    stride_kv_page, stride_kv_slot, stride_pt_b, stride_pt_p,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    PAGE_SIZE: gl.constexpr, WRITE_PARTIAL: gl.constexpr, WRITE_LSE: gl.constexpr, MIN_SPLIT: gl.constexpr,
    DOT: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONVERT: gl.constexpr,
    S_MMA: gl.constexpr, O_MMA: gl.constexpr, C_COPY: gl.constexpr, PE_COPY: gl.constexpr, Q_LOAD: gl.constexpr,
    CVT: gl.constexpr, CVT_PE: gl.constexpr, C_RAW: gl.constexpr, PE_RAW: gl.constexpr, C_16: gl.constexpr,
    PE_16: gl.constexpr, P_16: gl.constexpr, ROWS_2: gl.constexpr, ROWS_WG: gl.constexpr,
):  # fmt: skip
    ROWS: gl.constexpr = gl.SliceLayout(1, S_MMA)
    head_block, split, seq, start, end, qn_smem, qr_smem, p_smem, max_smem = _program(
        QNope, QRope, SeqLensK, num_heads, num_kv_splits, stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
        q_scale, MIN_SPLIT, DOT, BLOCK_N, Q_LOAD, C_16, PE_16, P_16,
    )  # fmt: skip
    c_raw = gl.allocate_shared_memory(KV.dtype.element_ty, [STAGES, BLOCK_N, 512], C_RAW)
    pe_raw = gl.allocate_shared_memory(KV.dtype.element_ty, [STAGES, BLOCK_N, 64], PE_RAW)
    if CONVERT:  # the 16-bit tile both products read
        c_16 = gl.allocate_shared_memory(DOT, [BLOCK_N, 512], C_16)
        pe_16 = gl.allocate_shared_memory(DOT, [BLOCK_N, 64], PE_16)

    page_row = PageTable + seq * stride_pt_b
    num_tiles = gl.cdiv(end - start, BLOCK_N)
    for j in gl.static_range(STAGES - 1):
        if j < num_tiles:
            _copy_tile(KV, page_row, stride_pt_p, stride_kv_page, stride_kv_slot, start + j * BLOCK_N, end,
                       c_raw.index(j), pe_raw.index(j), PAGE_SIZE, BLOCK_N, C_COPY, PE_COPY)  # fmt: skip
        cp.commit_group()
    fence_async_shared()  # the queries' stores before the tensor cores read them (with the loop's barrier)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
    l_wg = gl.zeros([BLOCK_H, 2], gl.float32, ROWS_WG)  # the softmax's sum, per warpgroup
    acc = gl.zeros([BLOCK_H, 512], gl.float32, O_MMA)
    for i in range(num_tiles):
        cp.wait_group(STAGES - 2)  # tile i is in shared memory (this thread's copies) ...
        fence_async_shared()
        _barrier()  # ... everyone's; and every warp is done with tile i - 1's buffers
        ahead = i + STAGES - 1
        if ahead < num_tiles:
            _copy_tile(KV, page_row, stride_pt_p, stride_kv_page, stride_kv_slot, start + ahead * BLOCK_N, end,
                       c_raw.index(ahead % STAGES), pe_raw.index(ahead % STAGES), PAGE_SIZE, BLOCK_N, C_COPY,
                       PE_COPY)  # fmt: skip
        cp.commit_group()
        if CONVERT:
            raw = c_raw.index(i % STAGES)
            for c in gl.static_range(2):  # a half at a time (registers); Triton puts a barrier between them
                c_16.slice(256 * c, 256, dim=1).store(raw.slice(256 * c, 256, dim=1).load(CVT).to(DOT))
            pe_16.store(pe_raw.index(i % STAGES).load(CVT_PE).to(DOT))
            fence_async_shared()
            _barrier()
            c_tile = c_16
            pe_tile = pe_16
        else:
            c_tile = c_raw.index(i % STAGES)
            pe_tile = pe_raw.index(i % STAGES)

        acc, m_i, l_wg = _attend(qn_smem, qr_smem, c_tile, pe_tile, p_smem, max_smem, acc, m_i, l_wg,
                                 start + i * BLOCK_N, end, qk_scale_log2, BLOCK_N, S_MMA, O_MMA, ROWS_2,
                                 ROWS_WG)  # fmt: skip
    cp.wait_group(0)

    _finish(acc, m_i, l_wg, head_block, seq, split, start, end, num_heads, num_kv_splits, kv_scale, Out, Lse, PartOut,
            PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL, WRITE_LSE, O_MMA)  # fmt: skip


@gluon.jit
def _produce(KV, page_row, stride_pt_p, stride_kv_page, stride_kv_slot, start, end, c_ring, pe_ring, ready, empty,
             PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, LD: gl.constexpr, LD_PE: gl.constexpr):  # fmt: skip
    """The warp-specialized form's producer: each tile into the two-slot ring (``ready`` / ``empty``: a slot's
    barriers). An fp8 tile is loaded into registers (16 bytes a lane, a [keys, 128] chunk at a time, two chunks in
    flight), converted to the products' 16 bits and stored; a 16-bit tile is copied by ``cp.async``."""
    DOT: gl.constexpr = c_ring.dtype
    rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, LD))
    rows_pe = gl.arange(0, BLOCK_N, gl.SliceLayout(1, LD_PE))
    cols = gl.arange(0, 128, gl.SliceLayout(0, LD))[None, :]
    cols_pe = 512 + gl.arange(0, 64, gl.SliceLayout(0, LD_PE))[None, :]
    for i in range(gl.cdiv(end - start, BLOCK_N)):
        tile = start + i * BLOCK_N
        slot = i % 2
        empty_phase = ((i // 2) & 1) ^ 1  # the consumers are done with the slot's last tile
        c_tile = c_ring.index(slot)
        if KV.dtype.element_ty == DOT:
            mbarrier.wait(empty.index(slot), empty_phase)
            _copy_tile(KV, page_row, stride_pt_p, stride_kv_page, stride_kv_slot, tile, end, c_tile,
                       pe_ring.index(slot), PAGE_SIZE, BLOCK_N, LD, LD_PE)  # fmt: skip
            cp.commit_group()
            cp.wait_group(0)
        else:
            page, page_pe = _tile_pages(page_row, stride_pt_p, tile, end, PAGE_SIZE, BLOCK_N, LD, LD_PE, False)
            offs = tile + rows
            offs_pe = tile + rows_pe
            ptr = (KV + page.to(gl.int64) * stride_kv_page + (offs % PAGE_SIZE) * stride_kv_slot)[:, None] + cols
            ptr_pe = (KV + page_pe.to(gl.int64) * stride_kv_page + (offs_pe % PAGE_SIZE) * stride_kv_slot)[:, None]
            ok = (offs < end)[:, None]
            a = gl.load(ptr, mask=ok, other=0.0)
            b = gl.load(ptr + 128, mask=ok, other=0.0)
            pe = gl.load(ptr_pe + cols_pe, mask=(offs_pe < end)[:, None], other=0.0)
            mbarrier.wait(empty.index(slot), empty_phase)
            c_tile.slice(0, 128, dim=1).store(a.to(DOT))
            a = gl.load(ptr + 256, mask=ok, other=0.0)
            c_tile.slice(128, 128, dim=1).store(b.to(DOT))
            b = gl.load(ptr + 384, mask=ok, other=0.0)
            pe_ring.index(slot).store(pe.to(DOT))
            c_tile.slice(256, 128, dim=1).store(a.to(DOT))
            c_tile.slice(384, 128, dim=1).store(b.to(DOT))
        fence_async_shared()  # the tile before the tensor cores read it
        mbarrier.arrive(ready.index(slot), count=1)


@gluon.jit
def _consume(qn_smem, qr_smem, c_ring, pe_ring, p_smem, max_smem, ready, empty, start, end, qk_scale_log2,
             BLOCK_N: gl.constexpr, S_MMA: gl.constexpr, O_MMA: gl.constexpr, ROWS_2: gl.constexpr,
             ROWS_WG: gl.constexpr):  # fmt: skip
    """The warp-specialized form's two consuming warpgroups: each tile of the ring attended as the plain form's
    step, the slot released once both warpgroups' value products are done."""
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S_MMA))
    l_wg = gl.zeros([BLOCK_H, 2], gl.float32, ROWS_WG)  # the softmax's sum, per warpgroup
    acc = gl.zeros([BLOCK_H, 512], gl.float32, O_MMA)
    for i in range(gl.cdiv(end - start, BLOCK_N)):
        slot = i % 2
        mbarrier.wait(ready.index(slot), (i // 2) & 1)
        acc, m_i, l_wg = _attend(qn_smem, qr_smem, c_ring.index(slot), pe_ring.index(slot), p_smem, max_smem, acc,
                                 m_i, l_wg, start + i * BLOCK_N, end, qk_scale_log2, BLOCK_N, S_MMA, O_MMA, ROWS_2,
                                 ROWS_WG)  # fmt: skip
        _barrier()  # both warpgroups' value products
        mbarrier.arrive(empty.index(slot), count=1)
    return acc, m_i, l_wg


@gluon.jit
def mla_decode_wide_ws_kernel(
    QNope, QRope, KV, PageTable, SeqLensK, Out, Lse, PartOut, PartLse,
    q_scale, qk_scale_log2, kv_scale, num_heads, num_kv_splits,
    stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
    stride_kv_page, stride_kv_slot, stride_pt_b, stride_pt_p,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    PAGE_SIZE: gl.constexpr, WRITE_PARTIAL: gl.constexpr, WRITE_LSE: gl.constexpr, MIN_SPLIT: gl.constexpr,
    DOT: gl.constexpr, BLOCK_N: gl.constexpr, S_MMA: gl.constexpr, O_MMA: gl.constexpr, Q_LOAD: gl.constexpr,
    C_16: gl.constexpr, PE_16: gl.constexpr, P_16: gl.constexpr, ROWS_2: gl.constexpr, ROWS_WG: gl.constexpr,
    LD: gl.constexpr, LD_PE: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    """The warp-specialized form: a producer warpgroup loads, converts and stores each tile into a two-slot ring of
    16-bit tiles, the two consuming warpgroups (the default partition) run the plain form's step over it."""
    head_block, split, seq, start, end, qn_smem, qr_smem, p_smem, max_smem = _program(
        QNope, QRope, SeqLensK, num_heads, num_kv_splits, stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
        q_scale, MIN_SPLIT, DOT, BLOCK_N, Q_LOAD, C_16, PE_16, P_16,
    )  # fmt: skip
    c_ring = gl.allocate_shared_memory(DOT, [2, BLOCK_N, 512], C_16)
    pe_ring = gl.allocate_shared_memory(DOT, [2, BLOCK_N, 64], PE_16)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(2):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    fence_async_shared()  # the queries' stores before the tensor cores read them
    _barrier()

    acc, m_i, l_wg = gl.warp_specialize(
        [
            (_consume, (qn_smem, qr_smem, c_ring, pe_ring, p_smem, max_smem, ready, empty, start, end,
                        qk_scale_log2, BLOCK_N, S_MMA, O_MMA, ROWS_2, ROWS_WG)),
            (_produce, (KV, PageTable + seq * stride_pt_b, stride_pt_p, stride_kv_page, stride_kv_slot, start, end,
                        c_ring, pe_ring, ready, empty, PAGE_SIZE, BLOCK_N, LD, LD_PE)),
        ],
        [PRODUCER_WARPS],
        [PRODUCER_REGS],
    )  # fmt: skip
    _finish(acc, m_i, l_wg, head_block, seq, split, start, end, num_heads, num_kv_splits, kv_scale, Out, Lse, PartOut,
            PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL, WRITE_LSE, O_MMA)  # fmt: skip


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


def launch_arguments(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse, *,
                     q_scale, qk_scale_log2, kv_scale, num_kv_splits, write_partial, write_lse, min_split, block_n,
                     stages, producer=False):  # fmt: skip
    """``(grid, args, kwargs)`` of one launch over ``[head blocks of 64, splits, sequences]`` (the arguments as
    ``mla_decode_split_kernel``'s; an fp8 cache: ``q_scale`` and the products in float16; ``producer``: those of
    the warp-specialized form, ``mla_decode_wide_ws_kernel``)."""
    batch, num_heads, _ = q_nope.shape
    fp8 = kv_cache.dtype in FP8
    grid = (-(-num_heads // BLOCK_H.value), num_kv_splits, batch)
    args = arguments(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse, q_scale,
                     qk_scale_log2, kv_scale, num_kv_splits)  # fmt: skip
    kwargs = {"PAGE_SIZE": kv_cache.shape[1], "WRITE_PARTIAL": write_partial, "WRITE_LSE": write_lse,
              "MIN_SPLIT": min_split, "DOT": gl.float16 if fp8 else _GL_DTYPES[q_nope.dtype],
              **constexprs(block_n, stages, fp8, producer), "num_warps": NUM_WARPS}  # fmt: skip
    if producer:
        kwargs["maxnreg"] = PRODUCER_MAXNREG  # the registers setmaxnreg shares between the partitions
    return grid, args, kwargs


def launch(*args, producer: bool = False, **kwargs) -> None:
    """Launch the kernel (arguments as :func:`launch_arguments`)."""
    grid, args, kwargs = launch_arguments(*args, producer=producer, **kwargs)
    (mla_decode_wide_ws_kernel if producer else mla_decode_wide_kernel)[grid](*args, **kwargs)
