"""MLA decode over an fp8 latent cache with tensor-core products on relabelled shared-memory views (Gluon).

The portable kernel (``mla_decode.py``) converts an fp8 latent tile to 16 bits and lets Triton place it for
both products; for the value product ``p @ c_kv``, which contracts over keys while a latent row holds its
dims contiguously, Triton reads the fp8 tile from shared memory byte by byte (no ``ldmatrix.trans`` for 8-bit
data), and the fp8 cache ran at 0.81x the bf16 cache on an H200 (benchmarks/results/round27_h200/NOTES.md).
This kernel, written in Triton's Gluon dialect (explicit layouts), reads every byte of the tile from shared
memory in 16-byte loads for both products, with no transpose:

* A contraction may be summed in any order, and a product's output columns may be stored anywhere. Each
  product's operand is therefore read through a *relabelled* view of the same shared bytes
  (``SharedLinearLayout``): label ``j`` of the scores' contraction is latent dim ``relabel(j, QK_BITS)`` (the
  queries are loaded under the same labels), value column ``n`` is dim ``relabel(n, PV_BITS)`` (the output is
  stored back to its dim). The labels put the 16 bytes an ``mma.sync`` fragment needs from a key row side by
  side: one ``ld.shared.v4`` each.
* The scores' operand is converted by ``cvt.rn.f16x2.e4m3x2`` on a pair of contiguous bytes (of one key).
  The values' operand pairs two keys of one dim: one ``prmt`` joins bytes ``j, j+1`` of two rows' words,
  two conversions make the two 16-bit pairs of the fragment (inline PTX, four values a call).
* The tile arrives by ``cp.async`` (16 bytes a lane), two buffers deep, in Triton's ``NVMMASharedLayout``
  (Hopper's tensor-core layout: 128-byte column blocks, 16-byte chunks XOR-swizzled by key row), over which the
  views are written; the copies and both products' loads are free of bank conflicts (``gl.bank_conflicts``,
  tests/kernels/test_mla_fp8_mma.py).
* The products are ``mma.sync`` m16n8k16 in float16 with float32 accumulation: the queries are scaled by
  ``q_scale`` and converted to float16 as in the portable kernel's ``F16_DOTS``; 16 heads a program, the
  scores' keys and the values' columns split over four warps. With two head groups (``BLOCK_H`` 32, eight
  warps: ``constexprs(..., head_groups=2)``) the MMA's third warp bit picks the heads 16-31: each warp does one
  group's work as with 16 heads, and the tile is copied once for both groups (half the copies a warp). With
  ``group_regs`` the two groups share four warps instead (the heads 16-31 a register bit of the MMA's layout): each
  warp converts its fragments of the tile once for both groups' MMAs, so a program converts and loads half as
  much a head (254 registers at 64 keys a step, 221 at 32, no spills; the launcher's default for 17-32 heads).
  Four groups (``BLOCK_H`` 64, sixteen warps: 128 registers a thread at most, so ptxas spills some) read it once
  for 64 heads. The probabilities go through 2 KB of shared memory a group; the softmax's sum is kept per score
  element and reduced once at the end; the row maximum across the warps takes one barrier (Triton 3.6's own
  reduction takes three).
* Over an e5m2 cache (``E5M2``) no conversion instruction is needed: e5m2 is float16's high byte, so a
  ``prmt`` with zeros makes a float16 pair of two bytes, exactly (infinities and NaN included), for both
  products. Compiled for sm_90 the 64-key loop keeps its 939 instructions a warp, the 272 conversions become
  ``prmt`` (336 in all), 174 registers, no spills; e5m2 needs compute capability 8.0 only.
* Optionally (``ALU_QK``, ``ALU_PV``: bit masks over the scores' five 128- or 64-dim chunks and the values'
  16-key steps) some of the tile's bytes are converted by integer instructions instead of ``cvt`` (F2FP, whose
  pipe is slower than the integer one on Hopper): a ``prmt`` puts two bytes in the high bytes of two 16-bit
  halves, a shift and two masks move each byte's exponent and mantissa into float16's fields. That is the
  value times 2^-8, exactly (subnormals included; e4m3's NaN becomes 1.875): the scores of those chunks are
  summed apart and multiplied by 256, the probabilities of those keys are stored times 256. Four integer
  instructions replace each ``cvt`` (Triton 3.9, sm_90, 64 keys: half the conversions moved, 1,329
  instructions a warp's loop against 939; all, 1,759; 168 registers and 16-24 bytes of stack against 174 and
  none), so it pays only if the two pipes overlap: which mix is fastest is the probe's question
  (``MLATileConfig(alu_scores=, alu_values=)``); by default none.
* ``PAGES_AHEAD``: each iteration loads the page ids of the next iteration's copy, so that the copy's addresses do
  not wait for a load (as the GQA decode's ``pages_ahead``, 3% faster there); by default the copy loads its own.
* ``COALESCED_IO``: the queries are loaded in dim order, 16 bytes a lane, and their labels given in registers
  (a reshape to one axis a bit and a permute: no data moves), the output likewise relabelled back to dims and
  stored 16 bytes a lane. By default each of the four warps loads all 16 x 576 queries in the scores' operand
  layout, two bytes a lane at relabelled addresses (288 loads a lane, every lane in its own 32-byte sector), and
  each lane stores its 64 output floats one at a time: 66% of the sectors the kernel asked of memory were
  excessive in Nsight Compute's count (H100, B=64 over 4096 keys; benchmarks/results/round38/NOTES.md).
  Compiled for sm_90: 9 loads and 16 stores of 16 bytes a lane instead; the key loop is unchanged.
* With ``WGMMA`` (compute capability 9.x) the scores are instead the transposed product ``c @ q^T`` by Hopper's
  warpgroup MMA in e4m3, straight from the copied bytes; the queries are split into two e4m3 parts (a head's
  largest value scaled to 448, the second part the first's rounding error), so only the values' bytes are
  converted. The warpgroup MMA sums e4m3 products in fewer bits than float32 (no promotion here). On an H200
  this variant's outputs were wrong (max error 2.7-4.2; the ``mma.sync`` form's right): ``MLATileConfig``
  refuses ``wgmma_scores=True``, and the variant stays only as compiled code until that is found.

Compiled for sm_90 by Triton 3.6 (16 heads, 64 keys a step) the key loop takes 929 SASS instructions a warp:
272 conversions, 136 MMAs, 36 16-byte shared loads and 4 barriers (the step's, the row maximum's, the
probabilities' and one Triton 3.6 puts between the next tile's copy and this tile's reads); 166 registers, no
spills. With ``WGMMA``: 926 (128 conversions, 36 e4m3 warpgroup MMAs, 64 MMAs; 210 registers). The portable
kernel's takes 1,694 for 64 keys of a bf16 cache and 3,094 of an e4m3 cache (847 and 1,547 a 32-key step, the
latter with 128 byte-wise shared loads). Requirements (``supports``): NVIDIA compute capability 8.9 or newer
(the e4m3 conversion; 8.0 over e5m2; 9.x for ``WGMMA``), a Triton with Gluon, a latent of 512 + 64
(DeepSeek-V2/V3's), an e4m3 or e5m2 cache (e4m3 with ``WGMMA``) whose rows are 16-byte aligned and contiguous,
16-bit queries. Splits, partial results and the
merge are the portable kernel's.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

RANK = 512
ROPE = 64
BLOCK_H = gl.constexpr(16)
NUM_WARPS = 4

# Triton 3.6 (the H200's) and later versions name three operations differently (same arguments): `_barrier`,
# `_async_load` and `_view` below take the one this Triton has.
_NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # 3.6: _reinterpret

# Bit ``i`` of a latent dim is bit ``BITS[i]`` of its label. The scores' labels follow the m16n8k16 B
# fragment (label bits 0 and 3 in registers, 1-2 the lane's column pair, 4+ the k-step): bits 0, 3, 4, 5 of
# the label become the dim's low 4 bits (16 contiguous bytes a lane), the lane's pair bits 1-2 become dim
# bits 5-6 so that the four lanes of a pair read four different bank groups.
QK_BITS = (0, 3, 4, 5, 6, 1, 2, 7, 8)
PE_BITS = (0, 3, 4, 5, 1, 2)
# The values' columns: column n of a warp's fragment holds dim 16 * (n % 32) + n // 32, so that the 16
# columns a lane holds (n, n + 32, ..., n + 480) are 16 contiguous bytes of a row.
PV_BITS = (5, 6, 7, 8, 0, 1, 2, 3, 4)


def relabel(label: int, bits: tuple[int, ...]) -> int:
    """The latent dim of ``label`` (bit ``i`` of the dim is bit ``bits[i]`` of the label)."""
    return sum(((label >> src) & 1) << i for i, src in enumerate(bits))


def label_of(dim: int, bits: tuple[int, ...]) -> int:
    """The inverse of :func:`relabel`."""
    return sum(((dim >> i) & 1) << src for i, src in enumerate(bits))


def label_axes(bits: tuple[int, ...]) -> tuple[int, ...]:
    """The ``permute`` order that relabels the last axis of ``[rows, 2, ..., 2]`` (``rows`` then the axis' bits,
    the highest first): from a tensor indexed by dim to one indexed by label (:func:`relabel`)."""
    n = len(bits)
    order = [0] * (n + 1)
    for j in range(n):
        order[n - j] = n - bits.index(j)
    return tuple(order)


def dim_axes(bits: tuple[int, ...]) -> tuple[int, ...]:
    """The inverse of :func:`label_axes`: from a tensor indexed by label to one indexed by dim."""
    n = len(bits)
    return (0, *(n - bits[n - k] for k in range(1, n + 1)))


def latent_offset(key: int, dim: int, block_n: int) -> int:
    """Byte offset of ``(key, dim)`` in a latent tile of ``block_n`` keys as the tensor cores of Hopper read it
    (``NVMMASharedLayout``, 128-byte swizzle): 128-byte column blocks of ``block_n`` rows each, a row's 16-byte
    chunks XOR-swizzled by ``key % 8``."""
    return (dim // 128) * block_n * 128 + key * 128 + 16 * (((dim % 128) // 16) ^ (key % 8)) + dim % 16


def rope_offset(key: int, dim: int) -> int:
    """Byte offset of ``(key, dim)`` in a rope tile (``NVMMASharedLayout``, 64-byte swizzle)."""
    return key * ROPE + 16 * ((dim // 16) ^ ((key // 2) % 4)) + dim % 16


def _latent_coords(offset: int, block_n: int) -> tuple[int, int]:
    """``(key, dim)`` at a byte offset (the inverse of :func:`latent_offset`)."""
    key = (offset // 128) % block_n
    chunk = ((offset // 16) % 8) ^ (key % 8)
    return key, offset // (128 * block_n) * 128 + 16 * chunk + offset % 16


def _rope_coords(offset: int) -> tuple[int, int]:
    """``(key, dim)`` at a byte offset (the inverse of :func:`rope_offset`)."""
    key = offset // ROPE
    return key, 16 * (((offset // 16) % 4) ^ ((key // 2) % 4)) + offset % 16


def _bases(num_bits: int, logical) -> list[list[int]]:
    """The offset bases of a linear shared layout: the logical coordinates of each power-of-two offset."""
    return [list(logical(1 << i)) for i in range(num_bits)]


def physical_layouts(block_n: int) -> dict[str, gl.SharedLinearLayout]:
    """The latent and rope tiles as :func:`latent_offset` and :func:`rope_offset` place them (Triton's
    ``NVMMASharedLayout`` of the same shapes, which the allocations use, places them so: tested)."""
    bits, pe_bits = (RANK * block_n).bit_length() - 1, (ROPE * block_n).bit_length() - 1
    return {
        "C_NAT": gl.SharedLinearLayout(_bases(bits, lambda o: _latent_coords(o, block_n))),
        "PE_NAT": gl.SharedLinearLayout(_bases(pe_bits, _rope_coords)),
    }


def shared_views(block_n: int) -> dict[str, gl.SharedLinearLayout]:
    """Relabelled views of one stage's tiles: the latent tile as the scores' operand ``[labels, keys]`` and as the
    values' ``[keys, columns]``, the rope tile as the scores' ``[labels, keys]``."""
    bits, pe_bits = (RANK * block_n).bit_length() - 1, (ROPE * block_n).bit_length() - 1

    def latent(o):
        return _latent_coords(o, block_n)

    return {
        "C_QK": gl.SharedLinearLayout(_bases(bits, lambda o: (label_of(latent(o)[1], QK_BITS), latent(o)[0]))),
        "C_PV": gl.SharedLinearLayout(_bases(bits, lambda o: (latent(o)[0], label_of(latent(o)[1], PV_BITS)))),
        "PE_QK": gl.SharedLinearLayout(
            _bases(pe_bits, lambda o: (label_of(_rope_coords(o)[1], PE_BITS), _rope_coords(o)[0]))
        ),
    }


@functools.cache
def constexprs(block_n: int, stages: int, wgmma: bool = False, head_groups: int = 1, group_regs: bool = False) -> dict:
    """The kernel's layout arguments for ``block_n`` keys a step and ``stages`` buffers; ``wgmma``: the scores
    by Hopper's warpgroup MMA in e4m3 (64 keys a step); ``head_groups``: 16-head groups a program (1, 2 or 4),
    each on four warps of its own that read the same tile (``warps(head_groups)`` in all), or with ``group_regs``
    (two groups) both on the same four warps, each warp's fragments of the tile converted once for both."""
    if block_n not in (32, 64) or stages < 2 or (wgmma and block_n != 64) or head_groups not in (1, 2, 4):
        raise ValueError(
            "expected 32 or 64 keys a step (64 with wgmma), at least 2 stages and 1, 2 or 4 head groups, got"
            f" {block_n}, {stages} and {head_groups}"
        )
    if wgmma and head_groups != 1:
        raise ValueError(f"expected one head group with wgmma, got {head_groups}")
    if group_regs and head_groups != 2:
        raise ValueError(f"expected two head groups with group_regs, got {head_groups}")
    nw = warps(head_groups, group_regs)
    # the warp bits that pick a program's head group (the MMA's warps: the lowest two bits along the columns, as
    # with one group, the next along the heads)
    group_warp = [[16 << i, 0] for i in range(head_groups.bit_length() - 1)]
    group_reg = []
    if group_regs:
        group_warp, group_reg = [], group_warp
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[nw // NUM_WARPS, NUM_WARPS], instr_shape=[16, 8])
    # The values' 16-key operand in the B fragment's elements, its registers ordered so that four in a row are
    # bytes j, j + 1 of two keys (one prmt of their words); the same elements as DotOperandLayout(1, mma, 2).
    pv_load = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [0, 32], [0, 64], [0, 128], [0, 256], [8, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
        # every group reads the same fragments
        warp_bases=[[0, 8], [0, 16]] + [[0, 0]] * len(group_warp),
        block_bases=[],
        shape=[16, RANK],
    )
    return {
        "BLOCK_H": 16 * head_groups,
        "WARPS": nw,
        "BLOCK_N": block_n,
        "STAGES": stages,
        "WGMMA": wgmma,
        "MMA": mma,
        # the scores transposed ([keys, heads]) as the warpgroup MMA leaves them: each warp 16 keys
        "ACC_T": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 16, 32]),
        "PV_LOAD": pv_load,
        "C_COPY": gl.BlockedLayout([1, 16], [1, 32], [nw, 1], [1, 0]),
        "PE_COPY": gl.BlockedLayout([1, 16], [8, 4], [nw, 1], [1, 0]),
        "Q_LOAD": gl.BlockedLayout([1, 8], [4, 8], [1, NUM_WARPS], [1, 0]),
        "Q_SMEM": gl.SwizzledSharedLayout(8, 1, 8, [1, 0]),
        "C_NAT": gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2),
        "PE_NAT": gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2),
        # the four warps' row maxima [heads, warps] as every lane of a row's mma fragment holds them
        "ROWS_4": gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0], *group_reg],
            lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[0, 0], [0, 0], *group_warp],
            block_bases=[],
            shape=[16 * head_groups, 4],
        ),
        # the same maxima [warps, heads] as every lane of a head's column of ACC_T holds them
        "COLS_4": gl.DistributedLinearLayout(
            reg_bases=[[1, 0], [2, 0], [0, 1], [0, 8]],
            lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
            warp_bases=[[0, 0], [0, 0]],
            block_bases=[],
            shape=[4, 16],
        ),
        "QK_BITS": QK_BITS,
        "PE_BITS": PE_BITS,
        "PV_BITS": PV_BITS,
        # the same relabellings as permutations of a tensor's bits (COALESCED_IO): a 128-dim chunk of the
        # queries (their labels' bits 7-8 are the dims'), the rope's 64, the output's 512
        "QK_AXES": label_axes(QK_BITS[:7]),
        "PE_AXES": label_axes(PE_BITS),
        "PV_AXES": dim_axes(PV_BITS),
        # the output relabelled to dims (MMA's registers: dims 16, then head 8, then dims 1-8; lanes dims 32, 64,
        # heads 1-4; warps dims 128, 256) with its registers in dim order: 32 contiguous floats a lane and row
        "OUT_IO": gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0], *group_reg],
            lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[0, 128], [0, 256], *group_warp],
            block_bases=[],
            shape=[16 * head_groups, RANK],
        ),
        **shared_views(block_n),
    }


