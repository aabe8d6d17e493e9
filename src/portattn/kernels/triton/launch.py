"""Launchers for the attention kernels: validate inputs, pick tiles, compute grids.

Nothing here synchronises with the device: every Python int a launch needs (longest query run,
split count) is passed in by the caller, who got it from ``plan_*``. The host path runs once per
layer: tile choices are cached per shape, and error messages are built only for errors.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from ...device import compute_units, device_model, is_triton_interpreter, max_shared_memory
from ...errors import expect, fail
from ...kv_quant import FP8_DTYPES
from . import tile_table
from .attention import attention_fwd_kernel
from .fast_launch import RepeatLaunch
from .merge import merge_splits_kernel, merge_states_kernel
from .resources import fewer_stages_then, launch_fitting

MAX_KV_SPLITS = 64  # split-KV programs per (q block, KV head); bounds the workspace
# Split-KV: aim for about this many (sequence, query head) work items per launch, so that a batch
# too small to fill a GPU is spread over key ranges instead. A pure function of the problem size:
# the same batch is split the same way on every device, and so gives the same numbers.
SPLIT_TARGET_WORK = 2048
# Single-query decodes aim at half that: on an H200 (32 query / 8 KV heads of 128, bf16) B=1 over
# 16k-128k keys ran fastest at 32 splits and B=4 over 8k-128k at 8, about 256 programs (two per SM),
# where 2048 gave 64 and 16: 0.0750 against 0.0849 ms over 64k keys (84% of copy against 74%), 0.0439
# against 0.0522 at B=4 over 8k (benchmarks/results/round4_h200/NOTES.md). Query runs keep 2048.
DECODE_SPLIT_TARGET_WORK = 1024
MIN_KEYS_PER_SPLIT = 512
# Single-query decodes of few sequences not over an fp8 cache (the split rule's work asks for at least
# FEW_DECODE_SPLITS ranges) keep at least SHORT_SPLIT_KEYS keys a range instead of MIN_KEYS_PER_SPLIT:
# on an H200 at Llama-3-8B's heads, timed as graph replays over caches rotated past the L2
# (benchmarks/results/engine_h200/round15/NOTES.md), one sequence over 1024 keys took 7.6-8.2 us in 16
# or 32 ranges against 12.1 in the 3 that 1536 keys' graph planned (4096 keys: 13.4 against 31.7 in
# 3), four sequences over 1024 / 4096 keys 14.5 / 27.5 in 8 ranges against 15.8 / 38.2 in 3.
FEW_DECODE_SPLITS = 8
# Short decodes: single-query steps over at most SHORT_DECODE_KEYS keys a sequence (the engine's short
# shapes) split into ranges of SHORT_SPLIT_KEYS keys (at most 8) and stream them in 32-key tiles, 4 warps,
# 2 stages (``choose_tiles(short_splits=True)``). A launch there is latency, not bytes: at SmolLM2's
# shape (9 query / 3 KV heads of 64, bf16) on an H200 one sequence over 162 / 320 / 511 keys took
# 4.3 / 5.1 / 5.2 us with its merge against 6.9 / 8.6 / 11.8 in one 64-key-tile program per KV head
# (benchmarks/results/engine_h200/round8/NOTES.md). Where the work allows fewer ranges than that (many
# sequences) none are made: at Llama-3-8B's heads (32 / 8 of 128) 8 sequences over 5-511 keys took
# 14-18 us in 4 longer ranges against 6.7-16.7 in one. fp8 caches keep their own rule (measured at 4096 keys).
SHORT_DECODE_KEYS = 512
SHORT_SPLIT_KEYS = 64
# Unsplit decodes with at least this many programs per SM take shallow 64-key tiles (choose_tiles).
DECODE_MANY_WAVES = 3
# Launch options that stay off until a GPU benchmark shows them faster (launches with the default tiles
# take them; ``python -m benchmarks.engine --kernel-options pages_ahead merge_in_kernel`` turns them on
# for a run): see TileConfig and docs/kernels.md.
PAGES_AHEAD = False
MERGE_SPLITS_IN_KERNEL = False
# Programmatic dependent launch for the attention, merge and fused kernels (``pdl.py``; NVIDIA compute
# capability 9 and later). On: on an H200 SmolLM2's batch-1 decode graph took 795 us against 891 and
# Llama-3-8B's batch-1 replay 4.81 ms against 4.90, batch 64 unchanged
# (benchmarks/results/engine_h200/round7/NOTES.md); ``--kernel-options no_pdl`` turns it off for a run.
PDL = True
# Launches repeated from a plan's memo (attention_forward(memo=)): the next layer's launch skips the
# checks, tile choice and Triton's argument binding the first launch of its geometry did; off: each
# launch computes everything (``--kernel-options no_repeat_launch``).
REPEAT_LAUNCHES = True
QUERIES_PER_WORK_ITEM = 8  # a longer query run already parallelises over query blocks
# Registers a thread of an fp8 decode over keys-contiguous V (choose_tiles): more programs a SM.
FP8_KEYS_MAXNREG = 128


def pdl_options(device: torch.device) -> dict:
    """A launch's keyword arguments for programmatic dependent launch: ``PDL`` (the kernels' constexpr)
    and ``launch_pdl`` where :data:`PDL` is on and ``device`` takes it; none elsewhere."""
    if not PDL or device.type != "cuda" or is_triton_interpreter() or not _takes_pdl(device.index):
        return {}
    return {"PDL": True, "launch_pdl": True}


@functools.cache
def _takes_pdl(index: int | None) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def choose_num_kv_splits(
    max_seqlen_k: int,
    batch_size: int,
    num_heads: int,
    max_seqlen_q: int,
    *,
    num_kv_splits: int | None = None,
    kv_itemsize: int | None = None,
) -> int:
    """How many key ranges each (query block, KV head) is split into; 1 = no split-KV.

    Work items are (sequence, query head, run of 8 queries); splits are added until there are
    about ``SPLIT_TARGET_WORK`` of them (``DECODE_SPLIT_TARGET_WORK`` for single-query decodes),
    keeping at least ``MIN_KEYS_PER_SPLIT`` keys per split (``SHORT_SPLIT_KEYS`` for single-query
    decodes, not over an fp8 cache, of so few sequences that the work asks for ``FEW_DECODE_SPLITS``
    or more splits). Decodes over a one-byte (fp8) cache
    (``kv_itemsize`` 1) take at least 2 splits where the keys allow: on an H200, 64 sequences over
    4096 keys ran 1.09x faster at 2 splits than at 1 (a program keeps as many tiles in flight over
    one-byte keys as over two-byte ones, so it moves half the bytes; 3 and 4 splits were no faster).
    Decode batches and short extends split when few; so do the many queries of a cascade's
    shared-prefix pass (one sequence, every request's queries); long prefills do not. Decodes over
    at most ``SHORT_DECODE_KEYS`` keys of a 16-bit or float32 cache split into ranges of
    ``SHORT_SPLIT_KEYS`` keys where the work allows that many, else not at all (:func:`short_splits`).
    ``num_kv_splits`` given: that count (checked to be in ``[1, MAX_KV_SPLITS]``), for tests and
    benchmarks.
    """
    if num_kv_splits is not None:
        expect(1 <= num_kv_splits <= MAX_KV_SPLITS, f"num_kv_splits in [1, {MAX_KV_SPLITS}]", num_kv_splits)
        return num_kv_splits
    if batch_size == 0:
        return 1
    work = batch_size * num_heads * max(1, -(-max_seqlen_q // QUERIES_PER_WORK_ITEM))
    target = DECODE_SPLIT_TARGET_WORK if max_seqlen_q == 1 else SPLIT_TARGET_WORK
    by_work = -(-target // work)
    if max_seqlen_q == 1 and kv_itemsize == 1:
        by_work = max(by_work, 2)
    if max_seqlen_q == 1 and kv_itemsize != 1 and max_seqlen_k <= SHORT_DECODE_KEYS:
        ranges = -(-max_seqlen_k // SHORT_SPLIT_KEYS)
        return max(1, ranges) if ranges <= by_work else 1  # short ranges, or none: longer ones ran slower
    few = max_seqlen_q == 1 and kv_itemsize != 1 and by_work >= FEW_DECODE_SPLITS
    by_length = max_seqlen_k // (SHORT_SPLIT_KEYS if few else MIN_KEYS_PER_SPLIT)
    return max(1, min(by_work, by_length, MAX_KV_SPLITS))


def short_splits(max_seqlen_q: int, max_seqlen_k: int | None, num_kv_splits: int, kv_itemsize: int) -> bool:
    """Whether a launch's key ranges are short decodes' (:data:`SHORT_SPLIT_KEYS` keys or fewer each,
    one query a sequence, a cache of at least two bytes an element): it then takes
    ``choose_tiles(short_splits=True)``. ``max_seqlen_k`` None (not known): no."""
    if max_seqlen_q != 1 or max_seqlen_k is None or kv_itemsize == 1:
        return False
    return -(-max_seqlen_k // num_kv_splits) <= SHORT_SPLIT_KEYS


def split_partials(
    rows: int, num_heads: int, num_splits: int, value_dim: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for a split launch's partial outputs ``[T, Hq, S, next_pow2(Dv)]`` and base-2 LSEs
    ``[T, Hq, S]`` (float32), as :func:`attention_forward` fills them (``unmerged=`` takes them)."""
    out = torch.empty((rows, num_heads, num_splits, next_pow2(value_dim)), dtype=torch.float32, device=device)
    return out, torch.empty((rows, num_heads, num_splits), dtype=torch.float32, device=device)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n, for launchers (``triton.next_power_of_2`` costs microseconds on the host)."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch shape of one attention launch (``block_m = block_q * group_pad``)."""

    block_q: int
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None  # a register cap per thread (more programs per SM); None: the compiler's
    pages_ahead: bool = False  # paged K/V: each key tile's page ids loaded one tile ahead (see the kernel)
    merge_in_kernel: bool = False  # split launches: the last split of a block merges (no merge kernel)
    whole_pages: bool = False  # paged K/V in whole pages a tile: one page id a page (see the kernel)

    def launch_options(self) -> dict:
        """The compiler options of a launch with these tiles."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"expected {name} to be a power of two, got {value}")


def shared_memory_bytes(tiles: TileConfig, head_dim: int, value_dim: int, itemsize: int) -> int:
    """Shared memory the kernel's software pipeline holds: one K and one V tile per stage (what Triton
    allocates for these kernels on an H200: 128 x 128 fp32 tiles in 2 stages need 262144 bytes)."""
    columns = sum(column_tiles(head_dim)) + sum(column_tiles(value_dim))
    return tiles.num_stages * tiles.block_n * columns * itemsize


def smaller_tiles(tiles: TileConfig, group: int) -> TileConfig | None:
    """The next smaller tiles: one stage less, then half the key tile, then half the query rows."""
    smaller = fewer_stages_then(tiles, "block_n")
    group_pad = next_pow2(group)
    if smaller is None and tiles.block_m > max(16, group_pad):
        block_m = tiles.block_m // 2
        smaller = dataclasses.replace(tiles, block_m=block_m, block_q=block_m // group_pad)
    return smaller


@functools.cache
def choose_tiles(
    max_seqlen_q: int,
    group: int,
    head_dim: int,
    value_dim: int,
    *,
    interpret: bool,
    itemsize: int = 2,
    shared_memory: int | None = None,
    kv_itemsize: int | None = None,
    ieee_dots: bool = False,
    short_splits: bool = False,
    decode_waves: float | None = None,
    device_name: str | None = None,
    v_keys: bool = False,
) -> TileConfig:
    """Tiles from the problem: few query rows per sequence (decode) get small row blocks.

    The GPU defaults are the fastest shapes of ``python -m portattn.bench --sweep`` on an H200
    (``benchmarks/results/NOTES.md``): decode streams 64-key tiles through a 5-stage pipeline; long
    query runs take 128 x 128 tiles at head dim 128 (64 x 64 for short runs), 64 x 64 tiles when
    no column tile is wider than 64 (head dims 64, 80, 96, 112, ...), and 64 x 32 tiles above 128
    columns (160, 192, 224, 256). A GPU that lacks the shared memory steps down at the first launch
    (``resources.py``). Under the CPU interpreter tiles are kept small (its cost grows with tile
    size, and small tiles exercise multi-tile and masked-tile paths on short test sequences).

    ``shared_memory`` (bytes per program, ``device.max_shared_memory``) steps the tiles down up
    front, for the K/V element size (``kv_itemsize``, else ``itemsize``), until their pipeline fits
    (:func:`shared_memory_bytes`): float32 takes twice the bytes of bf16, and a launch that does not
    fit would compile, fail and compile again.

    An fp8 cache (``kv_itemsize`` 1) decodes in 128-key tiles, 4 warps, 2 stages, with each tile's
    page ids loaded a tile ahead (``pages_ahead``): on an H200 the page-table indirection leaves two
    tiles in flight per program whatever ``num_stages`` says, so a tile of one-byte keys must be
    twice as long to keep as many bytes in flight as a 16-bit one
    (benchmarks/results/round3_h200/NOTES.md: 0.264 -> 0.216 ms at B=64 over 4096 keys), and the
    page ids ahead took 3% more (0.1895 against 0.1946 ms, medians of three alternations,
    benchmarks/results/round7_h200/NOTES.md). Over a V cache whose keys are contiguous within each page
    (``v_keys``, :func:`keys_contiguous_v`; the engine's fp8 pools) the tiles hold 64 keys in 3 stages, load
    whole pages (``whole_pages``) and cap a thread's registers at :data:`FP8_KEYS_MAXNREG`: on an H200 (B=64
    over 4096 keys, Hq 32 / Hkv 8 / D 128, page 16, two splits) 0.141 ms against 0.163 with the 128-key
    tiles above, 0.158 without the cap, 0.173 over V in rows of a key and 0.247 over a bfloat16 cache
    (benchmarks/results/round19_h200/NOTES.md).

    Long query runs at head dim 128 (128 x 128 tiles) take 3 stages with the page ids a tile ahead: the
    pipeliner then keeps two K/V tiles in flight (one at 2 stages, and one at 3 with the page ids loaded in
    the same iteration). On an H200 (Hq 32 / Hkv 8, bf16, page 16) a causal prefill of 8192 tokens took
    1.391 ms so, against 1.676 at 3 stages without the page ids ahead and 1.565 at 2 stages with them;
    with the kernel of round 8 the default (2 stages) took 1.580 and the extend of 8 x 512 tokens over
    8192 1.716, now 1.428 (benchmarks/results/round9_h200/NOTES.md). They load whole pages a tile
    (``whole_pages``: one page id a page where the page size divides the key tile; the kernel falls back
    to a page id a row elsewhere): the prefill then took 1.183 ms against 1.387, the extend 1.242
    against 1.437, and pages of 64 and 128 keys 1.196 and 1.163 against 1.359 and 1.350, as fast as
    contiguous K/V (1.180; benchmarks/results/round14_h200/NOTES.md).

    Decodes that are not split (``decode_waves``: their programs, sequences x KV heads, per SM) at head
    dim 128 over a 16-bit cache choose by how many programs each SM holds: at least
    :data:`DECODE_MANY_WAVES` a SM, 64-key tiles in 4 warps and 3 stages; more than one, 128-key tiles in
    4 warps and 2 stages; at most one, 128-key tiles in 4 warps and 3 stages with the page ids a tile
    ahead. On an H200 (Hq 32 / Hkv 8, page 16) B=64 over 1024 keys took 0.0701 ms so against 0.0773 with
    the 5-stage default (90% against 82% of copy), B=128 over 512 0.0748 against 0.0876, B=32 over 1024
    0.0392 against 0.0404 and B=16 over 512 0.0156 against 0.0214 (``scripts/kernels_probe.py batched``,
    benchmarks/results/round10_h200/NOTES.md).

    ``device_name`` (``device.device_model``): a device model whose sweep found faster tiles for this
    problem takes them from :mod:`.tile_table` (keyed by the tiles these rules chose), before the
    shared-memory step-down.

    Decodes whose key ranges hold at most :data:`SHORT_SPLIT_KEYS` keys (``short_splits``,
    :func:`short_splits`) take 32-key tiles in 4 warps and 2 stages: one or two tiles a program, where a
    deep pipeline only adds latency.

    IEEE float32 dots (``ieee_dots``) run on the FMA units, and Triton unrolls each into
    ``BLOCK_M * BLOCK_N * D / threads`` multiply-adds per thread: query runs take 64 x 32 tiles in 4
    warps (32 x 32 above 128 columns). A 128 x 128 tile in 8 warps took 74 s to compile for sm_90 at
    head dim 128, 64 x 32 took 13 s (``docs/kernels.md``).
    """
    group_pad = next_pow2(group)
    if interpret:
        block_m = max(16, group_pad, min(32, next_pow2(max(max_seqlen_q, 1) * group_pad)))
        return TileConfig(block_m // group_pad, block_m, 16)
    pages_ahead = False
    columns = [column_tiles(head_dim), column_tiles(value_dim)]
    wide = max(sum(c) for c in columns) > 128
    narrow = max(c[0] for c in columns) <= 64
    if wide:
        cap, block_n, num_warps, num_stages = 64, 32, 4, 2
    elif narrow:
        cap, block_n, num_warps, num_stages = 64, 64, 4, 3
    else:
        cap, block_n, num_warps, num_stages = 128, 128, 8, 2
    block_m = max(16, group_pad, min(cap, next_pow2(max(max_seqlen_q, 1) * group_pad)))
    fp8_decode = block_m <= 32 and not wide and kv_itemsize == 1
    if fp8_decode and v_keys:  # decode-like over an fp8 cache whose V keys are contiguous
        block_n, num_warps, num_stages = 64, 4, 3
    elif fp8_decode:  # decode-like over an fp8 cache
        block_n, num_warps, num_stages = 128, 4, 2
    elif block_m <= 32 and not wide and short_splits:  # a tile or two of keys a program
        block_n, num_warps, num_stages = 32, 4, 2
    elif block_m <= 32 and not wide and not narrow and decode_waves is not None and kv_itemsize == 2:
        block_n, num_warps, num_stages = batched_decode_tiles(decode_waves)
        pages_ahead = decode_waves <= 1
    elif block_m <= 32 and not wide:  # decode-like: stream the keys through a deep pipeline
        block_n, num_warps, num_stages = 64, 8, 5
    elif block_m < cap and not wide:  # short query runs at head dim 128 (speculative decoding, small extends)
        block_n, num_warps, num_stages = 64, 4, 3
    if ieee_dots and block_m > 32:  # FMA dots: compile time grows with the tile (see above)
        block_m, block_n, num_warps, num_stages = min(block_m, 32 if wide else 64), 32, 4, 2
    long_run = (block_m, block_n) == (128, 128)  # prefills and long extends at head dim 128
    if long_run:
        num_stages = 3
    pages_ahead = pages_ahead or fp8_decode or long_run
    whole_pages = long_run or (fp8_decode and v_keys)
    tiles = TileConfig(
        block_m // group_pad, block_m, block_n, num_warps, num_stages,
        maxnreg=FP8_KEYS_MAXNREG if fp8_decode and v_keys else None, pages_ahead=pages_ahead, whole_pages=whole_pages,
    )  # fmt: skip
    kv_bytes = kv_itemsize or itemsize
    swept = tile_table.entries(device_name)
    entry = swept.get(tile_table.rule_key(tiles, group_pad, head_dim, value_dim, kv_bytes, itemsize)) if swept else None
    if entry is not None:  # this device model's sweep found faster tiles for the problem
        expect(entry["block_m"] >= group_pad, f"a tile table entry with block_m >= {group_pad}", entry)
        tiles = TileConfig(entry["block_m"] // group_pad, **entry, whole_pages=whole_pages)
    chosen = tiles
    while shared_memory is not None and shared_memory_bytes(tiles, head_dim, value_dim, kv_bytes) > shared_memory:
        smaller = smaller_tiles(tiles, group)
        if smaller is None:
            break  # the smallest tiles: the launch reports what the device lacks
        tiles = smaller
    if long_run and tiles.num_stages < 3 and tiles != chosen:  # stepped down: page ids ahead at 2 stages were slower
        tiles = dataclasses.replace(tiles, pages_ahead=False)
    return tiles


def batched_decode_tiles(waves: float) -> tuple[int, int, int]:
    """Key tile, warps and stages of an unsplit decode with ``waves`` programs per SM (see :func:`choose_tiles`)."""
    if waves >= DECODE_MANY_WAVES:
        return 64, 4, 3
    return (128, 4, 2) if waves > 1 else (128, 4, 3)


@functools.cache
def column_tiles(dim: int) -> tuple[int, int, int]:
    """Column tiles covering a head dim: up to three powers of two, each at least 16 wide, largest first.

    The dim rounded up to a multiple of 16 is written as a sum of its binary digits (80 = 64 + 16,
    224 = 128 + 64 + 32, 72 -> 80 = 64 + 16); where that takes more than three tiles (240) one
    tile of the next power of two is used. Unused tiles are 0 wide: ``(128, 0, 0)``.
    """
    full = max(16, next_pow2(dim))
    rounded = -(-dim // 16) * 16
    tiles = [1 << bit for bit in range(rounded.bit_length() - 1, 3, -1) if rounded >> bit & 1]
    if len(tiles) > 3:
        tiles = [full]
    return (*tiles, 0, 0)[:3]


def row_alignment(*tensors: torch.Tensor) -> int:
    """The largest power of two up to 16 that divides every row stride of ``tensors`` (not the last dim's).

    The kernels take their strides divided by it, so the compiler can prove rows aligned and move
    them in 16-byte vectors: head dims such as 40 or 72 have strides Triton does not specialise
    (it specialises multiples of 16 only). Strides past 2**31 elements get 1 (no division).
    """
    align = 16
    for t in tensors:
        for stride in t.stride()[:-1]:
            if stride >= 1 << 31:
                return 1
            while stride % align:
                align //= 2
    return align


def realign_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor):
    """``(q, k, v, out)`` with contiguous copies of those whose rows do not start at multiples of 8 elements
    (``out``: a new buffer, copied back by the caller; ``v`` kept where its keys are contiguous,
    :func:`keys_contiguous_v`: its rows are not loaded as vectors). Such rows are loaded one element at a time,
    and that path gave wrong values (head dim 40) and an illegal access (72) with Triton 3.6 on an
    H200 where a masked column tile feeds the warpgroup MMAs of a long query run (round3 notes)."""
    q, k = (t if row_alignment(t) >= 8 else t.contiguous() for t in (q, k))
    v = v if keys_contiguous_v(v) or row_alignment(v) >= 8 else v.contiguous()
    if row_alignment(out) < 8:
        out = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    return q, k, v, out


def f16_dots_for(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the dots over a ``kv_dtype`` cache read by ``q_dtype`` queries run in float16: for an fp8
    cache and bfloat16 queries. Every fp8 value is a float16, and fp8 -> float16 is one instruction
    per two values on NVIDIA GPUs from sm_89, while fp8 -> bfloat16 goes through float16 and float32."""
    return kv_dtype in FP8_DTYPES and q_dtype == torch.bfloat16


def f16_query_scale(scale: float) -> float:
    """What queries are multiplied by before float16 dots (``F16_DOTS``): the largest power of two not above
    the softmax ``scale``, so that float16's range bounds about ``q * scale`` while bfloat16 (and float16) queries
    convert exactly; the rest of ``scale`` goes into the scores' scale. Multiplied by the scale itself (0.07),
    each query was rounded to float16's 11 bits, and on an H200 MLA's LSE over an fp8 cache left the float64
    reference by 1.1e-3 (a relative 1.4e-4; benchmarks/results/round34_h200/NOTES.md). 1.0 for a scale that is
    not positive and finite (the ops refuse those; the kernels' own callers may pass them)."""
    return 2.0 ** math.floor(math.log2(scale)) if scale > 0 and math.isfinite(scale) else 1.0


def keys_contiguous_v(v: torch.Tensor) -> bool:
    """Whether a paged ``v [N, P, Hkv, Dv]`` has its columns strided (a page's keys contiguous, stored
    ``[N, Hkv, Dv, P]``): the kernel then reads it with ``V_KEYS``. Pages of one key (P = 1) and V with
    a contiguous last dim read as usual."""
    return v.dim() == 4 and v.shape[3] > 1 and v.stride(3) != 1


def dot_precision(dtype: torch.dtype) -> str | None:
    """``tl.dot``'s ``input_precision`` for inputs of ``dtype``: float32 dots are IEEE unless
    ``torch.set_float32_matmul_precision("high")`` (or ``"medium"``) allowed TF32; None for 16-bit."""
    if dtype != torch.float32:
        return None
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


_MERGE_COUNTERS: dict[torch.device, torch.Tensor] = {}


def merge_counters(device: torch.device, count: int) -> torch.Tensor | None:
    """At least ``count`` int32 zeros on ``device`` for in-kernel split merges: one buffer per device,
    kept (the merging programs put their counters back to 0), grown outside graph capture only
    (None while capturing a stream that would need a larger one: the launch merges with the merge
    kernel instead). Launches that use it run one at a time on a device (one stream)."""
    counters = _MERGE_COUNTERS.get(device)
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        size = max(count, 2 * (0 if counters is None else counters.numel()), 1024)
        counters = _MERGE_COUNTERS[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return counters


def _check_inner_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        fail(f"{name} with a contiguous last dim (stride 1)", f"strides {t.stride()}")


def default_tiles(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: int,
    max_seqlen_q: int,
    max_seqlen_k: int | None,
    num_kv_splits: int,
    *,
    paged: bool = True,
    swept: bool = True,
    fit: bool = True,
) -> TileConfig:
    """The tiles :func:`attention_forward` launches with when given none: :func:`choose_tiles` for the
    problem on ``q``'s device, with its device model's :mod:`.tile_table` entries (``paged`` launches: the
    sweep that fills the table times paged cases) and the launch switches :data:`PAGES_AHEAD` and
    :data:`MERGE_SPLITS_IN_KERNEL` (``swept`` False: the rules alone), stepped down to the device's
    shared memory (``fit`` False: not)."""
    num_kv_heads, head_dim, value_dim = v.shape[-2], q.shape[-1], v.shape[-1]
    v_keys = paged and keys_contiguous_v(v)
    tiles = choose_tiles(
        max_seqlen_q,
        q.shape[1] // num_kv_heads,
        head_dim,
        value_dim,
        interpret=is_triton_interpreter(),
        itemsize=q.element_size(),
        shared_memory=max_shared_memory(q.device) if fit else None,
        kv_itemsize=k.element_size(),
        ieee_dots=dot_precision(q.dtype) == "ieee",
        short_splits=short_splits(max_seqlen_q, max_seqlen_k, num_kv_splits, k.element_size()),
        decode_waves=batch * num_kv_heads / compute_units(q.device)
        if max_seqlen_q == 1 and num_kv_splits == 1
        else None,
        device_name=device_model(q.device) if swept and paged else None,
        v_keys=v_keys,
    )
    if swept and (PAGES_AHEAD or MERGE_SPLITS_IN_KERNEL):
        tiles = dataclasses.replace(
            tiles, pages_ahead=tiles.pages_ahead or PAGES_AHEAD, merge_in_kernel=MERGE_SPLITS_IN_KERNEL
        )
    return tiles


def tile_class(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rules: TileConfig) -> str:
    """A launch's problem class in :mod:`.tile_table`, the key :func:`choose_tiles` looks its tiles up by:
    ``rules``, the launch's rules alone before any step-down (``default_tiles(..., swept=False,
    fit=False)``), with the sizes of ``q`` / ``k`` / ``v``."""
    group_pad = next_pow2(q.shape[1] // v.shape[-2])
    return tile_table.rule_key(rules, group_pad, q.shape[-1], v.shape[-1], k.element_size(), q.element_size())


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    *,
    max_seqlen_q: int,
    scale: float,
    page_table: torch.Tensor | None = None,
    kv_start: torch.Tensor | None = None,
    causal: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    logit_softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    num_kv_splits: int = 1,
    tiles: TileConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    max_seqlen_k: int | None = None,
    unmerged: tuple[torch.Tensor, torch.Tensor] | None = None,
    memo: dict | None = None,
) -> torch.Tensor:
    """Attention of ``q [T, Hq, D]`` over paged or contiguous K/V into ``out [T, Hq, Dv]``.

    Paged (``page_table`` given): ``k [N, P, Hkv, D]``, ``v [N, P, Hkv, Dv]``. Contiguous
    (``kv_start`` given, the first key row of each sequence, e.g. ``cu_seqlens_k[:-1]``):
    ``k [Tk, Hkv, D]``, ``v [Tk, Hkv, Dv]``. ``seq_lens_k [B]`` counts the keys of each sequence.
    ``out`` is of q's dtype or float32 (partial results that are merged later); ``lse [T, Hq]``
    float32, when given, receives each row's natural-log LSE. ``k`` and ``v`` are in ``q``'s dtype
    or both in an fp8 dtype, whose stored values times ``k_scale`` / ``v_scale`` are the keys and
    values. ``max_seqlen_k`` (the plan's longest key count, when known) picks the default tiles of
    short decodes (:func:`short_splits`). ``unmerged`` (with ``num_kv_splits > 1``): float32 buffers
    ``[T, Hq, S, next_pow2(Dv)]`` and ``[T, Hq, S]`` that receive the splits' outputs and base-2 LSEs,
    left unmerged and ``out`` unwritten (``fused_launch.merge_linear`` merges them into a projection).

    ``memo``: a dict that lives as long as ``cu_seqlens_q``, ``seq_lens_k`` and the table (a step's
    plan holds one), where a launch keeps what it computed (checks passed, tiles, strides, the
    compiled kernel: :class:`.fast_launch.RepeatLaunch`) for the next launch of the same geometry and
    parameters with other tensors, such as the next layer's.
    """
    key = None
    if memo is not None and REPEAT_LAUNCHES and tiles is None and unmerged is None:
        key = (
            q.shape, q.stride(), q.dtype, k.shape, k.stride(), k.dtype, v.shape, v.stride(), v.dtype,
            out.shape, out.stride(), out.dtype, None if lse is None else (lse.shape, lse.stride(), lse.dtype),
            page_table is None, sinks is None, alibi_slopes is None, q.device, max_seqlen_q, max_seqlen_k,
            num_kv_splits, scale, causal, window_left, window_right, chunk_size, logit_softcap, k_scale, v_scale,
            id(cu_seqlens_q), id(seq_lens_k), id(page_table), id(kv_start),  # kept alive by the memo's entry
        )  # fmt: skip
        repeat = memo.get(key)
        if repeat is not None and repeat(q, k, v, out, lse, sinks, alibi_slopes):
            return out
    paged = page_table is not None
    expect(paged != (kv_start is not None), "exactly one of page_table and kv_start", (page_table, kv_start))
    tensors = {"q": q, "k": k, "v": v, "out": out, "cu_seqlens_q": cu_seqlens_q, "seq_lens_k": seq_lens_k}
    if paged:
        tensors["page_table"] = page_table
    else:
        tensors["kv_start"] = kv_start
    for name, t in tensors.items():
        if t.device != q.device:
            fail(f"{name} on {q.device}", t.device)
    if k.dtype != q.dtype and k.dtype not in FP8_DTYPES:
        fail(f"k of dtype {q.dtype} or fp8", k.dtype)
    if v.dtype != k.dtype:
        fail(f"v of dtype {k.dtype} (as k)", v.dtype)
    if out.dtype not in (q.dtype, torch.float32):
        fail(f"out of dtype {q.dtype} or float32", out.dtype)
    if lse is not None and (lse.dtype != torch.float32 or lse.shape != q.shape[:2] or lse.device != q.device):
        fail(f"lse of dtype float32 and shape {list(q.shape[:2])} on {q.device}", (lse.dtype, lse.shape, lse.device))
    for name in ("cu_seqlens_q", "seq_lens_k", "page_table" if paged else "kv_start"):
        if tensors[name].dtype != torch.int32:
            fail(f"{name} of dtype int32", tensors[name].dtype)
    # A paged V may have its keys contiguous in a page (keys_contiguous_v), read through its column stride.
    v_keys = paged and keys_contiguous_v(v)
    for name in ("q", "k", "out") if v_keys else ("q", "k", "v", "out"):
        _check_inner_contiguous(name, tensors[name])
    expect(1 <= num_kv_splits <= MAX_KV_SPLITS, f"num_kv_splits in [1, {MAX_KV_SPLITS}]", num_kv_splits)

    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, value_dim = v.shape[-2], v.shape[-1]
    expect(tuple(out.shape) == (num_tokens, num_q_heads, value_dim), "out of shape [T, Hq, Dv]", tuple(out.shape))
    group = num_q_heads // num_kv_heads
    batch = seq_lens_k.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    rows = (q, k, out) if v_keys else (q, k, v, out)  # whose rows the kernel loads as vectors
    if head_dim % 8 == 0 and value_dim % 8 == 0 and row_alignment(*rows) < 8:
        q, k, v, staged = realign_rows(q, k, v, out)
        if staged is not out:
            attention_forward(
                q, k, v, staged, cu_seqlens_q, seq_lens_k, max_seqlen_q=max_seqlen_q, scale=scale,
                page_table=page_table, kv_start=kv_start, causal=causal, window_left=window_left,
                window_right=window_right, chunk_size=chunk_size, sinks=sinks, logit_softcap=logit_softcap,
                alibi_slopes=alibi_slopes, lse=lse, num_kv_splits=num_kv_splits, tiles=tiles,
                k_scale=k_scale, v_scale=v_scale, max_seqlen_k=max_seqlen_k, unmerged=unmerged,
            )  # fmt: skip
            return out if unmerged is not None and num_kv_splits > 1 else out.copy_(staged)
    if tiles is None:
        tiles = default_tiles(q, k, v, batch, max_seqlen_q, max_seqlen_k, num_kv_splits, paged=paged)
    group_pad = next_pow2(group)
    expect(tiles.block_m == tiles.block_q * group_pad, f"block_m == block_q * {group_pad}", tiles)
    block_d, block_d2, block_d3 = column_tiles(head_dim)
    block_dv, block_dv2, block_dv3 = column_tiles(value_dim)
    partial_dv = next_pow2(value_dim)

    if paged:
        stride_kp, stride_ks, stride_kh = k.stride(0), k.stride(1), k.stride(2)
        stride_vp, stride_vs, stride_vh = v.stride(0), v.stride(1), v.stride(2)
        page_size, stride_pt, table, starts = k.shape[1], page_table.stride(0), page_table, cu_seqlens_q
    else:
        stride_kp, stride_ks, stride_kh = 0, k.stride(0), k.stride(1)
        stride_vp, stride_vs, stride_vh = 0, v.stride(0), v.stride(1)
        page_size, stride_pt, table, starts = 1, 0, kv_start, kv_start

    if num_kv_splits > 1 and unmerged is not None:
        shapes = ((num_tokens, num_q_heads, num_kv_splits, partial_dv), (num_tokens, num_q_heads, num_kv_splits))
        for name, t, shape in zip(("partial outputs", "partial LSEs"), unmerged, shapes):
            expect(tuple(t.shape) == shape and t.dtype == torch.float32 and t.is_contiguous(),
                   f"contiguous float32 {name} of shape {list(shape)}", (t.dtype, tuple(t.shape)))  # fmt: skip
    f16_dots = f16_dots_for(q.dtype, k.dtype)
    q_scale = f16_query_scale(scale) if f16_dots else 1.0
    qk_scale = scale / q_scale * k_scale
    align = row_alignment(*((q, k, out) if v_keys else (q, k, v, out)))
    v_strides = (stride_vp, stride_vs, stride_vh)  # undivided where V's keys are contiguous (the kernel's V_KEYS)
    v_strides = v_strides if v_keys else tuple(s // align for s in v_strides)
    strides = (
        *(s // align for s in (q.stride(0), q.stride(1), stride_kp, stride_ks, stride_kh)),
        *v_strides, v.stride(-1), *(s // align for s in (out.stride(0), out.stride(1))),
    )  # fmt: skip
    # the kernel's arguments after the tensors (the LSE buffer's strides come with the call)
    scalars = (batch, q_scale, qk_scale, v_scale, logit_softcap, window_left, window_right, chunk_size or 1, *strides)
    split = num_kv_splits > 1

    def arguments(q, k, v, out, lse, sinks, alibi_slopes, counters):
        """The attention kernel's leading arguments for these tensors (this call's table and lengths)."""
        if split:
            partial_out, partial_lse = unmerged or split_partials(num_tokens, num_q_heads, num_kv_splits, value_dim,
                                                                  q.device)  # fmt: skip
        else:
            partial_out = partial_lse = out  # unused
        lse_buf = out[:, :, 0] if lse is None else lse  # unused without lse
        args = (
            q, k, v, out, lse_buf, partial_out, partial_lse,
            table, cu_seqlens_q, seq_lens_k, starts, q if sinks is None else sinks,
            q if alibi_slopes is None else alibi_slopes, seq_lens_k if counters is None else counters,
            *scalars, lse_buf.stride(0), lse_buf.stride(1), stride_pt,
            num_q_heads * num_kv_splits if split else 0, num_kv_splits if split else 0, 1,
        )  # fmt: skip
        return args, partial_out, partial_lse, lse_buf

    def shrink(t: TileConfig) -> TileConfig | None:  # stages, then key tiles, then query rows
        return smaller_tiles(t, group)

    launched = []  # the launch that ran: its RepeatLaunch, whether it merged its splits itself, its buffers

    def launch(t: TileConfig) -> None:
        grid = (num_tokens // t.block_q + batch, num_kv_heads, num_kv_splits)
        counters = None
        if split and t.merge_in_kernel and unmerged is None:
            counters = merge_counters(q.device, grid[0] * grid[1])
        args, *buffers = arguments(q, k, v, out, lse, sinks, alibi_slopes, counters)
        constexprs = dict(
            GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=t.block_q, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_D2=block_d2, BLOCK_D3=block_d3,
            VALUE_DIM=value_dim, BLOCK_DV=block_dv, BLOCK_DV2=block_dv2, BLOCK_DV3=block_dv3,
            PARTIAL_DV=partial_dv, PAGE_SIZE=page_size, PAGED=paged, CAUSAL=causal,
            HAS_WINDOW_LEFT=window_left >= 0, HAS_WINDOW_RIGHT=(not causal) and window_right >= 0,
            HAS_CHUNK=chunk_size is not None, HAS_SINKS=sinks is not None, HAS_SOFTCAP=logit_softcap > 0,
            HAS_ALIBI=alibi_slopes is not None, HAS_LSE=lse is not None, SPLIT=split,
            DOT_PRECISION=dot_precision(q.dtype), ROW_ALIGN=align, F16_DOTS=f16_dots, PAGES_AHEAD=t.pages_ahead,
            MERGE_IN_KERNEL=counters is not None, WHOLE_PAGES=t.whole_pages, V_KEYS=v_keys, **t.launch_options(),
            **pdl_options(q.device),
        )  # fmt: skip
        launched[:] = [RepeatLaunch(attention_fwd_kernel, grid, args, constexprs), counters is not None, buffers]

    launch_fitting(
        launch, tiles, shrink, key=(q.device, tiles, q.dtype, k.dtype, head_dim, value_dim, page_size, v_keys)
    )
    fwd, merged, (partial_out, partial_lse, lse_buf) = launched
    merge = None
    if split and not merged and unmerged is None:
        merge = RepeatLaunch(
            merge_splits_kernel, (num_tokens, num_q_heads),
            (partial_out, partial_lse, q if sinks is None else sinks, out, lse_buf, num_q_heads, num_kv_splits,
             out.stride(0), out.stride(1), lse_buf.stride(0), lse_buf.stride(1)),
            dict(SPLITS_PAD=next_pow2(num_kv_splits), BLOCK_DV=partial_dv, VALUE_DIM=value_dim,
                 HAS_SINKS=sinks is not None, HAS_LSE=lse is not None, **pdl_options(q.device)),
        )  # fmt: skip
    if key is not None:

        def repeat(q, k, v, out, lse, sinks, alibi_slopes) -> bool:
            """This launch again for new tensors of the same geometry; False (nothing launched) where the
            merge counters it used cannot be had now (a graph capture that would need more)."""
            counters = merge_counters(q.device, fwd.grid[0] * fwd.grid[1]) if merged else None
            if merged and counters is None:
                return False
            args, partial_out, partial_lse, lse_buf = arguments(q, k, v, out, lse, sinks, alibi_slopes, counters)
            fwd.again(args)
            if merge is not None:
                merge.again(
                    (partial_out, partial_lse, q if sinks is None else sinks, out, lse_buf, num_q_heads,
                     num_kv_splits, out.stride(0), out.stride(1), lse_buf.stride(0), lse_buf.stride(1))
                )  # fmt: skip
            return True

        memo[key] = repeat
    return out


def merge_states_forward(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: torch.Tensor,
    out_lse: torch.Tensor,
) -> None:
    """Merge two attention states ``out_* [T, H, Dv]`` with natural-log ``lse_* [T, H]`` into ``out``, ``out_lse``.

    Any float dtypes (the math runs in float32) and strides, except a contiguous last dim of the
    outputs; ``out`` may alias ``out_a`` or ``out_b`` (each program reads its row before writing it).
    """
    for name, t in (("out_a", out_a), ("out_b", out_b), ("out", out)):
        _check_inner_contiguous(name, t)
    num_tokens, num_heads, value_dim = out.shape
    if num_tokens == 0 or num_heads == 0:
        return
    merge_states_kernel[(num_tokens, num_heads)](
        out_a, lse_a, out_b, lse_b, out, out_lse,
        out_a.stride(0), out_a.stride(1), lse_a.stride(0), lse_a.stride(1),
        out_b.stride(0), out_b.stride(1), lse_b.stride(0), lse_b.stride(1),
        out.stride(0), out.stride(1), out_lse.stride(0), out_lse.stride(1),
        VALUE_DIM=value_dim, BLOCK_DV=next_pow2(value_dim),
    )  # fmt: skip
