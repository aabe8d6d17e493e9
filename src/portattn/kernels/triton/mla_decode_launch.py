"""Launcher of the MLA decode kernels: validate inputs, pick tiles, compute grids.

Nothing here synchronises with the device: the split count comes from the caller's plan
(:func:`portattn.mla.plan_mla_decode`), and the tiles from the problem's static shape.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ...device import compute_units, is_triton_interpreter
from ...errors import check_int, expect, fail
from ...kv_quant import FP8_DTYPES
from . import launch as attention_launch
from .launch import dot_precision, f16_query_scale, next_pow2
from .mla_decode import mla_decode_merge_kernel, mla_decode_split_kernel
from .mla_workspace import partial_buffers
from .resources import fewer_stages_then, launch_fitting

LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Up to 16 heads over an e4m3 cache take mla_decode_fp8_mma's kernel (relabelled shared-memory views, 16-byte
# loads for both products, mma.sync) where it runs. On an H200 (B=64 over 4096 keys, 16 heads, page 64) it took
# 0.0968 ms against the portable kernel's 0.1075 over e4m3 (1.11x; the bf16 cache: 0.0875), and its GPU tests
# pass once the queries' float16 scale is a power of two (benchmarks/results/round34_h200/NOTES.md). The probe
# (``scripts/kernels_probe.py mla-fp8``) times it with ``MLATileConfig(..., fp8_mma=True)``. Its e5m2 form (the
# byte is float16's high byte) passes the same GPU tests; on an H100 with 16-byte query and output accesses it
# took 0.0694 ms at B=64 against the portable kernel's 0.1095 over e5m2 (1.67x the bf16 cache's 0.1160;
# benchmarks/results/round41/NOTES.md), so an e5m2 cache takes it as well.
FP8_MMA = True
# That kernel runs fastest at about one program an SM: on an H100 (132 SMs; B=64 over 4096 keys, 16 heads, page 64,
# e4m3) the plan's 4 splits (256 programs, two an SM) took 0.1122 ms, 2 splits (128) 0.0918, 3 splits 0.1053, 1
# split 0.1272; the bf16 cache's portable kernel 0.1170 at 4 and 0.1139 at 2 (benchmarks/results/round38/NOTES.md).
# So the launcher runs it at no more splits than fill each SM once (``fp8_mma_splits``); the plan's workspace, sized
# for its own count, holds the fewer splits' partials.
FP8_MMA_ONE_PROGRAM_AN_SM = True
# ... except its 32-head blocks on four warps (``group_regs``: 254 registers a thread, so two programs of four warps
# take the SM's 65,536): latency-bound with one warp a scheduler, they run faster at two programs an SM. On an H100
# (e4m3 over 4096 keys, page 64, graph replays, two runs each; ms) B=64 took at 4 splits against 2: 17 heads 0.0784 /
# 0.0783 against 0.0853 / 0.0840, 20 heads 0.0816 / 0.0816 against 0.0878 / 0.0868, 24 heads 0.0847 / 0.0842 against
# 0.0894 / 0.0885, 28 heads 0.0874 / 0.0859 against 0.0906 / 0.0900, 32 heads 0.0900 / 0.0893 against 0.0914 /
# 0.0904 (3 splits: 0.098-0.104); 20 heads at B=128 0.1490 / 0.1491 at 1 split against 0.1401 / 0.1403 at 2, at B=32
# 0.0510 / 0.0507 at 4 against 0.0500 / 0.0502 at 8. The 16-head blocks (166 registers) stay faster at one program an
# SM: at 64 sequences 0.0687 / 0.0686 ms at 2 splits against 0.0707 / 0.0707 at 4 (benchmarks/results/round51/NOTES.md).
FP8_MMA_32_HEAD_PROGRAMS_AN_SM = 2
# Up to this many heads take it (DeepSeek-V3's 128 heads over 8 or 4 GPUs). On an H100 (B=64 / 128 over 4096
# keys, page 64, e4m3) 32 heads took 0.1086 / 0.1752 ms in 16-head blocks against the wide kernel's 0.1316 / 0.2429
# over e4m3 and the portable kernel's 0.2476 / 0.4724 (benchmarks/results/round44/NOTES.md, round45/NOTES.md).
# 64 heads took 0.1680 / 0.3292 in 16-head blocks, 0.1658 / 0.3284 in 32-head blocks and 0.2044 / 0.3380 in
# 64-head blocks (sixteen warps, some registers spilled) against 0.1306 / 0.2352 by the wide kernel over e4m3, so
# more heads keep its tiles (round46/NOTES.md).
FP8_MMA_MAX_HEADS = 32
# More than this many heads (WIDE_MIN_HEADS) over a 16-bit cache take mla_decode_wide's kernel (64-head blocks, the
# scores split by keys between two warpgroups instead of computed by both) where it runs. On an H200 (B=64 over
# 4096 keys, 128 heads, page 64) a bf16 cache took 0.190 ms against the portable kernel's 0.360 (1.90x; 385 against
# 203 TFLOP/s; benchmarks/results/round34_h200/NOTES.md). 17-32 heads fill part of one block and still gain: on an
# H100 (B=64 / 128 over 4096 keys) 17 heads took 0.1233 / 0.2257 ms against the portable kernel's 0.2027 / 0.3854,
# 32 heads 0.1299 / 0.2344 against 0.2102 / 0.4011 (1.6-1.7x); 16 heads keep the portable kernel's one 16-head
# block (0.1133 at B=64; benchmarks/results/round45/NOTES.md). The probe (``scripts/kernels_probe.py mla-fp8``)
# times it with ``MLATileConfig(64, ..., wide=True)``.
WIDE = True
WIDE_MIN_HEADS = 16
# Like the fp8_mma kernel, the wide one runs at no more splits than fill each SM once where the plan chose the
# count: the plan aims at 256 programs under 64 heads (the portable kernel's smaller blocks), and on an H100 (bf16,
# 4096 keys) 17 / 32 / 48 heads at 8 sequences took 0.0204 / 0.0257 / 0.0287 ms at 16 splits against 0.0350 /
# 0.0395 / 0.0434 at the plan's 32, at 64 sequences 0.1112 / 0.1151 / 0.1188 at 2 against 0.1199 / 0.1275 / 0.1344
# at 4, at 128 sequences 0.2050 / 0.2071 / 0.2094 at 1 against 0.2163 / 0.2253 / 0.2318 at 2
# (benchmarks/results/round45/NOTES.md). From 64 heads the plan's count already fills each SM about once.
WIDE_ONE_PROGRAM_AN_SM = True
# The same over an fp8 cache (e4m3, e5m2): 0.246 ms there against the portable kernel's 0.413 (1.68x; 0.77x of
# itself over bf16: the step is compute-bound and the conversion adds work). Its GPU tests pass once the queries'
# float16 scale is a power of two (``launch.f16_query_scale``; before, their rounding moved the LSE by 1.1e-3).
WIDE_FP8 = True
# Over an fp8 cache the wide kernel takes its fp8-scores form (``WIDE_FP8_SCORES_TILES``: mla_decode_wide_fp8, the
# queries rounded to e4m3 per head row, the scores an fp8 product) where it runs; off, its warp-specialized 16-bit
# form (``WIDE_PRODUCER_TILES``). 17-32 heads take the fp8_mma kernel before either (FP8_MMA).
WIDE_FP8_SCORES = True


@dataclass(frozen=True)
class MLATileConfig:
    """Tiles of one MLA decode launch: heads per program, keys per loop step, warps, stages."""

    block_h: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    separate_values: bool = False  # the latent rows loaded again for the value product (see the kernel)
    dequantize_once: bool = False  # an fp8 tile converted once to 16 bits for both products (see the kernel)
    fp8_mma: bool = False  # an e4m3 or e5m2 cache through mla_decode_fp8_mma (Gluon; NVIDIA, 8.9+, 8.0 for e5m2)
    wgmma_scores: bool = False  # refused: the fp8_mma kernel's warpgroup-MMA scores gave wrong outputs on an H200
    wide: bool = False  # 64-head blocks through mla_decode_wide (Gluon; NVIDIA, compute capability 9.x)
    maxnreg: int | None = None  # fp8_mma: registers a thread at most (ptxas; more programs an SM, some spilled)
    # fp8_mma: bit masks of the scores' five chunks (four of 128 latent dims, the rope) and the values' 16-key
    # steps whose bytes integer instructions convert instead of cvt (F2FP): the two pipes share the work
    alu_scores: int = 0
    alu_values: int = 0
    pages_ahead: bool = False  # fp8_mma: each copy's page ids loaded an iteration before it
    # fp8_mma: the queries loaded and the output stored 16 bytes a lane, relabelled in registers (FP8_MMA_TILES
    # has it; without it each warp loads all the queries 2 bytes a lane and the output is stored 4 bytes a lane,
    # every lane in its own 32-byte sector: 2 of every 3 sectors the kernel asked of memory in Nsight Compute's
    # count)
    coalesced_io: bool = False
    # wide: warp-specialized, a producer warpgroup loads each tile (an fp8 one converted to float16) into a two-slot
    # ring of 16-bit tiles while the two consuming warpgroups attend the other slot's
    producer: bool = False
    # wide, warp-specialized, over an fp8 cache: the queries in e4m3 (a scale a head) and the scores an fp8 product
    # of the cache's tiles as they lie (mla_decode_wide_fp8), copied by TMA (where the pages allow) or cp.async into a
    # ring of fp8 tiles
    fp8_scores: bool = False
    # fp8_scores: the value product in fp8 too (the values transposed into fp8 buffers by the producer, the
    # probabilities times 256 in e4m3); num_stages > 2: that many fp8 tiles in flight (else 3), with one values
    # buffer (else two where they fit: fp8 values)
    fp8_values: bool = False

    def __post_init__(self):
        for name in ("block_h", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"expected {name} to be a power of two >= 16, got {value}")
        if self.wgmma_scores:
            raise ValueError(
                "expected wgmma_scores=False (the fp8_mma kernel's scores by the warpgroup MMA gave wrong outputs on"
                " an H200, max error 2.7-4.2: benchmarks/results/round34_h200/NOTES.md), got True"
            )
        if self.maxnreg is not None and (not self.fp8_mma or self.maxnreg not in range(24, 256, 8)):
            raise ValueError(f"expected maxnreg only with fp8_mma, a multiple of 8 in [24, 248], got {self}")
        if (self.alu_scores or self.alu_values) and not (
            self.fp8_mma and 0 <= self.alu_scores < 32 and 0 <= self.alu_values < 1 << (self.block_n // 16)
        ):
            raise ValueError(
                "expected alu_scores and alu_values only with fp8_mma, bit masks of the 5 score chunks and the"
                f" block_n / 16 value steps, got {self}"
            )
        for name in ("pages_ahead", "coalesced_io"):
            if getattr(self, name) and not self.fp8_mma:
                raise ValueError(f"expected {name} only with fp8_mma, got {self}")
        if self.producer and not self.wide:
            raise ValueError(f"expected producer only with wide, got {self}")
        if self.fp8_scores and not self.producer:
            raise ValueError(f"expected fp8_scores only with wide and producer (a warp-specialized form), got {self}")
        if self.fp8_values and not self.fp8_scores:
            raise ValueError(f"expected fp8_values only with fp8_scores, got {self}")
        # the Gluon kernels' shapes: fp8_mma's 16 heads on four warps, 32 on four or eight, 64 on 16; 32 or 64 keys
        if self.fp8_mma:
            got = (
                self.block_h,
                self.num_warps,
                self.block_n,
                self.num_stages,
                self.separate_values,
                self.dequantize_once,
            )
            shape = got[:2] in ((16, 4), (32, 4), (32, 8), (64, 16))
            if not shape or self.block_n not in (32, 64) or self.num_stages < 2 or any(got[4:]):
                raise ValueError(
                    "expected fp8_mma tiles of 16 heads on 4 warps, 32 on 4 or 8, 64 on 16, 32 or 64 keys, at least 2"
                    f" stages, no separate_values or dequantize_once, got {self}"
                )
        if self.wide and (
            (self.block_h, self.num_warps) != (64, 8)
            or self.block_n not in (32, 64)
            or self.num_stages < 2
            or self.separate_values
            or self.dequantize_once
            or self.fp8_mma
        ):  # the Gluon kernel's fixed shape
            raise ValueError(
                "expected wide tiles of 64 heads, 8 warps, 32 or 64 keys, at least 2 stages, no separate_values,"
                f" dequantize_once or fp8_mma, got {self}"
            )


# 64 keys a step in two buffers: 94 KB of shared memory and 166 registers a thread compiled for sm_90 (two
# programs an SM); 32 keys in 2-3 buffers (57-75 KB) are the probe's other candidates. The queries loaded and the
# output stored 16 bytes a lane (``coalesced_io``): on an H100 (16 heads over 4096 keys, page 64, e4m3, graph
# replays) B = 8 / 16 / 32 / 64 / 128 took 0.0182 / 0.0254 / 0.0413 / 0.0689 / 0.1197 ms, 1.47 / 1.60 / 1.59 /
# 1.69 / 1.82x the bf16 cache, against 0.0925 ms (1.26x) at B=64 with the two-byte loads, and faster than the
# portable kernel over e4m3 at every batch (benchmarks/results/round41/NOTES.md).
FP8_MMA_TILES = MLATileConfig(block_h=16, block_n=64, num_warps=4, num_stages=2, fp8_mma=True, coalesced_io=True)
# 17-32 heads of at least FP8_MMA_32_HEAD_MIN_BATCH sequences: two 16-head groups a program on four warps
# (``group_regs``: the heads 16-31 are a register bit of the MMA's layout), so each warp loads and converts a tile's
# fragments once for both groups and the cache is read once (254 registers a thread compiled for sm_90, no spills).
# On an H100 (e4m3 over 4096 keys, page 64, graph replays; ms) 32 heads took 0.0354 / 0.0537 / 0.0856 / 0.0875 /
# 0.1461 / 0.1506 at B = 16 / 32 / 48 / 64 / 96 / 128, against 0.0368 / 0.0586 / 0.0963 / 0.0995 / 0.1655 /
# 0.1702 for the earlier default (16-head blocks under 32 sequences, two groups on eight warps from 32) and 0.0408
# / 0.0656 / 0.0982 / 0.1150 / 0.1814 / 0.2068 for the bf16 cache; 17 heads 0.0305 / 0.0475 / 0.0844 / 0.1490 at
# B = 16 / 32 / 64 / 128 (bf16 cache 0.0384 / 0.0625 / 0.1119 / 0.2051). Eight sequences run more splits, whose
# partials cost more than the single read saves: 0.0255 against 0.0224 for 16-head blocks
# (benchmarks/results/round47/NOTES.md).
FP8_MMA_32_HEAD_TILES = dataclasses.replace(FP8_MMA_TILES, block_h=32)
FP8_MMA_32_HEAD_MIN_BATCH = 16
# 64 keys a step in two buffers: 229,888 bytes of shared memory (Hopper's limit is 232,448) and 222
# registers a thread compiled for sm_90 by Triton 3.6, over a bfloat16 or an e4m3 cache; 32 keys in 3 buffers
# (189 / 170 KB) are the probe's other candidates.
WIDE_TILES = MLATileConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, wide=True)
# The warp-specialized form (``producer``) is the default: a producer warpgroup loads each tile (over fp8 converting
# it to float16) into a two-slot ring while the consumers attend the other slot. On an H100 (B=64 over 4096 keys,
# page 64, graph replays) 128 heads over e4m3 took 0.1811 ms against 0.2404 for the plain form, 64 heads 0.1087
# against 0.1322; over bf16 the form took 0.1616-0.1940 ms at 128 heads (median of seven 0.1723, spreads up to
# 20%) against 0.1877-0.2027 for the plain one (median 0.1895), 0.0922 against 0.1083 at B=32, 0.3468-0.3664
# against 0.3767 at B=128; from 17 to 64 heads the same time within 1-2% at B=64, and 0.2177 against 0.2298 at 64
# heads and B=128 (benchmarks/results/round48/NOTES.md, round49/NOTES.md).
WIDE_PRODUCER_TILES = dataclasses.replace(WIDE_TILES, producer=True)
WIDE_FP8_TILES = WIDE_PRODUCER_TILES  # its name while fp8 caches took it (now WIDE_FP8_SCORES_TILES)
# The fp8-scores form (``fp8_scores``, mla_decode_wide_fp8) is the default over an fp8 cache (``WIDE_FP8_SCORES``):
# the tiles copied (TMA loads where the pages allow, else cp.async) into a ring of three fp8 slots, the queries
# rounded to e4m3 per head row by a power of two, the scores an fp8 warpgroup product summed into float32 every 256
# dims, the values a float16 product. On an H100 (B=64 over 4096 keys, graph replays, two runs each; ms) 64 heads
# over e4m3 took 0.0958-0.0960 with TMA copies (0.0973-0.0982 by cp.async) against 0.1249-0.1255 for the bf16
# cache (1.30-1.31x; WIDE_PRODUCER_TILES 0.1053-0.1056, 1.20x), at page 16 0.0965-0.0976 against 0.1284-0.1288
# (1.32-1.33x; WIDE_PRODUCER_TILES 0.1138), 40 and 48 heads 1.32x, 128 heads 0.1626-0.1647 against 0.1707-0.1770
# (1.04-1.09x; WIDE_PRODUCER_TILES about 1.0x) (benchmarks/results/round53/NOTES.md). At 32 heads it tied the
# fp8_mma kernel and at 17 it was slower (round 52), so 17-32 heads keep that. The value product in fp8
# (``fp8_values``) was slower: 64 heads 0.1069 / 0.1054, 128 heads 0.1804 / 0.1796 (pipelined: 0.0996-0.1000,
# 0.1712-0.1722). Round 56 removed ptxas's serialization of the form's products (the scores' promotion) and the
# producer's bank conflicts: 64 heads 0.0876-0.0891 against 0.1246-0.1247 (1.40-1.42x), 128 heads 0.1447-0.1448
# against 0.1662-0.1667 (1.15x); at 32 heads 0.0870 against the fp8_mma kernel's 0.0893 (before the producer's
# change), at 17 0.0814 against 0.0782, so 17-32 heads still keep fp8_mma (benchmarks/results/round56/NOTES.md).
WIDE_FP8_SCORES_TILES = dataclasses.replace(WIDE_PRODUCER_TILES, fp8_scores=True)
# Since round 57 the default over an fp8 cache adds the value product in fp8 (``WIDE_FP8_VALUES_TILES``,
# ``WIDE_FP8_VALUES``) where each program has many tiles: the seesaw kernel (mla_decode_seesaw_fp8,
# ``mla_decode_wide_fp8.SEESAW``) where the cache takes TMA copies, else the fp8-scores form with fp8 values. Its
# producer's transposition of the values now reads rows and regroups bytes in registers
# (``mla_decode_wide_fp8.transposing_load``). On an H100 (4096 keys, page 64, graph replays; ms) 128 heads at 64
# sequences took 0.1079 against WIDE_FP8_SCORES_TILES' 0.1455 and the bf16 cache's 0.1658 (1.54x), 32 heads 0.0789
# against 0.0808 and 0.1190 (1.51x), 17 heads 0.0738 against 0.0786 and 0.1147 (1.55x), 48 heads 0.0839 against
# 0.0845, 64 heads 0.0878-0.0901 against 0.0885-0.0889 and 0.1261-0.1264 (1.40-1.44x); 32 heads at 128 sequences
# 0.1178 against 0.1463; on an H200 128 heads at 64 sequences 0.1126 against 0.1458 and 0.1677 (1.49x), 64 heads
# 0.0795 against 0.0857. With few tiles a program the seesaw kernel's pairs cost more than they save: 128 heads at
# 32 sequences 0.0796 against 0.0854, at 16 0.0522 against 0.0513, at 8 0.0386 against 0.0337; 32 heads at 32
# sequences 0.0494 against 0.0472 (benchmarks/results/round57/NOTES.md). So fp8 values are the default from
# ``WIDE_FP8_VALUES_MIN_BLOCKS`` programs a split (sequences x 64-head blocks; the launcher then runs about one
# program an SM, so more of them mean more keys each). The probabilities are rounded to e4m3 for that product (a
# relative 2^-4 each, within the GPU tests' bound).
WIDE_FP8_VALUES = True
WIDE_FP8_VALUES_MIN_BLOCKS = 64
WIDE_FP8_VALUES_TILES = dataclasses.replace(WIDE_FP8_SCORES_TILES, fp8_values=True)
# 17-32 heads over an fp8 cache take the wide kernel's fp8 forms too from this many sequences (fewer: the fp8_mma
# kernel). On an H100 (4096 keys) the fp8-scores form took 0.0206 ms at 32 heads and 8 sequences against fp8_mma's
# 0.0230, 0.0312 at 16 sequences against 0.0450, 0.0808 at 64 against 0.0901 (17 heads: 0.0786 against 0.0780); on an
# H200 0.0200 at 8 sequences against 0.0230, one sequence 0.0177 against 0.0168 (benchmarks/results/round57/NOTES.md).
WIDE_FP8_MIN_BATCH = 8


def choose_tiles(
    num_heads: int,
    dtype: torch.dtype,
    *,
    interpret: bool,
    kv_dtype: torch.dtype | None = None,
    fp8_mma: bool | None = None,
    wide: bool | None = None,
    batch: int | None = None,
    fp8_scores: bool | None = None,
    fp8_values: bool | None = None,
) -> MLATileConfig:
    """Tiles from the problem (``dtype``: the queries'; ``kv_dtype``: the cache's, default the same).

    Few heads (memory-bound): one program holds all of them and streams key blocks through a
    three-stage pipeline. Many heads (compute-bound): 64-head blocks, so that each latent row feeds
    a tall matrix product (Hopper's warpgroup MMA) and is read by few programs. Each choice is the
    fastest, in a sweep on an H200, of the tiles that need at most 164 KB of shared memory
    (benchmarks/results/MLA_NOTES.md). Under the CPU interpreter tiles stay small (its cost grows with
    tile size, and small tiles exercise the multi-block and masked paths on short sequences).

    Over an fp8 cache, few heads load the latent rows again for the value product
    (``separate_values``: both loads then go through the software pipeline), and 64-head blocks take
    64-key tiles in 2 stages (half the bytes of the 16-bit tiles that did not fit). On an H200 (B=64
    over 4096 keys, page 64, e4m3) 16 heads took 0.109 ms so against 0.145, 128 heads 0.411 against
    0.559 (benchmarks/results/round14_h200/NOTES.md). With ``fp8_mma`` (default ``FP8_MMA``) up to 32 heads
    over an e4m3 or e5m2 cache take ``FP8_MMA_TILES`` (``mla_decode_fp8_mma``; ``FP8_MMA_32_HEAD_TILES`` from 17
    heads, unless ``batch``, the sequences, is under ``FP8_MMA_32_HEAD_MIN_BATCH``), and with ``wide`` (default ``WIDE``
    over a 16-bit cache, ``WIDE_FP8`` over fp8) the other cases of more than 16 heads (``WIDE_MIN_HEADS``) take
    ``WIDE_PRODUCER_TILES`` (``mla_decode_wide``'s warp-specialized form; ``WIDE_TILES``, the plain one, when asked),
    over an fp8 cache ``WIDE_FP8_VALUES_TILES`` instead (its fp8-scores form, ``mla_decode_wide_fp8``: queries
    rounded to e4m3, and the value product in fp8: the seesaw kernel where the cache takes TMA copies) unless
    ``fp8_scores`` (default ``WIDE_FP8_SCORES``; ignored over a 16-bit cache) is false, ``WIDE_FP8_SCORES_TILES``
    (float16 values) where ``fp8_values`` (default ``WIDE_FP8_VALUES``, and false for fewer than
    ``WIDE_FP8_VALUES_MIN_BLOCKS`` sequences x 64-head blocks) is false. Where those tiles are the choice,
    17-32 heads take them too, rather than ``fp8_mma``'s, from ``WIDE_FP8_MIN_BATCH`` sequences (``batch`` None:
    not known, taken as many) unless ``fp8_mma`` is true. The launcher replaces them by these rules' tiles where
    those kernels cannot run.
    """
    if interpret:
        return MLATileConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    fp8 = kv_dtype in FP8_DTYPES and dtype != torch.float32
    wide = wide if wide is not None else WIDE_FP8 if fp8 else WIDE
    wide_fp8 = fp8 and wide and num_heads > WIDE_MIN_HEADS and (WIDE_FP8_SCORES if fp8_scores is None else fp8_scores)
    if (
        (FP8_MMA if fp8_mma is None else fp8_mma)
        and kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        and num_heads <= FP8_MMA_MAX_HEADS
        and dtype != torch.float32
        and not (wide_fp8 and fp8_mma is None and (batch is None or batch >= WIDE_FP8_MIN_BATCH))
    ):
        # the launcher takes the portable tiles where the kernel cannot run
        few = num_heads <= 16 or (batch is not None and batch < FP8_MMA_32_HEAD_MIN_BATCH)
        return FP8_MMA_TILES if few else FP8_MMA_32_HEAD_TILES
    if wide and num_heads > WIDE_MIN_HEADS and dtype != torch.float32:
        if wide_fp8:  # likewise
            values = WIDE_FP8_VALUES if fp8_values is None else fp8_values
            blocks = -(-num_heads // WIDE_FP8_VALUES_TILES.block_h)  # a sequence's programs a split
            if fp8_values is None and batch is not None and batch * blocks < WIDE_FP8_VALUES_MIN_BLOCKS:
                values = False  # few tiles a program
            return WIDE_FP8_VALUES_TILES if values else WIDE_FP8_SCORES_TILES
        return WIDE_PRODUCER_TILES  # likewise
    if num_heads <= 16 or dtype == torch.float32:
        return MLATileConfig(block_h=16, block_n=32, num_warps=4, num_stages=3, separate_values=fp8)
    if fp8 and num_heads > 32:
        return MLATileConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
    if num_heads <= 32:
        return MLATileConfig(block_h=32, block_n=32, num_warps=8, num_stages=3)
    # (64, 64, 8, 2) ran 1.1x faster again on an H200 but needs 221 KB of shared memory per program,
    # more than any GPU but Hopper has; this one needs 147 KB.
    return MLATileConfig(block_h=64, block_n=32, num_warps=8, num_stages=3)


def fp8_mma_splits(num_kv_splits: int, programs_per_split: int, sms: int) -> int:
    """The split count the ``fp8_mma`` and wide kernels run at: the plan's ``num_kv_splits`` or fewer, so that the
    programs (``programs_per_split`` a split: sequences x head blocks of 16, 32 or 64) number at most ``sms`` (the
    launcher passes the SMs times :func:`programs_an_sm`); at least 1 (``FP8_MMA_ONE_PROGRAM_AN_SM``,
    ``WIDE_ONE_PROGRAM_AN_SM``: measured in benchmarks/results/round38/NOTES.md, round45/NOTES.md and
    round51/NOTES.md)."""
    return max(1, min(num_kv_splits, sms // max(1, programs_per_split)))


def _group_regs(tiles: MLATileConfig) -> bool:
    """Whether ``tiles`` give the ``fp8_mma`` kernel more 16-head groups than warps (the groups a register bit of the
    MMA's layout: ``FP8_MMA_32_HEAD_TILES``)."""
    return tiles.fp8_mma and tiles.num_warps * 4 < tiles.block_h


def programs_an_sm(tiles: MLATileConfig) -> int:
    """The programs an SM that :func:`fp8_mma_splits` fills: ``FP8_MMA_32_HEAD_PROGRAMS_AN_SM`` for the ``fp8_mma``
    kernel's 32-head blocks on four warps (``group_regs``), else 1."""
    return FP8_MMA_32_HEAD_PROGRAMS_AN_SM if _group_regs(tiles) else 1


def _shrink(tiles: MLATileConfig) -> MLATileConfig | None:
    """Smaller tiles for a device short of shared memory (the fp8 mma kernel: 32 keys, then none)."""
    if tiles.fp8_mma:
        return dataclasses.replace(tiles, block_n=32) if tiles.block_n > 32 else None
    if tiles.wide:
        return dataclasses.replace(tiles, block_n=32) if tiles.block_n > 32 else None
    return fewer_stages_then(tiles, "block_n", "block_h")


def gluon_lacks(tiles: MLATileConfig, q_nope, q_rope, kv_cache, out) -> tuple[str, object] | None:
    """``None`` when the Gluon kernel of ``tiles`` (``fp8_mma``: ``mla_decode_fp8_mma``, ``wide``:
    ``mla_decode_wide``, with ``fp8_scores`` ``mla_decode_wide_fp8``, which needs an fp8 cache) can run the problem
    here, else ``(what it needs, what it got)``."""
    if tiles.fp8_scores and kv_cache.dtype not in FP8_DTYPES:
        return "an fp8 cache (e4m3 or e5m2)", kv_cache.dtype
    if is_triton_interpreter():
        return "a GPU without TRITON_INTERPRET (Gluon kernels are not interpreted)", "TRITON_INTERPRET=1"
    try:
        if tiles.wide:
            from . import mla_decode_wide

            if tiles.fp8_scores:
                from . import mla_decode_wide_fp8  # noqa: F401  (its own Gluon imports)
            return mla_decode_wide.supports(q_nope, q_rope, kv_cache, out)
        from . import mla_decode_fp8_mma
    except ImportError as exc:  # a Triton without Gluon's NVIDIA operations
        return "a Triton with Gluon's NVIDIA operations", exc
    return mla_decode_fp8_mma.supports(q_nope, q_rope, kv_cache, out)


def _explain(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, scale, num_kv_splits, min_split_keys=1) -> None:
    """Raise a ValueError naming the first problem (the slow path, taken only when a check failed)."""
    tensors = {"q_nope": q_nope, "q_rope": q_rope, "kv_cache": kv_cache, "out": out}
    tensors |= {"page_table": page_table, "seq_lens_k": seq_lens_k}
    for name, t in tensors.items():
        expect(t.device == q_nope.device, f"{name} on {q_nope.device}", t.device)
    expect(q_nope.dtype in _DTYPES, "q_nope of dtype float16, bfloat16 or float32", q_nope.dtype)
    for name in ("q_rope", "out"):
        expect(tensors[name].dtype == q_nope.dtype, f"{name} of dtype {q_nope.dtype}", tensors[name].dtype)
    expect(kv_cache.dtype in (q_nope.dtype, *FP8_DTYPES), f"kv_cache of dtype {q_nope.dtype} or fp8", kv_cache.dtype)
    for name in ("page_table", "seq_lens_k"):
        expect(tensors[name].dtype == torch.int32, f"{name} of dtype int32", tensors[name].dtype)
    batch, num_heads, rank = q_nope.shape
    rope_dim = q_rope.shape[2]
    expect(tuple(q_rope.shape[:2]) == (batch, num_heads), f"q_rope of shape [{batch}, {num_heads}, Dr]", q_rope.shape)
    expect(kv_cache.shape[2] == rank + rope_dim, f"kv_cache rows of {rank + rope_dim}", kv_cache.shape[2])
    expect(tuple(out.shape) == (batch, num_heads, rank), f"out of shape [{batch}, {num_heads}, {rank}]", out.shape)
    expect(seq_lens_k.shape == (batch,) and page_table.shape[0] == batch, f"{batch} sequences", seq_lens_k.shape)
    expect(math.isfinite(scale) and scale > 0, "a positive finite scale", scale)
    expect(num_kv_splits >= 1, "num_kv_splits >= 1", num_kv_splits)
    check_int("min_split_keys", min_split_keys, 1)
    raise AssertionError("a launch check failed without an explanation")


def mla_decode_forward(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens_k: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    num_kv_splits: int,
    workspace: torch.Tensor | None = None,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    lse: torch.Tensor | None = None,
    tiles: MLATileConfig | None = None,
    kv_scale: float = 1.0,
    min_split_keys: int = 1,
    fewer_splits: bool = False,
) -> torch.Tensor:
    """MLA decode of ``q_nope [B, H, R]``, ``q_rope [B, H, Dr]`` over ``kv_cache [N, P, R + Dr]`` into ``out [B, H, R]``.

    ``page_table [B, max_pages]`` int32 page-granular, ``seq_lens_k [B]`` int32. With
    ``num_kv_splits > 1`` the partial results go to ``partials`` (float32 ``[B, H, S, R]`` and
    ``[B, H, S]``, as :func:`~portattn.kernels.triton.mla_workspace.partial_buffers` cuts them from a workspace, e.g. once per
    plan) or else to views of ``workspace``, a uint8 buffer of at least
    ``mla_workspace_size(..., num_kv_splits=num_kv_splits)`` bytes. ``lse [B, H]`` float32, when
    given, receives the natural-log LSE of each row. ``kv_cache`` is in ``q_nope``'s dtype or fp8;
    its stored rows times ``kv_scale`` are the latent rows. ``min_split_keys``: keys a split holds at
    least (rounded up to the key tile; see ``mla_decode.py``): the plan's ``min_split_keys``.
    ``fewer_splits``: ``num_kv_splits`` was chosen from the problem (the plan's ``splits_chosen``), so a kernel
    that runs faster at fewer splits may use fewer (``fp8_mma_splits``); otherwise the count is run as given.
    """
    dtype, device = q_nope.dtype, q_nope.device
    batch, num_heads, rank = q_nope.shape
    rope_dim = q_rope.shape[2]
    # One expression on the fast path: this runs once per layer, and formatting error messages
    # eagerly would cost more host time than the kernel takes on a small batch.
    valid = (
        dtype in _DTYPES
        and q_rope.dtype == dtype and (kv_cache.dtype == dtype or kv_cache.dtype in FP8_DTYPES) and out.dtype == dtype
        and page_table.dtype == torch.int32 and seq_lens_k.dtype == torch.int32
        and q_rope.device == device and kv_cache.device == device and out.device == device
        and page_table.device == device and seq_lens_k.device == device
        and q_rope.shape[:2] == q_nope.shape[:2] and kv_cache.shape[2] == rank + rope_dim
        and out.shape == q_nope.shape and seq_lens_k.shape[0] == batch and page_table.shape[0] == batch
        and math.isfinite(scale) and scale > 0 and num_kv_splits >= 1 and type(min_split_keys) is int
        and min_split_keys >= 1
    )  # fmt: skip
    if not valid:
        _explain(q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, scale, num_kv_splits, min_split_keys)
    if lse is not None and not (
        lse.dtype == torch.float32 and lse.shape == (batch, num_heads) and lse.device == device
    ):
        fail(f"lse of dtype float32 and shape [{batch}, {num_heads}] on {device}", (lse.dtype, lse.shape, lse.device))
    if batch == 0:
        return out
    chosen = tiles is None
    if chosen:
        tiles = choose_tiles(num_heads, dtype, interpret=is_triton_interpreter(), kv_dtype=kv_cache.dtype,
                             batch=batch)  # fmt: skip
    if tiles.fp8_mma or tiles.wide:
        lacking = gluon_lacks(tiles, q_nope, q_rope, kv_cache, out)
        flag = "fp8_scores" if tiles.fp8_scores else "wide" if tiles.wide else "fp8_mma"
        if lacking and not chosen:
            fail(f"{lacking[0]} for MLATileConfig({flag}=True) (tiles without it run anywhere)", lacking[1])
        if lacking and tiles.wide:  # the rules without the wide kernel: 17-32 heads over fp8 may take fp8_mma's
            tiles = choose_tiles(num_heads, dtype, interpret=is_triton_interpreter(), kv_dtype=kv_cache.dtype,
                                 wide=False, batch=batch)  # fmt: skip
            lacking = gluon_lacks(tiles, q_nope, q_rope, kv_cache, out) if tiles.fp8_mma else None
        if lacking:
            tiles = choose_tiles(num_heads, dtype, interpret=is_triton_interpreter(), kv_dtype=kv_cache.dtype,
                                 fp8_mma=False, wide=False)  # fmt: skip

    if partials is not None and num_kv_splits > 1:  # the kernels write and the merge reads them as contiguous
        expect(
            all(p.is_contiguous() for p in partials),
            "contiguous partials (the kernels index them as [B, H, splits, R] and [B, H, splits] in order)",
            f"strides {partials[0].stride()} and {partials[1].stride()}",
        )
    one_wave = (tiles.fp8_mma and FP8_MMA_ONE_PROGRAM_AN_SM) or (tiles.wide and WIDE_ONE_PROGRAM_AN_SM)
    if fewer_splits and one_wave and num_kv_splits > 1:
        sms = compute_units(device) * programs_an_sm(tiles)
        fewer = fp8_mma_splits(num_kv_splits, batch * -(-num_heads // tiles.block_h), sms)
        if fewer < num_kv_splits:
            if partials is not None:  # the same buffers' first elements, for fewer splits
                rows = batch * num_heads * fewer
                partials = (partials[0].view(-1)[: rows * rank].view(batch, num_heads, fewer, rank),
                            partials[1].view(-1)[:rows].view(batch, num_heads, fewer))  # fmt: skip
            num_kv_splits = fewer
    split = num_kv_splits > 1
    if split and partials is None:
        needed = 4 * batch * num_heads * num_kv_splits * (rank + 1)
        expect(
            workspace is not None and workspace.dtype == torch.uint8 and workspace.numel() >= needed,
            f"a uint8 workspace of at least {needed} bytes for {num_kv_splits} splits",
            None if workspace is None else f"{workspace.dtype} of {workspace.numel()} elements",
        )
        partials = partial_buffers(workspace, batch, num_heads, num_kv_splits, rank)
    if split:
        part_out, part_lse = partials
        expect(
            part_out.shape == (batch, num_heads, num_kv_splits, rank) and part_out.dtype == torch.float32
            and part_lse.shape == (batch, num_heads, num_kv_splits) and part_lse.dtype == torch.float32,
            f"float32 partials of shapes [{batch}, {num_heads}, {num_kv_splits}, {rank}] and [.., {num_kv_splits}]",
            (part_out.shape, part_lse.shape),
        )  # fmt: skip
    else:
        part_out = part_lse = out  # unused
    lse_buf = out[:, :, 0] if lse is None else lse  # unused without lse
    f16_dots = attention_launch.f16_dots_for(dtype, kv_cache.dtype)
    block_r = max(16, next_pow2(rank))
    block_rp = max(16, next_pow2(rope_dim)) if rope_dim else 16
    merge_out = part_out  # the partial outputs the launch wrote (the seesaw kernel's BF16_PARTIALS: bfloat16)

    def launch(t: MLATileConfig) -> None:
        nonlocal merge_out
        merge_out = part_out
        if t.fp8_mma:
            from . import mla_decode_fp8_mma

            q_scale = f16_query_scale(scale)  # float16 dots, as F16_DOTS
            qk_scale_log2 = scale / q_scale * kv_scale * LOG2E
            mla_decode_fp8_mma.launch(
                q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse,
                q_scale=q_scale, qk_scale_log2=qk_scale_log2, kv_scale=kv_scale, num_kv_splits=num_kv_splits,
                write_partial=split, write_lse=lse is not None, min_split=min_split_keys, block_n=t.block_n,
                stages=t.num_stages, maxnreg=t.maxnreg, alu_scores=t.alu_scores, alu_values=t.alu_values,
                pages_ahead=t.pages_ahead, coalesced_io=t.coalesced_io, head_groups=t.block_h // 16,
                group_regs=_group_regs(t),
            )  # fmt: skip
            return
        if t.fp8_scores:
            from . import mla_decode_wide_fp8

            ring = t.num_stages if t.num_stages > 2 else mla_decode_wide_fp8.RING
            form = mla_decode_wide_fp8
            if mla_decode_wide_fp8.SEESAW and t.fp8_values and t.block_n == 64:
                from . import mla_decode_seesaw_fp8

                if mla_decode_seesaw_fp8.supports(kv_cache) is None:
                    form = mla_decode_seesaw_fp8
                    if mla_decode_wide_fp8.SEESAW_VREGS:
                        from . import mla_decode_seesaw_vregs as form
                    elif split and mla_decode_seesaw_fp8.BF16_PARTIALS:
                        merge_out = mla_decode_seesaw_fp8.bf16_partials(part_out)
            form.launch(
                q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, merge_out, part_lse,
                q_scale=1.0, qk_scale_log2=scale * kv_scale * LOG2E, kv_scale=kv_scale, num_kv_splits=num_kv_splits,
                write_partial=split, write_lse=lse is not None, min_split=min_split_keys, block_n=t.block_n,
                fp8_values=t.fp8_values, ring=ring, value_bufs=2 if t.fp8_values and ring == 3 else 1,
            )  # fmt: skip
            return
        if t.wide:
            from . import mla_decode_wide

            fp8 = kv_cache.dtype in FP8_DTYPES  # float16 dots over an fp8 cache, as F16_DOTS
            q_scale = f16_query_scale(scale) if fp8 else 1.0
            qk_scale_log2 = scale / q_scale * kv_scale * LOG2E
            mla_decode_wide.launch(
                q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse,
                q_scale=q_scale, qk_scale_log2=qk_scale_log2, kv_scale=kv_scale, num_kv_splits=num_kv_splits,
                write_partial=split, write_lse=lse is not None, min_split=min_split_keys, block_n=t.block_n,
                stages=t.num_stages, producer=t.producer,
            )  # fmt: skip
            return
        grid = (-(-num_heads // t.block_h), num_kv_splits, batch)
        # Float16 dots for an fp8 cache where few heads share a program: with 64-head blocks they
        # ran 1.3x slower than bfloat16 dots on an H200 (0.74 vs 0.56 ms at B=64, H=128; not profiled).
        f16 = f16_dots and t.block_h <= 32
        q_scale = f16_query_scale(scale) if f16 else 1.0
        qk_scale_log2 = scale / q_scale * kv_scale * LOG2E
        mla_decode_split_kernel[grid](
            q_nope, q_rope, kv_cache, page_table, seq_lens_k, out, lse_buf, part_out, part_lse,
            q_scale, qk_scale_log2, kv_scale,
            num_heads, num_kv_splits,
            *q_nope.stride(), *q_rope.stride(), *kv_cache.stride(), *page_table.stride(), *out.stride(),
            *lse_buf.stride(),
            KV_LORA_RANK=rank, ROPE_DIM=rope_dim, PAGE_SIZE=kv_cache.shape[1],
            BLOCK_H=t.block_h, BLOCK_N=t.block_n, BLOCK_R=block_r, BLOCK_RP=block_rp,
            WRITE_PARTIAL=split, WRITE_LSE=lse is not None,
            DOT_PRECISION=dot_precision(dtype), F16_DOTS=f16, MIN_SPLIT=min_split_keys,
            SEPARATE_VALUES=t.separate_values,
            DEQUANTIZE_ONCE=t.dequantize_once,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )  # fmt: skip

    # Splits are cut at multiples of block_n; the merge is told the tiles that ran.
    tiles = launch_fitting(
        launch,
        tiles,
        _shrink,
        key=(q_nope.device, tiles, dtype, kv_cache.dtype, num_heads, rank, rope_dim, kv_cache.shape[1]),
    )
    if split:
        mla_decode_merge_kernel[(num_heads, batch)](
            merge_out, part_lse, seq_lens_k, out, lse_buf,
            num_heads, num_kv_splits,
            *out.stride(), *lse_buf.stride(),
            KV_LORA_RANK=rank, BLOCK_R=block_r, SPLIT_ALIGN=tiles.block_n, WRITE_LSE=lse is not None,
            MIN_SPLIT=min_split_keys,
            num_warps=4, **attention_launch.pdl_options(device),
        )  # fmt: skip
    return out