def warps(head_groups: int = 1, group_regs: bool = False) -> int:
    """Warps a program of ``head_groups`` 16-head groups runs on (``group_regs``: all groups on four)."""
    return NUM_WARPS if group_regs else NUM_WARPS * head_groups


def supports(
    q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, *, wgmma: bool = False
) -> tuple[str, object] | None:
    """``None`` when this kernel can run the problem (``wgmma``: with the scores by the warpgroup MMA), else
    ``(what it needs, what it got)``."""
    device = kv_cache.device
    if device.type != "cuda" or torch.version.hip is not None:
        return "an NVIDIA GPU", device if device.type != "cuda" else f"HIP {torch.version.hip}"
    capability = torch.cuda.get_device_capability(device)
    if kv_cache.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or (
        wgmma and kv_cache.dtype != torch.float8_e4m3fn
    ):
        return "an e4m3 cache" + ("" if wgmma else " or an e5m2 one"), kv_cache.dtype
    if capability < (8, 0) or (kv_cache.dtype == torch.float8_e4m3fn and capability < (8, 9)):
        return "compute capability 8.9 or newer (the e4m3 conversion; 8.0 for e5m2)", capability
    if wgmma and capability[0] != 9:
        return "compute capability 9.x (the warpgroup MMA)", capability
    if q_nope.dtype not in (torch.float16, torch.bfloat16):
        return "float16 or bfloat16 queries", q_nope.dtype
    if q_nope.shape[2] != RANK or kv_cache.shape[2] != RANK + ROPE:
        return f"a latent of {RANK} + {ROPE}", f"{q_nope.shape[2]} + {kv_cache.shape[2] - q_nope.shape[2]}"
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) % 16 or kv_cache.stride(0) % 16 or kv_cache.data_ptr() % 16:
        return "cache rows contiguous and 16-byte aligned", f"strides {kv_cache.stride()}"
    if q_nope.stride(2) != 1 or q_rope.stride(2) != 1 or out.stride(2) != 1:
        return "queries and output contiguous in their last dim", (q_nope.stride(), q_rope.stride(), out.stride())
    return None


if hasattr(gl, "thread_barrier"):  # Triton 3.6

    @gluon.jit
    def _barrier():
        gl.thread_barrier()

    @gluon.jit
    def _async_load(smem, pointers, mask):
        cp.async_copy_global_to_shared(smem, pointers, mask=mask)

else:

    @gluon.jit
    def _barrier():
        gl.barrier()

    @gluon.jit
    def _async_load(smem, pointers, mask):
        cp.async_load(smem, pointers, mask=mask)


@gluon.jit
def _view(buf, SHAPE: gl.constexpr, LAYOUT: gl.constexpr):
    """The same shared bytes under another layout (labels)."""
    if _NEW_REINTERPRET:
        return buf.reinterpret(buf.dtype, SHAPE, LAYOUT)
    else:
        return buf._reinterpret(buf.dtype, SHAPE, LAYOUT)


# e5m2 -> float16, exactly (e5m2 is float16's high byte), four values a call (bytes 0-1 -> $0, 2-3 -> $1).
UNPACK_E5M2 = gl.constexpr("{ .reg .b32 pz; mov.b32 pz, 0; prmt.b32 $0, $2, pz, 0x1404; prmt.b32 $1, $2, pz, 0x3424; }")
# e4m3 -> float16 times 2^-8 by integer instructions, four values a call (bytes 0-1 -> $0, 2-3 -> $1): each
# byte moved to the high byte of its 16-bit half (prmt with zeros), then sign | (the 7 other bits >> 1).
INT_UNPACK_E4M3 = gl.constexpr(
    "{ .reg .b32 pa, pb, ps, pt, pz; mov.b32 pz, 0; "
    "prmt.b32 pa, $2, pz, 0x1404; prmt.b32 pb, $2, pz, 0x3424; "
    "shr.b32 ps, pa, 1; and.b32 ps, ps, 0x3F803F80; and.b32 pt, pa, 0x80008000; or.b32 $0, ps, pt; "
    "shr.b32 ps, pb, 1; and.b32 ps, ps, 0x3F803F80; and.b32 pt, pb, 0x80008000; or.b32 $1, ps, pt; }"
)
INT_UNPACK_SCALE = gl.constexpr(256.0)  # times the integer unpacking's values: the bytes' values


@gluon.jit
def _unpack(x, E5M2: gl.constexpr, INT: gl.constexpr):
    """fp8 values ``x`` (four consecutive registers hold the 4 bytes of one word: the first pair and the second
    pair each become a float16 pair) in float16: e5m2 by two ``prmt``; e4m3 by ``cvt``, or (``INT``) by integer
    instructions, times 2^-8."""
    if E5M2:
        return gl.inline_asm_elementwise(UNPACK_E5M2, "=r,=r,r", [x], dtype=gl.float16, is_pure=True, pack=4)
    elif INT:
        return gl.inline_asm_elementwise(INT_UNPACK_E4M3, "=r,=r,r", [x], dtype=gl.float16, is_pure=True, pack=4)
    else:
        return gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x], dtype=gl.float16, is_pure=True, pack=4,
        )  # fmt: skip


@gluon.jit
def _per_split(num_keys, num_kv_splits, BLOCK_N: gl.constexpr, MIN_SPLIT: gl.constexpr):
    per_split = gl.cdiv(gl.cdiv(num_keys, num_kv_splits), BLOCK_N) * BLOCK_N
    return gl.maximum(per_split, gl.cdiv(gl.maximum(MIN_SPLIT, 1), BLOCK_N) * BLOCK_N)


@gluon.jit
def _key_range(SeqLensK, seq, split, num_kv_splits, BLOCK_N: gl.constexpr, MIN_SPLIT: gl.constexpr):
    """The split's keys ``[start, end)``, as ``mla_decode._split_range`` cuts them."""
    num_keys = gl.load(SeqLensK + seq)
    per_split = _per_split(num_keys, num_kv_splits, BLOCK_N, MIN_SPLIT)
    start = split * per_split
    return start, gl.minimum(start + per_split, num_keys)


@gluon.jit
def _store_result(acc, m_i, l_i, offs_h, dims, seq, split, start, end, num_heads, num_kv_splits, kv_scale,
                  Out, Lse, PartOut, PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
                  WRITE_PARTIAL: gl.constexpr, WRITE_LSE: gl.constexpr):  # fmt: skip
    """A program's normalised output (dims ``dims`` of heads ``offs_h``) and base-2 LSE, to the split's partials
    or (one split) the output and the natural-log LSE, as the portable kernel writes them."""
    h_ok = offs_h < num_heads
    has_keys = l_i > 0.0
    out = acc * kv_scale / gl.where(has_keys, l_i, 1.0)[:, None]  # an empty range gives zeros
    if WRITE_PARTIAL:
        if start < end:  # empty splits write nothing; the merge skips them
            row = (seq * num_heads + offs_h) * num_kv_splits + split
            gl.store(PartOut + row[:, None] * 512 + dims[None, :], out.to(PartOut.dtype.element_ty), mask=h_ok[:, None])
            gl.store(PartLse + row, m_i + gl.log2(l_i), mask=h_ok)
    else:
        gl.store(
            Out + seq * stride_o_b + offs_h[:, None] * stride_o_h + dims[None, :],
            out.to(Out.dtype.element_ty),
            mask=h_ok[:, None],
        )
        if WRITE_LSE:  # natural log; -inf for a sequence without keys
            lse = gl.where(has_keys, (m_i + gl.log2(gl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
            gl.store(Lse + seq * stride_lse_b + offs_h * stride_lse_h, lse, mask=h_ok)


@gluon.jit
def _relabelled(labels, BITS: gl.constexpr):
    dims = gl.zeros_like(labels)
    for i in gl.static_range(len(BITS)):
        dims = dims | (((labels >> BITS[i]) & 1) << i)
    return dims


@gluon.jit
def _tile_pages(page_row, stride_pt_p, tile_start, end, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                C_COPY: gl.constexpr, PE_COPY: gl.constexpr, AHEAD: gl.constexpr):  # fmt: skip
    """The page ids of the rows ``[tile_start, tile_start + BLOCK_N)`` for the latent copy and for the rope's (one
    id where the tile lies in one page); ``AHEAD``: the tile may start past ``end`` (its loads masked)."""
    if PAGE_SIZE % BLOCK_N == 0:  # the tile (it starts at a multiple of BLOCK_N) lies in one page
        if AHEAD:
            page = gl.load(page_row + (tile_start // PAGE_SIZE) * stride_pt_p, mask=tile_start < end, other=0)
        else:
            page = gl.load(page_row + (tile_start // PAGE_SIZE) * stride_pt_p)
        page_pe = page
    else:
        offs_n = tile_start + gl.arange(0, BLOCK_N, gl.SliceLayout(1, C_COPY))
        offs_pe = tile_start + gl.arange(0, BLOCK_N, gl.SliceLayout(1, PE_COPY))
        page = gl.load(page_row + (offs_n // PAGE_SIZE) * stride_pt_p, mask=offs_n < end, other=0)
        page_pe = gl.load(page_row + (offs_pe // PAGE_SIZE) * stride_pt_p, mask=offs_pe < end, other=0)
    return page, page_pe


@gluon.jit
def _copy_pages(KV, page, page_pe, stride_kv_page, stride_kv_slot, tile_start, end, c_buf, pe_buf,
                PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, C_COPY: gl.constexpr, PE_COPY: gl.constexpr):  # fmt: skip
    """Start copying the latent rows ``[tile_start, tile_start + BLOCK_N)`` of pages ``page`` / ``page_pe``
    (:func:`_tile_pages`; zeros past ``end``)."""
    offs_n = tile_start + gl.arange(0, BLOCK_N, gl.SliceLayout(1, C_COPY))
    offs_pe = tile_start + gl.arange(0, BLOCK_N, gl.SliceLayout(1, PE_COPY))
    rows = KV + page.to(gl.int64) * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_slot
    rows_pe = KV + page_pe.to(gl.int64) * stride_kv_page + (offs_pe % PAGE_SIZE) * stride_kv_slot
    cols = gl.arange(0, 512, gl.SliceLayout(0, C_COPY))
    _async_load(c_buf, rows[:, None] + cols[None, :], mask=(offs_n < end)[:, None])
    cols_pe = 512 + gl.arange(0, 64, gl.SliceLayout(0, PE_COPY))
    _async_load(pe_buf, rows_pe[:, None] + cols_pe[None, :], mask=(offs_pe < end)[:, None])


@gluon.jit
def _copy_tile(KV, page_row, stride_pt_p, stride_kv_page, stride_kv_slot, tile_start, end, c_buf, pe_buf,
               PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, C_COPY: gl.constexpr, PE_COPY: gl.constexpr):  # fmt: skip
    """Start copying the latent rows ``[tile_start, tile_start + BLOCK_N)`` (zeros past ``end``)."""
    page, page_pe = _tile_pages(page_row, stride_pt_p, tile_start, end, PAGE_SIZE, BLOCK_N, C_COPY, PE_COPY, False)
    _copy_pages(KV, page, page_pe, stride_kv_page, stride_kv_slot, tile_start, end, c_buf, pe_buf, PAGE_SIZE,
                BLOCK_N, C_COPY, PE_COPY)  # fmt: skip


@gluon.jit
def _relabel_bits(x, ROWS: gl.constexpr, BITS: gl.constexpr, AXES: gl.constexpr):
    """``x`` (``[ROWS, 2 ** BITS]``) with its last axis' index bits permuted by ``permute(AXES)`` (no data moves
    between threads: the registers take the new labels)."""
    # (the order written out in the call: Triton 3.6's permute takes neither a constexpr tuple nor a named one)
    if BITS == 6:
        y = gl.permute(
            gl.reshape(x, [ROWS, 2, 2, 2, 2, 2, 2]), (0, AXES[1], AXES[2], AXES[3], AXES[4], AXES[5], AXES[6])
        )
    elif BITS == 7:
        y = gl.permute(
            gl.reshape(x, [ROWS, 2, 2, 2, 2, 2, 2, 2]),
            (0, AXES[1], AXES[2], AXES[3], AXES[4], AXES[5], AXES[6], AXES[7]),
        )
    else:
        y = gl.permute(
            gl.reshape(x, [ROWS, 2, 2, 2, 2, 2, 2, 2, 2, 2]),
            (0, AXES[1], AXES[2], AXES[3], AXES[4], AXES[5], AXES[6], AXES[7], AXES[8], AXES[9]),
        )
    return gl.reshape(y, [ROWS, 2**BITS])


@gluon.jit
def _queries_f16(QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
                 q_scale, A: gl.constexpr, Q_SMEM: gl.constexpr, QK_BITS: gl.constexpr, PE_BITS: gl.constexpr,
                 QK_AXES: gl.constexpr, PE_AXES: gl.constexpr, COALESCED: gl.constexpr, BLOCK_H: gl.constexpr,
                 WARPS: gl.constexpr):  # fmt: skip
    """The queries times ``q_scale`` in float16 under the scores' labels, in shared memory (nope, rope).
    ``COALESCED``: loaded in dim order, 16 bytes a lane, and relabelled in registers; else each warp loads all of
    them in the scores' operand layout, two bytes a lane at relabelled addresses."""
    q_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_H, 512], Q_SMEM)
    if COALESCED:
        NOPE_IO: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])  # [2 * WARPS, 128] a pass
        ROPE_IO: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])  # [4 * WARPS, 64]
        offs_h = head_block * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, NOPE_IO))
        dims = gl.arange(0, 128, gl.SliceLayout(0, NOPE_IO))
        q_nope = QNope + seq * stride_qn_b + offs_h[:, None] * stride_qn_h + dims[None, :]
        for c in gl.static_range(4):
            qn = gl.load(q_nope + 128 * c, mask=offs_h[:, None] < num_heads, other=0.0)
            qn = (qn.to(gl.float32) * q_scale).to(gl.float16)
            q_smem.slice(128 * c, 128, dim=1).store(_relabel_bits(qn, BLOCK_H, 7, QK_AXES))
        offs_hr = head_block * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, ROPE_IO))
        dims_pe = gl.arange(0, 64, gl.SliceLayout(0, ROPE_IO))
        q_rope = QRope + seq * stride_qr_b + offs_hr[:, None] * stride_qr_h + dims_pe[None, :]
        qr = (gl.load(q_rope, mask=offs_hr[:, None] < num_heads, other=0.0).to(gl.float32) * q_scale).to(gl.float16)
        qr_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_H, 64], Q_SMEM, _relabel_bits(qr, BLOCK_H, 6, PE_AXES))
        return q_smem, qr_smem
    offs_h = head_block * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, A))
    h_ok = offs_h[:, None] < num_heads
    for c in gl.static_range(4):  # a quarter at a time (registers)
        dims = _relabelled(128 * c + gl.arange(0, 128, gl.SliceLayout(0, A)), QK_BITS)
        qn = gl.load(QNope + seq * stride_qn_b + offs_h[:, None] * stride_qn_h + dims[None, :], mask=h_ok, other=0.0)
        q_smem.slice(128 * c, 128, dim=1).store((qn.to(gl.float32) * q_scale).to(gl.float16))
    dims_pe = _relabelled(gl.arange(0, 64, gl.SliceLayout(0, A)), PE_BITS)
    qr = gl.load(QRope + seq * stride_qr_b + offs_h[:, None] * stride_qr_h + dims_pe[None, :], mask=h_ok, other=0.0)
    qr_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_H, 64], Q_SMEM, (qr.to(gl.float32) * q_scale).to(gl.float16))
    return q_smem, qr_smem


@gluon.jit
def _hi_lo(x, scale):
    """``x * scale`` as the sum of two e4m3 values (the second: the first's rounding error)."""
    y = x.to(gl.float32) * scale[:, None]
    hi = y.to(gl.float8e4nv)
    return hi, (y - hi.to(gl.float32)).to(gl.float8e4nv)


@gluon.jit
def _queries_e4m3(QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
                  Q_LOAD: gl.constexpr, C_NAT: gl.constexpr, PE_NAT: gl.constexpr):  # fmt: skip
    """The queries as two e4m3 parts each (a head's largest value scaled to 448, e4m3's largest), in shared memory
    as the warpgroup MMA reads them (nope high, nope low, rope high, rope low), and each head's scale."""
    offs_h = head_block * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, Q_LOAD))
    h_ok = offs_h[:, None] < num_heads
    q_nope = QNope + seq * stride_qn_b + offs_h[:, None] * stride_qn_h
    cols = gl.arange(0, 128, gl.SliceLayout(0, Q_LOAD))
    cols_pe = gl.arange(0, 64, gl.SliceLayout(0, Q_LOAD))
    qr = gl.load(QRope + seq * stride_qr_b + offs_h[:, None] * stride_qr_h + cols_pe[None, :], mask=h_ok, other=0.0)
    amax = gl.max(gl.abs(qr.to(gl.float32)), 1)
    for c in gl.static_range(4):
        qn = gl.load(q_nope + 128 * c + cols[None, :], mask=h_ok, other=0.0)
        amax = gl.maximum(amax, gl.max(gl.abs(qn.to(gl.float32)), 1))
    scale = gl.where(amax > 0.0, 448.0 / amax, 1.0)
    qn_hi = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, 512], C_NAT)
    qn_lo = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, 512], C_NAT)
    for c in gl.static_range(4):
        hi, lo = _hi_lo(gl.load(q_nope + 128 * c + cols[None, :], mask=h_ok, other=0.0), scale)
        qn_hi.slice(128 * c, 128, dim=1).store(hi)
        qn_lo.slice(128 * c, 128, dim=1).store(lo)
    hi, lo = _hi_lo(qr, scale)
    qr_hi = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, 64], PE_NAT, hi)
    qr_lo = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, 64], PE_NAT, lo)
    return qn_hi, qn_lo, qr_hi, qr_lo, scale


@gluon.jit
def _scores_t(c_tile, pe_tile, qn_hi, qn_lo, qr_hi, qr_lo, BLOCK_N: gl.constexpr, ACC_T: gl.constexpr):
    """The scores transposed, ``[keys, heads]``, by the warpgroup MMA in e4m3 (the queries' two parts)."""
    s_t = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, ACC_T)
    s_t = warpgroup_mma(c_tile, qn_hi.permute((1, 0)), s_t, is_async=True)
    s_t = warpgroup_mma(c_tile, qn_lo.permute((1, 0)), s_t, is_async=True)
    s_t = warpgroup_mma(pe_tile, qr_hi.permute((1, 0)), s_t, is_async=True)
    s_t = warpgroup_mma(pe_tile, qr_lo.permute((1, 0)), s_t, is_async=True)
    return warpgroup_mma_wait(0, deps=[s_t])


@gluon.jit
def _col_max(s_t, max_smem, ROWS: gl.constexpr, ROWS_4: gl.constexpr, COLS_4: gl.constexpr):
    """The maximum of each column (head) of ``s_t`` (its keys split over the four warps) with one barrier, in
    ``s_t``'s column layout and in ``ROWS`` (the values' rows)."""
    parts = gl.max(gl.reshape(s_t, [4, s_t.shape[0] // 4, BLOCK_H]), 1)  # [warps, heads], in-warp
    max_smem.store(parts)
    _barrier()
    cols = gl.convert_layout(gl.max(max_smem.load(COLS_4), 0), gl.SliceLayout(0, s_t.type.layout))
    rows = gl.convert_layout(gl.max(max_smem.permute((1, 0)).load(ROWS_4), 1), ROWS)
    return cols, rows


@gluon.jit
def _row_max(s, max_smem, BLOCK_N: gl.constexpr, ROWS_4: gl.constexpr, BLOCK_H: gl.constexpr):
    """The maximum of each row of ``s`` (its keys split over the four warps) with one barrier: each warp's own
    maximum through shared memory (the caller's barrier at the top of the step keeps the buffer free)."""
    parts = gl.max(gl.max(gl.reshape(s, [BLOCK_H, BLOCK_N // 32, 4, 8]), 3), 1)  # [heads, warps], in-warp
    max_smem.store(parts)
    _barrier()
    return gl.convert_layout(gl.max(max_smem.load(ROWS_4), 1), gl.SliceLayout(1, s.type.layout))


@gluon.jit
def mla_decode_fp8_mma_kernel(
    QNope, QRope, KV, PageTable, SeqLensK, Out, Lse, PartOut, PartLse,
    q_scale, qk_scale_log2, kv_scale, num_heads, num_kv_splits,
    stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
    stride_kv_page, stride_kv_slot, stride_pt_b, stride_pt_p,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    PAGE_SIZE: gl.constexpr, WRITE_PARTIAL: gl.constexpr, WRITE_LSE: gl.constexpr, MIN_SPLIT: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MMA: gl.constexpr, PV_LOAD: gl.constexpr,
    WGMMA: gl.constexpr, ACC_T: gl.constexpr, C_COPY: gl.constexpr, PE_COPY: gl.constexpr, Q_LOAD: gl.constexpr,
    Q_SMEM: gl.constexpr, ROWS_4: gl.constexpr, COLS_4: gl.constexpr,
    QK_BITS: gl.constexpr, PE_BITS: gl.constexpr, PV_BITS: gl.constexpr,
    QK_AXES: gl.constexpr, PE_AXES: gl.constexpr, PV_AXES: gl.constexpr, OUT_IO: gl.constexpr,
    C_NAT: gl.constexpr, C_QK: gl.constexpr, C_PV: gl.constexpr, PE_NAT: gl.constexpr, PE_QK: gl.constexpr,
    ALU_QK: gl.constexpr = 0, ALU_PV: gl.constexpr = 0, E5M2: gl.constexpr = False, PAGES_AHEAD: gl.constexpr = False,
    COALESCED_IO: gl.constexpr = False, BLOCK_H: gl.constexpr = 16, WARPS: gl.constexpr = 4,
):  # fmt: skip
    A: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    COLS: gl.constexpr = gl.SliceLayout(0, MMA)
    head_block = gl.program_id(0)
    split = gl.program_id(1)
    seq = gl.program_id(2).to(gl.int64)

    start, end = _key_range(SeqLensK, seq, split, num_kv_splits, BLOCK_N, MIN_SPLIT)

    if WGMMA:  # the queries as two e4m3 parts, the scores by the warpgroup MMA
        qn_hi, qn_lo, qr_hi, qr_lo, q_e4m3_scale = _queries_e4m3(
            QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
            Q_LOAD, C_NAT, PE_NAT,
        )  # fmt: skip
        col_scale = gl.convert_layout(q_scale * qk_scale_log2 / q_e4m3_scale, gl.SliceLayout(0, ACC_T))
        max_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    else:  # the queries under the scores' labels, scaled and in float16
        q_smem, qr_smem = _queries_f16(
            QNope, QRope, seq, head_block, num_heads, stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h, q_scale,
            A, Q_SMEM, QK_BITS, PE_BITS, QK_AXES, PE_AXES, COALESCED_IO, BLOCK_H, WARPS,
        )  # fmt: skip
        max_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    p_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_H, BLOCK_N], Q_SMEM)
    c_smem = gl.allocate_shared_memory(KV.dtype.element_ty, [STAGES, BLOCK_N, 512], C_NAT)
    pe_smem = gl.allocate_shared_memory(KV.dtype.element_ty, [STAGES, BLOCK_N, 64], PE_NAT)

    page_row = PageTable + seq * stride_pt_b
    num_tiles = gl.cdiv(end - start, BLOCK_N)
    for j in gl.static_range(STAGES - 1):
        if j < num_tiles:
            _copy_tile(KV, page_row, stride_pt_p, stride_kv_page, stride_kv_slot, start + j * BLOCK_N, end,
                       c_smem.index(j), pe_smem.index(j), PAGE_SIZE, BLOCK_N, C_COPY, PE_COPY)  # fmt: skip
        cp.commit_group()
    if PAGES_AHEAD:  # the page ids of the loop's first copy: each iteration loads those of the next one's
        page_next, page_pe_next = _tile_pages(page_row, stride_pt_p, start + (STAGES - 1) * BLOCK_N, end, PAGE_SIZE,
                                              BLOCK_N, C_COPY, PE_COPY, True)  # fmt: skip

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
    if WGMMA:
        m_t = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, ACC_T))  # m_i, by columns
        l_part = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, ACC_T)  # the softmax's sum, per score element
    else:
        l_part = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, MMA)
    acc = gl.zeros([BLOCK_H, 512], gl.float32, MMA)  # columns under the values' labels
    for i in range(num_tiles):
        cp.wait_group(STAGES - 2)  # tile i is in shared memory (this thread's copies) ...
        if WGMMA:
            fence_async_shared()  # (the copies, generic proxy, before the tensor cores' reads, async proxy)
        _barrier()  # ... everyone's; and every warp is done with tile i - 1's buffers
        ahead = i + STAGES - 1
        if ahead < num_tiles:
            if PAGES_AHEAD:
                _copy_pages(KV, page_next, page_pe_next, stride_kv_page, stride_kv_slot, start + ahead * BLOCK_N, end,
                            c_smem.index(ahead % STAGES), pe_smem.index(ahead % STAGES), PAGE_SIZE, BLOCK_N, C_COPY,
                            PE_COPY)  # fmt: skip
            else:
                _copy_tile(KV, page_row, stride_pt_p, stride_kv_page, stride_kv_slot, start + ahead * BLOCK_N, end,
                           c_smem.index(ahead % STAGES), pe_smem.index(ahead % STAGES), PAGE_SIZE, BLOCK_N, C_COPY,
                           PE_COPY)  # fmt: skip
        cp.commit_group()
        if PAGES_AHEAD:  # used by the next iteration's copy: the load's latency hides behind this tile's work
            page_next, page_pe_next = _tile_pages(page_row, stride_pt_p, start + (ahead + 1) * BLOCK_N, end,
                                                  PAGE_SIZE, BLOCK_N, C_COPY, PE_COPY, True)  # fmt: skip
        c_tile = c_smem.index(i % STAGES)
        if WGMMA:
            s_t = _scores_t(c_tile, pe_smem.index(i % STAGES), qn_hi, qn_lo, qr_hi, qr_lo, BLOCK_N, ACC_T)
            offs_k = start + i * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, ACC_T))
            s_t = gl.where(offs_k[:, None] < end, s_t * col_scale[None, :], float("-inf"))
            m_cols, m_rows = _col_max(s_t, max_smem, ROWS, ROWS_4, COLS_4)
            m_new_t = gl.maximum(m_t, m_cols)  # the same values as m_new, by columns
            m_new = gl.maximum(m_i, m_rows)
            p_t = gl.exp2(s_t - m_new_t[None, :])
            l_part = l_part * gl.exp2(m_t - m_new_t)[None, :] + p_t
            acc = acc * gl.exp2(m_i - m_new)[:, None]
            m_t = m_new_t
            m_i = m_new
            p_smem.permute((1, 0)).store(p_t.to(gl.float16))
        else:
            c_qk = _view(c_tile, [512, BLOCK_N], C_QK)
            s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, MMA)
            s_int = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, MMA)  # the chunks unpacked by integer instructions
            for c in gl.static_range(4):
                x = c_qk.slice(128 * c, 128, dim=0).load(B)
                if (ALU_QK >> c) & 1:
                    s_int = mma_v2(q_smem.slice(128 * c, 128, dim=1).load(A), _unpack(x, False, True), s_int)
                elif E5M2:
                    s = mma_v2(q_smem.slice(128 * c, 128, dim=1).load(A), _unpack(x, True, False), s)
                else:
                    s = mma_v2(q_smem.slice(128 * c, 128, dim=1).load(A), x.to(gl.float16), s)
            x = _view(pe_smem.index(i % STAGES), [64, BLOCK_N], PE_QK).load(B)
            if (ALU_QK >> 4) & 1:
                s_int = mma_v2(qr_smem.load(A), _unpack(x, False, True), s_int)
            elif E5M2:
                s = mma_v2(qr_smem.load(A), _unpack(x, True, False), s)
            else:
                s = mma_v2(qr_smem.load(A), x.to(gl.float16), s)
            if ALU_QK != 0:
                s = s + s_int * INT_UNPACK_SCALE

            offs_n = start + i * BLOCK_N + gl.arange(0, BLOCK_N, COLS)
            s = gl.where(offs_n[None, :] < end, s * qk_scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, _row_max(s, max_smem, BLOCK_N, ROWS_4, BLOCK_H))  # finite: every tile holds a key
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[:, None])
            l_part = l_part * alpha[:, None] + p
            acc = acc * alpha[:, None]
            m_i = m_new
            if ALU_PV != 0:  # the keys whose values are unpacked times 2^-8: their probabilities times 256
                step = gl.arange(0, BLOCK_N, COLS) // 16
                unpacked = (gl.full([BLOCK_N], ALU_PV, gl.int32, COLS) >> step) & 1
                p = p * gl.where(unpacked != 0, INT_UNPACK_SCALE, 1.0)[None, :]
            p_smem.store(p.to(gl.float16))
        _barrier()

        c_pv = _view(c_tile, [BLOCK_N, 512], C_PV)
        for k in gl.static_range(BLOCK_N // 16):
            x = c_pv.slice(16 * k, 16, dim=0).load(PV_LOAD)
            # four values a call: keys k, k + 1 of columns n, n + 32 -> two float16 pairs (k, k + 1)
            y = _unpack(x, E5M2, ((ALU_PV >> k) & 1) != 0)
            acc = mma_v2(p_smem.slice(16 * k, 16, dim=1).load(A), gl.convert_layout(y, B), acc)
    cp.wait_group(0)

    if WGMMA:
        l_i = gl.convert_layout(gl.sum(l_part, 0), ROWS)
    else:
        l_i = gl.sum(l_part, 1)
    if COALESCED_IO:  # the output in dim order (16 bytes a lane: the values' labels 5-8 are dim bits 0-3)
        acc = gl.convert_layout(_relabel_bits(acc, BLOCK_H, 9, PV_AXES), OUT_IO)  # (the registers reordered)
        offs_ho = head_block * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, OUT_IO))
        dims_o = gl.arange(0, 512, gl.SliceLayout(0, OUT_IO))
        m_i = gl.convert_layout(m_i, gl.SliceLayout(1, OUT_IO))
        l_i = gl.convert_layout(l_i, gl.SliceLayout(1, OUT_IO))
    else:
        offs_ho = head_block * BLOCK_H + gl.arange(0, BLOCK_H, ROWS)
        dims_o = _relabelled(gl.arange(0, 512, COLS), PV_BITS)
    _store_result(acc, m_i, l_i, offs_ho, dims_o, seq, split, start, end, num_heads, num_kv_splits, kv_scale, Out,
                  Lse, PartOut, PartLse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, WRITE_PARTIAL,
                  WRITE_LSE)  # fmt: skip


def arguments(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse, q_scale,
              qk_scale_log2, kv_scale, num_kv_splits) -> tuple:  # fmt: skip
    """The runtime arguments of this module's and ``mla_decode_wide``'s kernels."""
    return (
        q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse,
        q_scale, qk_scale_log2, kv_scale, q_nope.shape[1], num_kv_splits,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), *page_table.stride(),
        out.stride(0), out.stride(1), *lse_buf.stride(),
    )  # fmt: skip


def launch_arguments(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse, *,
                     q_scale, qk_scale_log2, kv_scale, num_kv_splits, write_partial, write_lse, min_split, block_n,
                     stages, wgmma=False, maxnreg=None, alu_scores=0, alu_values=0, pages_ahead=False,
                     coalesced_io=False, head_groups=1, group_regs=False):  # fmt: skip
    """``(grid, args, kwargs)`` of one launch over ``[head blocks of 16 a group, splits, sequences]`` (the arguments as
    ``mla_decode_split_kernel``'s; ``maxnreg``: ptxas' register limit a thread, None for its own choice;
    ``alu_scores``, ``alu_values``: the ``ALU_QK`` and ``ALU_PV`` masks; ``pages_ahead``: ``PAGES_AHEAD``;
    ``coalesced_io``: ``COALESCED_IO``; ``head_groups``: 16-head groups a program, 1, 2 or 4; ``group_regs``: two
    groups on four warps, as :func:`constexprs`)."""
    e5m2 = kv_cache.dtype == torch.float8_e5m2
    if (wgmma or e5m2) and (alu_scores or alu_values):
        raise ValueError(
            f"expected integer unpacking masks only for e4m3 without wgmma scores, got masks {alu_scores},"
            f" {alu_values} over {kv_cache.dtype}{' with wgmma scores' if wgmma else ''}"
        )
    batch, num_heads, _ = q_nope.shape
    grid = (-(-num_heads // (16 * head_groups)), num_kv_splits, batch)
    args = arguments(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse, q_scale,
                     qk_scale_log2, kv_scale, num_kv_splits)  # fmt: skip
    kwargs = {"PAGE_SIZE": kv_cache.shape[1], "WRITE_PARTIAL": write_partial, "WRITE_LSE": write_lse,
              "MIN_SPLIT": min_split, **constexprs(block_n, stages, wgmma, head_groups, group_regs),
              "ALU_QK": alu_scores, "ALU_PV": alu_values, "E5M2": e5m2, "PAGES_AHEAD": pages_ahead,
              "COALESCED_IO": coalesced_io,
              "num_warps": warps(head_groups, group_regs)}  # fmt: skip
    if maxnreg is not None:
        kwargs["maxnreg"] = maxnreg
    return grid, args, kwargs


def launch(*args, **kwargs) -> None:
    """Launch the kernel (arguments as :func:`launch_arguments`)."""
    grid, args, kwargs = launch_arguments(*args, **kwargs)
    mla_decode_fp8_mma_kernel[grid](*args, **kwargs)
