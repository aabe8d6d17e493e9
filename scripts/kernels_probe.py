"""Kernel probes on a GPU: head dims, fp8 decode, long decode, float32 dots (``scripts/gpu.sh "bench probe"``).

``PYTHONPATH=src:tests python scripts/kernels_probe.py SECTION [--out DIR]`` with SECTION one of

* ``headdims-unaligned``: head dims 40 / 72 / 59 in fp16 and bf16 with the row alignment the kernel is
  told forced to 1 (the launches before ``launch.row_alignment``); prints each case's max error, or
  dies on an illegal access (run it in its own process);
* ``fp8``: decode B=64 L=4096 P=16 (Hq 32 / Hkv 8 / D 128, bf16 queries): the bf16 cache, fp8 e4m3
  and e5m2 with the default tiles, e4m3 over ``FP8_VARIANTS`` (tiles and split counts); then ``mla-fp8``;
* ``mla-fp8``: MLA decode B=64 L=4096 (rank 512 + 64, page 64) over bf16 and fp8 latent caches at H 16
  and 128, the default tiles and ``MLA_FP8_TILES``; at 128 heads each cache through ``MLA_WIDE_TILES``;
* ``long``: decode B=1 L=65536 P=16 with the default tiles and over ``LONG_VARIANTS``, each timed as
  CUDA-graph replays (``timing.measure_graph``: median and spread);
* ``splits``: decode at B=1 and 4 over 8k-128k keys at 8-64 splits, and an fp8 cache at B=8 and 64
  over 4096 keys at 1-4 splits (where the split rule should sit);
* ``fp32``: float32 paged attention and MLA decode against float64, IEEE dots and TF32.
* ``short``: batch-1 and batch-8 decodes at SmolLM2-135M's shape (Hq 9 / Hkv 3 / D 64, page 16) over
  5-511 keys, the default tiles (no splits: the engine's short shapes) against ``SHORT_VARIANTS``
  (tiles, splits, page ids ahead, splits merged in the kernel): what a short step's attention costs.
* ``batched``: decodes of 16-128 sequences over 512-2048 keys at Llama-3-8B's heads (the engine's
  decode batches): the default split count and tiles against 2 and 4 splits and ``BATCHED_TILES``.
* ``served``: the split decodes of served steps (8-28 sequences over 768-2048 keys, where the split rule
  gives 2-4 ranges) and the long ones the split tiles were measured on (1-8 sequences over 4k-64k keys):
  the default tiles against ``SERVED_TILES`` at the same split count (which tiles split decodes take).
* ``job``: the offline job's attention: decodes of 128 and 256 sequences over 1152 keys and a prompt
  chunk of 16 x 1024 causal tokens, the default tiles against ``JOB_DECODE_TILES`` / ``JOB_PREFILL_TILES``.
* ``few``: decodes of 1-16 sequences over 1024 and 4096 keys: the default against 1-8 splits in each of
  ``FEW_TILES`` (where the split rule and the tiles of a program per SM or fewer should sit).
* ``one``: decodes of 1 and 4 sequences over 1024 and 4096 keys, caches rotated past the L2: split
  counts 3-32 x tiles, merged by the merge kernel or by the last split (the engine's batch-1 step).
* ``prefill``: causal prefill B=1 L=8192 (Hq 32 / Hkv 8 / D 128, bf16): the paged kernel at page 16
  (default, ``PREFILL_TILES``, whole pages a tile) and at ``PREFILL_PAGES``, the kernel over contiguous K/V, a
  descriptor (TMA) kernel on contiguous K/V (``TMA_TILES``, with and without a warp-specialized loop)
  and the same kernel with pointer loads (``POINTER_TILES``),
  SDPA cuDNN and FlashAttention: how much of the gap to cuDNN is the page gather.
* ``fp8ab``: the fp8 decode's default tiles against ``FP8_AB_CANDIDATE`` (page ids a tile ahead),
  e4m3 and e5m2, timed alternately over ``--rounds`` rounds beside the bf16 cache (is a gain steady?).
* ``rotary``: the rotary K/V write (``fused_launch.rotary_kv_write``) at Llama-3-8B's heads over
  ``ROTARY_TOKENS`` tokens: the default program (one token, one head) against ``ROTARY_PROGRAMS``
  (blocks of tokens and heads), as a fraction of copy over the bytes it reads and writes.
* ``small-linears``: ``norm_linear`` / ``norm_linear_rotary`` at SmolLM2-135M's projections and LM head,
  1 and 8 rows: the default tiles against ``SMALL_LINEAR_TILES``; the LM head also as torch runs it.
* ``wide-linears``: ``norm_linear`` at Llama-3-8B's projections, one row, against cuBLAS: a tile sweep
  of the plain product, then the fused launches (norm, rotary write, gated activation) with the fastest.
* ``row-linears``: ``row_linear`` (one row on the vector units) at the same projections against cuBLAS,
  plain and with the norm (and the gated activation) folded in, over ``ROW_LINEAR_TILES``.
* ``gated-rows``: ``row_linear``'s gate/up launch with gate and up rows in two blocks against
  alternating rows (one run a program), beside the plain product, over ``GATED_ROW_TILES``.

Every section prints its rows and writes ``DIR/<section>.json`` and its plot ``DIR/<section>.png`` (the
timed rows' milliseconds); ceilings (copy, bf16 matmul) come from the same process.
``--replot FILE.json ...`` draws the plots of committed results again (no GPU needed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from portattn.backends.base import AttentionParams
from portattn.backends.triton import TritonBackend
from portattn.bench import peers
from portattn.bench.ceilings import measure_ceilings
from portattn.bench.paged_attention import PagedCase, _inputs
from portattn.bench.timing import measure, measure_graph
from portattn.device import synchronize
from portattn.kernels.triton import launch, mla_decode_launch
from portattn.kernels.triton.fused_launch import RotaryTiles, rotary_kv_write
from portattn.kernels.triton.launch import TileConfig, attention_forward, choose_num_kv_splits, choose_tiles
from portattn.kernels.triton.mla_decode_launch import MLATileConfig
from portattn.kv_quant import quantize_kv
from portattn.testing import make_paged_case, max_error, mla_decode_ref, paged_attention_ref

DEV = torch.device(os.environ.get("PROBE_DEVICE", "cuda"))  # "cpu" with TRITON_INTERPRET=1: a smoke test


def _paged_call(case: PagedCase, s: dict, out, tiles=None, splits=None, k_scale=1.0, v_scale=1.0):
    b = case.batch
    cu_q = torch.arange(0, b + 1, device=DEV, dtype=torch.int32) * case.q_len
    seq_lens = torch.full((b,), case.k_len, device=DEV, dtype=torch.int32)
    if splits is None:
        splits = choose_num_kv_splits(
            case.k_len, b, case.num_q_heads, case.q_len, kv_itemsize=s[0]["k_cache"].element_size()
        )  # as the backend's plan: an fp8 cache's decodes take at least 2 splits
    return lambda i: attention_forward(
        s[i]["q"], s[i]["k_cache"], s[i]["v_cache"], out, cu_q, seq_lens, max_seqlen_q=case.q_len,
        scale=case.head_dim**-0.5, page_table=s[i]["page_table"], num_kv_splits=splits, tiles=tiles,
        k_scale=k_scale, v_scale=v_scale, max_seqlen_k=case.k_len,
    )  # fmt: skip


def _timed(fn, n, graph=True) -> dict:
    t = measure_graph(fn, list(range(n)), DEV) if graph else measure(fn, list(range(n)), DEV)
    return {"ms": t.median_ms, "p10": t.p10_ms, "p90": t.p90_ms, "spread": t.spread}


def _record(rows: dict, path: Path, section: str, key: str, fn, nbytes: int, ceil, flops: float = 0.0) -> None:
    """Time ``fn`` as graph replays into ``rows[key]`` (with its fraction of copy for ``nbytes`` moved,
    or with ``flops`` its TFLOP/s and fraction of the matmul rate; the error line if it fails), print it
    and rewrite ``path``."""
    label = f"{section} {key:<44}"
    try:
        r = _timed(fn, 2)
    except Exception as exc:
        rows[key] = peers.error_line(exc)
        print(f"{label} {rows[key]}", flush=True)
        return
    if flops:
        r["tflop_s"] = flops / r["ms"] / 1e9
        r["frac_matmul"] = r["tflop_s"] / ceil.matmul_tflop_s
        rate = f"{r['tflop_s']:.0f} TFLOP/s"
    else:
        r["frac_copy"] = nbytes / r["ms"] / 1e9 / ceil.copy_tb_s
        rate = f"{r['frac_copy']:.0%} of copy"
    rows[key] = r
    print(f"{label} {r['ms']:.4f} ms spread {r['spread']:.1%} {rate}", flush=True)
    path.write_text(json.dumps(rows, indent=1))


def headdims_unaligned(out: Path, dims: list[int]) -> dict:
    launch.row_alignment = lambda *tensors: 1  # the launches as they were: no alignment, no copies
    launch.realign_rows = lambda q, k, v, out: (q, k, v, out)
    rows = {}
    for head_dim in dims:
        for dtype in (torch.float16, torch.bfloat16):
            for q_lens, k_lens, name in (([1, 1, 1], [21, 300, 64], "decode"), ([9, 200], [30, 200], "extend")):
                case = make_paged_case(q_lens, k_lens, page_size=16, head_dim=head_dim, dtype=dtype, device=DEV)
                res = torch.full((*case.q.shape[:2], head_dim), float("nan"), dtype=dtype, device=DEV)
                be = TritonBackend()
                meta = be.plan_paged(case.cu_seqlens_q, case.seq_lens_k, case.page_table, 16, num_heads=case.q.shape[1])
                be.paged_attention(case.q, case.k_cache, case.v_cache, meta, AttentionParams(scale=0.1), res)
                synchronize(DEV)
                ref = paged_attention_ref(**case.inputs(), scale=0.1)
                key = f"D={head_dim} {str(dtype)[6:]} {name}"
                rows[key] = max_error(res, ref)
                print(f"unaligned {key:<28} max error {rows[key]:.3e}", flush=True)
                (out / "headdims_unaligned.json").write_text(json.dumps(rows, indent=1))
    return rows


# (block_n, warps, stages, splits, maxnreg, pages_ahead). The first round swept (64|128|32, 4|8, 2..5) at
# one split: 128 x 4 warps x 3 stages was the fastest (0.216 ms), and became the fp8 decode default.
# Round 3/4: 128 x 4 x 3 (the default) 0.212 ms at 1 split, 0.193 at 2; 256 x 4 x 2 0.209. The pipeliner
# keeps floor((stages - 1) / 2) K/V tiles in flight here (scripts/pipeline_depth.py): 3 or 4 stages
# keep one. Round 5: 5-8 stages (two or three tiles) were slower (0.204-0.244 ms against 0.195 at 3);
# so were register caps (maxnreg 128: 0.199; 96: 0.310) for more programs per SM
# (benchmarks/results/round5_h200/NOTES.md). Next: page ids loaded a tile ahead by hand (pages_ahead),
# where the pipeliner keeps stages - 1 tiles (two at 3 stages, in Triton 3.9's compile).
FP8_VARIANTS = [(128, 4, 3, 2, None, False), (128, 4, 3, 2, None, True), (128, 4, 2, 2, None, True),
                (128, 4, 4, 2, None, True), (64, 4, 3, 2, None, True), (64, 4, 4, 2, None, True),
                (128, 8, 3, 2, None, True), (128, 4, 3, 1, None, True), (256, 4, 2, 2, None, True),
                # a register cap: 168 registers a thread hold three programs an SM (Nsight Compute, round 13)
                (128, 4, 2, 2, 128, True), (128, 4, 2, 1, 128, True), (128, 4, 3, 1, 128, True),
                (64, 4, 3, 2, 128, True), (128, 4, 2, 2, 96, True)]  # fmt: skip
# bf16 decodes with page ids a tile ahead (the default 64 x 8 x 5 keeps two tiles; these keep 2-4).
BF16_AHEAD_VARIANTS = [(64, 8, 3, 1), (64, 8, 4, 1), (64, 8, 5, 1), (128, 4, 3, 1)]
# Round 6's fastest fp8 row (0.1862 ms against the default's 0.1925 in one run): 2 splits.
FP8_AB_CANDIDATE = (128, 4, 2, 2, None, True)
# Fields of MLATileConfig: heads per program, keys a step, warps, stages, the latent rows loaded again for
# the value product, an fp8 tile converted once to 16 bits for both products, the Gluon kernel over
# relabelled views (mla_decode_fp8_mma: 16 heads a program; its rows are listed first), its scores by the
# warpgroup MMA in e4m3, (then the 64-head kernel, a register limit and) the masks of the scores' chunks and the
# values' steps whose bytes integer instructions unpack instead of cvt (F2FP), each copy's page ids a step ahead,
# the queries loaded and the output stored 16 bytes a lane (coalesced_io, round 39; the default since round 41,
# here also with 3 and 4 buffers: more bytes in flight at one program an SM).
# The rows: that kernel's tiles (with about half the unpacking moved to the integer pipe, by phase or within each,
# and all of it; with the page ids ahead) and round 31's one-stage tiles converted once (the other tl variants were
# timed in rounds 14-27: benchmarks/results/MLA_NOTES.md).
MLA_FP8_TILES = {16: [(16, 64, 4, 2, False, False, True), (16, 32, 4, 2, False, False, True),
                      (16, 32, 4, 3, False, False, True), (16, 32, 4, 1, False, True),
                      (16, 64, 4, 2, False, False, True, False, False, None, 0, 0b1111),
                      (16, 64, 4, 2, False, False, True, False, False, None, 0b01010, 0b1010),
                      (16, 64, 4, 2, False, False, True, False, False, None, 0b11111, 0b1111),
                      (16, 32, 4, 2, False, False, True, False, False, None, 0b01010, 0b10),
                      (16, 64, 4, 2, False, False, True, False, False, None, 0, 0, True),
                      (16, 64, 4, 2, False, False, True, False, False, None, 0, 0, False, True),
                      (16, 64, 4, 3, False, False, True, False, False, None, 0, 0, False, True),
                      (16, 64, 4, 4, False, False, True, False, False, None, 0, 0, False, True)],
                 128: [(16, 64, 4, 2, False, False, True), (64, 64, 8, 2, False, True)]}  # fmt: skip
MLA_WIDE_TILES = [(64, 64, 8, 2), (64, 32, 8, 3), (64, 32, 8, 2)]  # mla_decode_wide (more than 32 heads)
# The fp8_mma kernel over an e5m2 cache (its bytes unpacked by prmt alone, no conversion instructions; round 38)
MLA_E5M2_TILES = {16: [(16, 64, 4, 2, False, False, True), (16, 32, 4, 2, False, False, True),
                       (16, 32, 4, 3, False, False, True),
                       (16, 64, 4, 2, False, False, True, False, False, None, 0, 0, True),
                       (16, 64, 4, 2, False, False, True, False, False, None, 0, 0, False, True)]}  # fmt: skip


def fp8(out: Path, ceil) -> dict:
    rows = {}
    case = PagedCase("decode B=64 L=4096 P=16", 64, 1, 4096, peers=())
    sets = [_inputs(case, torch.bfloat16, DEV, seed) for seed in range(2)]
    o = torch.empty(64, 32, 128, device=DEV, dtype=torch.bfloat16)
    ks, vs = 0.5, 0.25
    fp8_sets = {}
    for name, dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        fp8_sets[name] = [
            {**s, "k_cache": quantize_kv(s["k_cache"], dt, ks), "v_cache": quantize_kv(s["v_cache"], dt, vs)}
            for s in sets
        ]
    kv_bytes = 64 * 4096 * 8 * 128 * 2

    def record(key, fn, nbytes, graph=True):
        r = _timed(fn, 2, graph)
        r["tb_s"] = nbytes / r["ms"] / 1e9
        r["frac_copy"] = r["tb_s"] / ceil.copy_tb_s
        rows[key] = r
        print(f"fp8 {key:<44} {r['ms']:.4f} ms (spread {r['spread']:.1%}) {r['tb_s']:.2f} TB/s "
              f"{r['frac_copy']:.0%} of copy", flush=True)  # fmt: skip
        (out / "fp8.json").write_text(json.dumps(rows, indent=1))

    record("bf16 cache", _paged_call(case, sets, o), 2 * kv_bytes)
    for name, s in fp8_sets.items():
        record(f"{name} default", _paged_call(case, s, o, k_scale=ks, v_scale=vs), kv_bytes)
    default = choose_tiles(1, 4, 128, 128, interpret=False)
    for n, w, st, sp, reg, ahead in FP8_VARIANTS:
        t = TileConfig(default.block_q, default.block_m, n, w, st, reg, ahead)
        fn = _paged_call(case, fp8_sets["e4m3"], o, tiles=t, splits=sp, k_scale=ks, v_scale=vs)
        key = f"e4m3 n{n} w{w} s{st} S{sp} r{reg}{' ahead' if ahead else ''}"
        try:
            record(key, fn, kv_bytes)
        except Exception as exc:
            rows[key] = peers.error_line(exc)
    for n, w, st, sp in BF16_AHEAD_VARIANTS:
        t = TileConfig(default.block_q, default.block_m, n, w, st, pages_ahead=True)
        key = f"bf16 n{n} w{w} s{st} S{sp} ahead"
        try:
            record(key, _paged_call(case, sets, o, tiles=t, splits=sp), 2 * kv_bytes)
        except Exception as exc:
            rows[key] = peers.error_line(exc)
    (out / "fp8.json").write_text(json.dumps(rows, indent=1))
    return rows | mla_fp8(out, ceil)


def mla_fp8(out: Path, ceil) -> dict:
    """MLA decode, DeepSeek-V3 latent (512 + 64), page 64, B=64 L=4096: bf16 and fp8 latent caches at H 16
    and 128, the default tiles and ``MLA_FP8_TILES``; e5m2 with the default tiles; at 128 heads each cache
    through ``mla_decode_wide`` in ``MLA_WIDE_TILES``."""
    rows = {}

    def record(key, fn, nbytes, graph=True):
        r = _timed(fn, 2, graph)
        r["tb_s"] = nbytes / r["ms"] / 1e9
        r["frac_copy"] = r["tb_s"] / ceil.copy_tb_s
        rows[key] = r
        print(f"mla {key:<52} {r['ms']:.4f} ms (spread {r['spread']:.1%}) {r['tb_s']:.2f} TB/s "
              f"{r['frac_copy']:.0%} of copy", flush=True)  # fmt: skip
        (out / "mla_fp8.json").write_text(json.dumps(rows, indent=1))

    saved = launch.f16_dots_for
    from portattn.mla import plan_mla_decode

    for heads in (16, 128):
        b, L, P = 64, 4096, 64
        pages = b * L // P + 4
        gen = torch.Generator(device=DEV).manual_seed(heads)
        cache = torch.randn(pages, P, 576, device=DEV, dtype=torch.bfloat16, generator=gen)
        perm = torch.randperm(pages, device=DEV, generator=gen)[: b * L // P].view(b, L // P).to(torch.int32)
        seq = torch.full((b,), L, device=DEV, dtype=torch.int32)
        qn = torch.randn(b, heads, 512, device=DEV, dtype=torch.bfloat16, generator=gen)
        qr = torch.randn(b, heads, 64, device=DEV, dtype=torch.bfloat16, generator=gen)
        meta = plan_mla_decode(perm, seq, P, num_heads=heads, kv_lora_rank=512, max_seqlen_k=L)
        mo = torch.empty_like(qn)
        c8 = quantize_kv(cache, torch.float8_e4m3fn, 0.05)
        c5 = quantize_kv(cache, torch.float8_e5m2, 0.05)
        variants = [("bf16", cache, 1.0, None), ("e4m3 default", c8, 0.05, None), ("e5m2 default", c5, 0.05, None)]
        if heads > 32:  # the Gluon kernel of 64-head blocks over each cache
            variants += [(f"{name} wide {t}", kv, s, MLATileConfig(*t, wide=True)) for t in MLA_WIDE_TILES
                         for name, kv, s in (("bf16", cache, 1.0), ("e4m3", c8, 0.05), ("e5m2", c5, 0.05))]  # fmt: skip
        variants += [(f"e4m3 {t}", c8, 0.05, MLATileConfig(*t)) for t in MLA_FP8_TILES[heads]]
        variants += [(f"e5m2 {t}", c5, 0.05, MLATileConfig(*t)) for t in MLA_E5M2_TILES.get(heads, [])]
        ref = mla_decode_ref(qn[:4], qr[:4], cache, perm[:4], seq[:4], scale=0.07)
        for label, kv, scale, tiles in variants:
            if label.endswith("bf16 dots"):
                mla_decode_launch.attention_launch.f16_dots_for = lambda q_dtype, kv_dtype: False
            args = (qn, qr, kv, perm, seq, mo)
            kwargs = {
                "scale": 0.07,
                "num_kv_splits": meta.num_kv_splits,
                "partials": meta.partials,
                "kv_scale": scale,
                "fewer_splits": meta.splits_chosen,
            }  # the plan's count, as the engine runs it
            kwargs["tiles"] = tiles
            fn = lambda i, args=args, kwargs=kwargs: mla_decode_launch.mla_decode_forward(*args, **kwargs)
            nbytes = b * L * 576 * (2 if kv is cache else 1)
            try:
                record(f"H={heads} {label}", fn, nbytes)
            except Exception as exc:
                rows[f"H={heads} {label}"] = peers.error_line(exc)
                print(f"mla H={heads} {label} {rows[f'H={heads} {label}']}", flush=True)
            if isinstance(rows.get(f"H={heads} {label}"), dict):  # against the bf16 cache's float32 reference
                small = (qn[:4], qr[:4], kv, perm[:4], seq[:4], mo[:4].clone())
                got = mla_decode_launch.mla_decode_forward(*small, scale=0.07, num_kv_splits=1, kv_scale=scale,
                                                           tiles=tiles)  # fmt: skip
                rows[f"H={heads} {label}"]["rel_error"] = max_error(got, ref) / float(ref.abs().max())
            mla_decode_launch.attention_launch.f16_dots_for = saved
        if heads in MLA_FP8_SPLIT_TILES:  # split counts other than the plan's (its count is in the rows above)
            from portattn.kernels.triton.mla_workspace import mla_workspace_size, partial_buffers

            for t in MLA_FP8_SPLIT_TILES[heads]:
                kv, scale = (cache, 1.0) if t is None else (c8, 0.05)
                for splits in MLA_FP8_SPLIT_COUNTS:
                    ws = torch.empty(mla_workspace_size(L, b, heads, P, num_kv_splits=splits, kv_lora_rank=512),
                                     dtype=torch.uint8, device=DEV)  # fmt: skip
                    kwargs = {"scale": 0.07, "num_kv_splits": splits, "kv_scale": scale,
                              "partials": partial_buffers(ws, b, heads, splits, 512) if splits > 1 else None,
                              "tiles": None if t is None else MLATileConfig(*t)}  # fmt: skip
                    args = (qn, qr, kv, perm, seq, mo)
                    fn = lambda i, args=args, kwargs=kwargs: mla_decode_launch.mla_decode_forward(*args, **kwargs)
                    key = f"H={heads} {'bf16 default' if t is None else f'e4m3 {t}'} splits={splits}"
                    try:
                        record(key, fn, b * L * 576 * (2 if t is None else 1))
                    except Exception as exc:
                        rows[key] = peers.error_line(exc)
                        print(f"mla {key} {rows[key]}", flush=True)
    (out / "mla_fp8.json").write_text(json.dumps(rows, indent=1))
    return rows


# Split counts timed beside the plan's (4) for the memory-bound 16-head case (None: the bf16 cache's default tiles).
# Programs an SM of the fp8_mma kernel (Triton 3.6's compile, ../benchmarks/results/round33_h200/mla_sass_triton36.txt):
# at 64 keys 166 registers and 94 KB of shared memory a 4-warp program, 2 an SM (shared memory), so the plan's 4
# splits of 64 sequences (256 programs) already fill the 264 slots of 132 SMs and more splits only add waves; at 32
# keys 140 registers and 57 KB (2 stages) or 75 KB (3), 3 an SM (registers): 6 splits (384 programs) fill 396 slots,
# with half as many bytes a program in flight a step; at 32 keys and 2 stages with ptxas held to 128 registers
# (40 bytes spilled, Triton 3.9) 4 an SM: 8 splits (512 programs) fill 528 slots. Which of per-SM concurrency or
# bytes in flight limits it is what the sweep tells.
MLA_FP8_SPLIT_COUNTS = (1, 2, 3, 6, 8, 12, 16)
MLA_FP8_SPLIT_TILES = {
    16: [None, (16, 64, 4, 2, False, False, True), (16, 64, 4, 3, False, False, True),
         (16, 32, 4, 2, False, False, True), (16, 32, 4, 3, False, False, True),
         (16, 32, 4, 2, False, False, True, False, False, 128)],
}  # fmt: skip


# mla_splits: batches, key counts, split counts and tiles (block_h, block_n, warps, stages) of the few-sequence decodes
MLA_SPLIT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
MLA_SPLIT_COUNTS = (1, 2, 4, 8, 16, 32, 64)
MLA_SPLIT_TILES = {128: [(32, 32, 8, 3), (16, 32, 4, 3)], 16: []}


def mla_splits(out: Path, ceil) -> dict:
    """MLA decode at DeepSeek-V3's latent (512 + 64, page 64, bf16) and 128 or 16 heads: ``MLA_SPLIT_BATCHES``
    sequences over 1024 and 4096 keys at each of ``MLA_SPLIT_COUNTS`` key ranges (the merge included), the
    default tiles, and ``MLA_SPLIT_TILES`` at 1 and 4 sequences; each graph rotates through 64 sequences' pages
    (75-300 MB of latent rows, past the L2), as a model's layers do. Beside each row: the split count
    :func:`~portattn.kernels.triton.mla_workspace.choose_num_kv_splits` picks for the engine's graphs of a
    ``L + 512``-key capacity."""
    from portattn.kernels.triton.mla_workspace import choose_num_kv_splits as mla_splits_for
    from portattn.kernels.triton.mla_workspace import mla_workspace_size, partial_buffers

    rows, path = {}, out / "mla_splits.json"
    P, R, Dr = 64, 512, 64
    for heads in (128, 16):
        for L in (1024, 4096):
            total = 64
            pages = total * L // P
            gen = torch.Generator(device=DEV).manual_seed(heads + L)
            cache = torch.randn(pages, P, R + Dr, device=DEV, dtype=torch.bfloat16, generator=gen)
            perm = torch.randperm(pages, device=DEV, generator=gen).view(total, L // P).to(torch.int32)
            qn = torch.randn(total, heads, R, device=DEV, dtype=torch.bfloat16, generator=gen)
            qr = torch.randn(total, heads, Dr, device=DEV, dtype=torch.bfloat16, generator=gen)
            seq = torch.full((total,), L, device=DEV, dtype=torch.int32)
            inputs = (qn, qr, cache, perm, seq)
            for b in MLA_SPLIT_BATCHES:
                sets = total // b
                chosen = mla_splits_for(L + 512, b, heads)
                mo = torch.empty(b, heads, R, device=DEV, dtype=torch.bfloat16)
                tile_list = [None] + [MLATileConfig(*t) for t in MLA_SPLIT_TILES[heads] if b <= 4]
                for tiles in tile_list:
                    for splits in MLA_SPLIT_COUNTS:
                        if splits * 32 > L:
                            continue
                        ws = torch.empty(mla_workspace_size(L, b, heads, P, num_kv_splits=splits, kv_lora_rank=R),
                                         dtype=torch.uint8, device=DEV)  # fmt: skip
                        parts = partial_buffers(ws, b, heads, splits, R) if splits > 1 else None

                        def fn(i, b=b, sets=sets, splits=splits, parts=parts, tiles=tiles, mo=mo, inputs=inputs):
                            qn, qr, cache, perm, seq = inputs
                            j = (i % sets) * b
                            return mla_decode_launch.mla_decode_forward(
                                qn[j : j + b], qr[j : j + b], cache, perm[j : j + b], seq[j : j + b], mo, scale=0.07,
                                num_kv_splits=splits, partials=parts, tiles=tiles,
                            )  # fmt: skip

                        label = "default" if tiles is None else "{}x{} w{} s{}".format(*dataclasses.astuple(tiles)[:4])
                        key = f"H={heads} L={L} B={b} {label} splits={splits}"
                        try:
                            r = _timed(fn, sets)
                        except Exception as exc:
                            rows[key] = peers.error_line(exc)
                            print(f"mla-splits {key} {rows[key]}", flush=True)
                            continue
                        r["tb_s"] = b * L * (R + Dr) * 2 / r["ms"] / 1e9
                        r["frac_copy"] = r["tb_s"] / ceil.copy_tb_s
                        r["engine_splits"] = chosen
                        rows[key] = r
                        print(f"mla-splits {key:<52} {r['ms']:.4f} ms spread {r['spread']:.1%} "
                              f"{r['frac_copy']:.0%} of copy (engine's choice {chosen})", flush=True)  # fmt: skip
            path.write_text(json.dumps(rows, indent=1))
            del cache, inputs
    return rows


def fp8_ab(out: Path, ceil, rounds: int) -> dict:
    rows: dict = {}
    case = PagedCase("decode B=64 L=4096 P=16", 64, 1, 4096, peers=())
    sets = [_inputs(case, torch.bfloat16, DEV, seed) for seed in range(2)]
    o = torch.empty(64, 32, 128, device=DEV, dtype=torch.bfloat16)
    ks, vs = 0.5, 0.25
    kv_bytes = 64 * 4096 * 8 * 128 * 2
    path = out / "fp8ab.json"
    default = choose_tiles(1, 4, 128, 128, interpret=False)
    n, w, st, sp, reg, ahead = FP8_AB_CANDIDATE
    candidate = TileConfig(default.block_q, default.block_m, n, w, st, reg, ahead)
    calls = {"bf16 cache": (_paged_call(case, sets, o), 2 * kv_bytes)}
    for name, dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        s8 = [{**s, "k_cache": quantize_kv(s["k_cache"], dt, ks), "v_cache": quantize_kv(s["v_cache"], dt, vs)}
              for s in sets]  # fmt: skip
        calls[f"{name} default"] = (_paged_call(case, s8, o, k_scale=ks, v_scale=vs), kv_bytes)
        fn = _paged_call(case, s8, o, tiles=candidate, splits=sp, k_scale=ks, v_scale=vs)
        calls[f"{name} n{n} w{w} s{st} S{sp} ahead"] = (fn, kv_bytes)
    for r in range(rounds):
        for key, (fn, nbytes) in calls.items():
            _record(rows, path, "fp8ab", f"{key} #{r}", fn, nbytes, ceil)
    for key in calls:  # medians over the rounds
        ms = sorted(rows[f"{key} #{r}"]["ms"] for r in range(rounds) if "ms" in rows.get(f"{key} #{r}", {}))
        if ms:
            rows[f"{key} median of rounds"] = {"ms": ms[len(ms) // 2], "min": ms[0], "max": ms[-1]}
            print(f"fp8ab {key:<36} median {ms[len(ms) // 2]:.4f} ms (min {ms[0]:.4f}, max {ms[-1]:.4f})")
    path.write_text(json.dumps(rows, indent=1))
    return rows


# (block_n, warps, stages, splits). Round 4: 64 x 8 x 5 at 32 splits 0.0751 ms (84% of copy), at 64 0.0843;
# 5 stages keep two tiles in flight, 7 or 8 keep three (scripts/pipeline_depth.py).
# Round 5: the default stays (0.0748-0.0755 ms; 7 or 8 stages 0.078). Then: page ids a tile ahead (the
# fifth entry), where 3-5 stages keep 2-4 tiles, and the splits merged by their last program (the sixth:
# no merge kernel after the launch).
LONG_VARIANTS = [(64, 8, 5, 32, False, False), (64, 8, 3, 32, True, False), (64, 8, 4, 32, True, False),
                 (64, 8, 5, 32, True, False), (128, 4, 3, 32, True, False), (64, 8, 4, 16, True, False),
                 (64, 8, 5, 32, False, True), (64, 8, 5, 16, False, True)]  # fmt: skip


def long(out: Path, ceil) -> dict:
    rows = {}
    case = PagedCase("decode B=1 L=65536 P=16", 1, 1, 65536, peers=())
    sets = [_inputs(case, torch.bfloat16, DEV, seed) for seed in range(2)]
    o = torch.empty(1, 32, 128, device=DEV, dtype=torch.bfloat16)
    nbytes = 65536 * 8 * 128 * 2 * 2

    def record(key, fn):
        _record(rows, out / "long.json", "long", key, fn, nbytes, ceil)

    default = choose_tiles(1, 4, 128, 128, interpret=False)
    splits = choose_num_kv_splits(65536, 1, 32, 1)
    launch.MAX_KV_SPLITS = max(launch.MAX_KV_SPLITS, *(v[3] for v in LONG_VARIANTS))  # a sweep may go past it
    record(f"default m{default.block_m} n{default.block_n} w{default.num_warps} s{default.num_stages} S{splits}",
           _paged_call(case, sets, o))  # fmt: skip
    for n, w, st, sp, ahead, merge in LONG_VARIANTS:
        t = TileConfig(default.block_q, default.block_m, n, w, st, pages_ahead=ahead, merge_in_kernel=merge)
        key = f"n{n} w{w} s{st} S{sp}{' ahead' if ahead else ''}{' merged in kernel' if merge else ''}"
        record(key, _paged_call(case, sets, o, tiles=t, splits=sp))
    record("default again", _paged_call(case, sets, o))
    return rows


SPLIT_BATCHES, SPLIT_LENGTHS, SPLIT_COUNTS = (1, 4), (8192, 16384, 32768, 65536, 131072), (8, 16, 32, 48, 64)
FP8_SPLIT_BATCHES, FP8_SPLIT_LENGTH = (8, 64), 4096


def splits(out: Path, ceil) -> dict:
    """Decode at batches ``SPLIT_BATCHES`` over ``SPLIT_LENGTHS`` keys at each of ``SPLIT_COUNTS``
    splits (and the default), bf16 with the default tiles; then an fp8 e4m3 cache at B=8 and 64 over
    4096 keys at 1, 2 and 3 splits: where the split rule should sit."""
    rows = {}

    def record(key, fn, nbytes):
        _record(rows, out / "splits.json", "splits", key, fn, nbytes, ceil)

    for b in SPLIT_BATCHES:
        for L in SPLIT_LENGTHS:
            case = PagedCase(f"decode B={b} L={L} P=16", b, 1, L, peers=())
            sets = [_inputs(case, torch.bfloat16, DEV, seed) for seed in range(2)]
            o = torch.empty(b, 32, 128, device=DEV, dtype=torch.bfloat16)
            nbytes = b * L * 8 * 128 * 2 * 2
            default = choose_num_kv_splits(L, b, 32, 1)
            for sp in sorted({*SPLIT_COUNTS, default}):
                mark = " (default)" if sp == default else ""
                record(f"B={b} L={L} S{sp}{mark}", _paged_call(case, sets, o, splits=sp), nbytes)
            del sets
    L = FP8_SPLIT_LENGTH
    for b in FP8_SPLIT_BATCHES:
        case = PagedCase(f"decode B={b} L={L} P=16", b, 1, L, peers=())
        sets = [_inputs(case, torch.bfloat16, DEV, seed) for seed in range(2)]
        sets = [{**s, "k_cache": quantize_kv(s["k_cache"], torch.float8_e4m3fn, 0.5),
                 "v_cache": quantize_kv(s["v_cache"], torch.float8_e4m3fn, 0.25)} for s in sets]  # fmt: skip
        o = torch.empty(b, 32, 128, device=DEV, dtype=torch.bfloat16)
        default = choose_num_kv_splits(L, b, 32, 1)
        for sp in sorted({1, 2, 3, 4, default}):
            mark = " (default)" if sp == default else ""
            fn = _paged_call(case, sets, o, splits=sp, k_scale=0.5, v_scale=0.25)
            record(f"fp8 B={b} L={L} S{sp}{mark}", fn, b * L * 8 * 128 * 2)
    return rows


# (block_n, warps, stages, splits, page ids ahead, merged in kernel), timed at SmolLM2's shape, batch 1
SHORT_VARIANTS = [(64, 4, 2, 1, False, False), (32, 4, 3, 1, False, False), (128, 4, 2, 1, False, False),
                  (256, 4, 1, 1, False, False), (512, 8, 1, 1, False, False), (128, 4, 2, 1, True, False),
                  (64, 4, 3, 4, False, False), (32, 4, 2, 8, False, False), (32, 4, 3, 8, False, False),
                  (32, 2, 2, 8, False, False), (16, 4, 2, 16, False, False), (32, 4, 2, 16, False, False),
                  (32, 4, 2, 8, False, True)]  # fmt: skip
SHORT_KEYS, SHORT_BATCHES = (5, 64, 162, 320, 511), (1, 8)
SHORT_SHAPES = ((9, 3, 64), (32, 8, 128))  # (Hq, Hkv, D): SmolLM2-135M, Llama-3-8B


def short(out: Path, ceil) -> dict:
    rows = {}
    for hq, hkv, d in SHORT_SHAPES:
        for b in SHORT_BATCHES:
            for L in SHORT_KEYS:
                case = PagedCase(f"decode B={b} L={L}", b, 1, L, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, peers=())
                sets = [_inputs(case, torch.bfloat16, DEV, seed) for seed in range(2)]
                o = torch.empty(b, hq, d, device=DEV, dtype=torch.bfloat16)
                nbytes = b * L * hkv * d * 2 * 2
                name = f"Hq{hq} D{d} B={b} L={L}"

                def record(key, fn, name=name, nbytes=nbytes):
                    _record(rows, out / "short.json", "short", f"{name} {key}", fn, nbytes, ceil)

                splits = choose_num_kv_splits(L, b, hq, 1)
                record(f"default S{splits}", _paged_call(case, sets, o))
                d0 = choose_tiles(1, hq // hkv, d, d, interpret=False)
                plan_splits = choose_num_kv_splits(512, b, hq, 1)  # the engine's short shape plans for 512 keys
                ts = choose_tiles(1, hq // hkv, d, d, interpret=False, short_splits=512 // plan_splits <= 64)
                record(f"short-shape plan n{ts.block_n} S{plan_splits}",
                       _paged_call(case, sets, o, tiles=ts, splits=plan_splits))  # fmt: skip
                record(f"long-context tiles n{d0.block_n} w{d0.num_warps} s{d0.num_stages} S1",
                       _paged_call(case, sets, o, tiles=d0, splits=1))  # fmt: skip
                if (hq, b) != (9, 1):
                    continue
                for n, w, st, sp, ahead, merge in SHORT_VARIANTS:
                    t = TileConfig(d0.block_q, d0.block_m, n, w, st, pages_ahead=ahead, merge_in_kernel=merge)
                    key = f"n{n} w{w} s{st} S{sp}{' ahead' if ahead else ''}{' merged in kernel' if merge else ''}"
                    record(key, _paged_call(case, sets, o, tiles=t, splits=sp))
    return rows


# The engine's decode batches at Llama-3-8B's heads (32 / 8 of 128, page 16): (batch, keys) points, and
# at each the default against other split counts and tiles (block_n, warps, stages) at one split.
BATCHED_POINTS = [(b, L) for b in (16, 32, 64, 128) for L in (512, 1024, 2048)]
BATCHED_SPLITS = (2, 4)
BATCHED_TILES = [
    (32, 4, 4, False),
    (64, 4, 3, False),
    (64, 4, 4, False),
    (128, 4, 2, False),
    (128, 8, 3, False),
    (64, 8, 5, True),
    (64, 4, 4, True),
    (128, 4, 3, True),
]  # last: page ids a tile ahead


def _decode_point(b: int, L: int) -> tuple:
    """Inputs of a bf16 decode of ``b`` sequences over ``L`` keys at Llama-3-8B's heads: the case, two
    input sets, the output, the K/V bytes, and the split count and tiles its launch takes by default."""
    case = PagedCase(f"decode B={b} L={L}", b, 1, L, peers=())
    sets = [_inputs(case, torch.bfloat16, DEV, seed) for seed in range(2)]
    o = torch.empty(b, 32, 128, device=DEV, dtype=torch.bfloat16)
    splits = choose_num_kv_splits(L, b, 32, 1)
    default = launch.default_tiles(sets[0]["q"], sets[0]["k_cache"], sets[0]["v_cache"], b, 1, L, splits)
    return case, sets, o, b * L * 8 * 128 * 2 * 2, splits, default


def batched(out: Path, ceil) -> dict:
    """Decode steps of 16-128 sequences over 512-2048 keys (the engine's batch-64 step over 1024 keys
    read its keys at about 75% of copy where B=64 over 4096 reaches 95%): the split rule's and the
    default tiles' choice against 2 and 4 splits and ``BATCHED_TILES``."""
    rows = {}
    for b, L in BATCHED_POINTS:
        case, sets, o, nbytes, splits, default = _decode_point(b, L)

        def record(key, fn, b=b, L=L, nbytes=nbytes):
            _record(rows, out / "batched.json", "batched", f"B={b} L={L} {key}", fn, nbytes, ceil)

        ahead = " ahead" if default.pages_ahead else ""
        record(
            f"default n{default.block_n} w{default.num_warps} s{default.num_stages}{ahead} S{splits}",
            _paged_call(case, sets, o),
        )
        for sp in BATCHED_SPLITS:
            if sp != splits:
                record(f"S{sp}", _paged_call(case, sets, o, splits=sp))
        for n, w, st, ahead in BATCHED_TILES:
            t = TileConfig(default.block_q, default.block_m, n, w, st, pages_ahead=ahead)
            record(f"n{n} w{w} s{st}{' ahead' if ahead else ''} S1", _paged_call(case, sets, o, tiles=t, splits=1))
            if ahead:
                record(f"n{n} w{w} s{st} ahead S2", _paged_call(case, sets, o, tiles=t, splits=2))
    return rows


SERVED_POINTS = [(b, L) for b in (8, 12, 16, 20, 24, 28) for L in (768, 1024, 2048)]
SERVED_POINTS += [(1, 8192), (1, 65536), (4, 8192), (4, 32768), (8, 4096)]
SERVED_TILES = [(64, 4, 4), (64, 4, 3), (64, 4, 5), (32, 4, 4), (128, 4, 2), (64, 8, 4)]


def served(out: Path, ceil) -> dict:
    """Split decodes (``SERVED_POINTS``): the default split count and tiles against ``SERVED_TILES`` at that
    split count (an unsplit point is left at its default alone)."""
    rows = {}
    for b, L in SERVED_POINTS:
        case, sets, o, nbytes, splits, default = _decode_point(b, L)

        def record(key, fn, b=b, L=L, nbytes=nbytes):
            _record(rows, out / "served.json", "served", f"B={b} L={L} {key}", fn, nbytes, ceil)

        record(f"default n{default.block_n} w{default.num_warps} s{default.num_stages} S{splits}",
               _paged_call(case, sets, o))  # fmt: skip
        if splits == 1:
            continue
        for n, w, st in SERVED_TILES:
            t = TileConfig(default.block_q, default.block_m, n, w, st)
            record(f"n{n} w{w} s{st} S{splits}", _paged_call(case, sets, o, tiles=t, splits=splits))
    return rows


# The offline job's steps (256 requests of 1024 + 256 tokens, Llama-3-8B's heads, page 16): its decodes of
# 128-256 sequences over about 1152 keys, and a prompt chunk's 16 new sequences of 1024 tokens (causal).
# Tiles: (block_n, warps, stages, page ids ahead, whole pages a tile); for the prefill (block_m, block_n,
# warps, stages, whole pages).
JOB_DECODES = [(256, 1152), (128, 1152)]
JOB_DECODE_TILES = [(64, 4, 3, False, True), (64, 4, 4, False, True), (64, 4, 3, True, True), (128, 4, 2, False, True),
                    (128, 4, 3, True, True), (32, 4, 4, False, True), (64, 4, 4, False, False),
                    (128, 4, 2, False, False)]  # fmt: skip
JOB_PREFILL_TILES = [(128, 64, 8, 3, True), (128, 64, 4, 3, True), (64, 64, 4, 3, True), (128, 128, 8, 2, True),
                     (64, 128, 4, 3, True), (128, 128, 8, 4, True), (128, 128, 8, 3, False)]  # fmt: skip


def job(out: Path, ceil) -> dict:
    """The offline job's attention shapes (``JOB_DECODES``, a 16 x 1024 causal prompt chunk): the default
    tiles against ``JOB_DECODE_TILES`` / ``JOB_PREFILL_TILES``."""
    rows = {}
    for b, L in JOB_DECODES:
        case, sets, o, nbytes, splits, default = _decode_point(b, L)

        def record(key, fn, b=b, L=L, nbytes=nbytes):
            _record(rows, out / "job.json", "job", f"decode B={b} L={L} {key}", fn, nbytes, ceil)

        record(f"default {default} S{splits}", _paged_call(case, sets, o))
        for n, w, st, ahead, whole in JOB_DECODE_TILES:
            t = TileConfig(default.block_q, default.block_m, n, w, st, pages_ahead=ahead, whole_pages=whole)
            key = f"n{n} w{w} s{st}{' ahead' if ahead else ''}{' whole' if whole else ''} S{splits}"
            record(key, _paged_call(case, sets, o, tiles=t, splits=splits))
    case = PagedCase("prefill B=16 L=1024", 16, 1024, 1024, peers=())
    sets = [_inputs(case, torch.bfloat16, DEV, seed) for seed in range(2)]
    o = torch.empty(16 * 1024, 32, 128, device=DEV, dtype=torch.bfloat16)
    flops = 4 * 16 * 32 * 128 * (1024 * 1025 // 2)

    def record(key, fn):
        _record(rows, out / "job.json", "job", f"prefill B=16 L=1024 {key}", fn, 0, ceil, flops=flops)

    record("default", _paged_call(case, sets, o))
    for m, n, w, st, whole in JOB_PREFILL_TILES:
        t = TileConfig(m // 4, m, n, w, st, pages_ahead=True, whole_pages=whole)
        record(f"m{m} n{n} w{w} s{st}{' whole' if whole else ''}", _paged_call(case, sets, o, tiles=t, splits=1))
    return rows


FEW_POINTS = [(b, L) for b in (1, 2, 4, 8, 16) for L in (1024, 4096)]
FEW_SPLITS = (1, 2, 4, 8)
FEW_TILES = [(64, 8, 5, False), (128, 4, 3, True), (128, 4, 2, False), (64, 4, 3, False)]


def few(out: Path, ceil) -> dict:
    """Decodes of 1-16 sequences over 1024 and 4096 keys (the op benchmark's B=1 / B=8 over 1024 keys
    trail SDPA-flash): the default split count and tiles against 1-8 splits in each of ``FEW_TILES``
    (a program per SM or fewer, where unsplit decodes of 16 sequences ran faster with 128-key tiles and
    page ids ahead than split in two)."""
    rows = {}
    for b, L in FEW_POINTS:
        case, sets, o, nbytes, splits, default = _decode_point(b, L)
        label = f"default n{default.block_n} w{default.num_warps} s{default.num_stages} S{splits}"
        _record(rows, out / "few.json", "few", f"B={b} L={L} {label}", _paged_call(case, sets, o), nbytes, ceil)
        for n, w, st, ahead in FEW_TILES:
            t = TileConfig(default.block_q, default.block_m, n, w, st, pages_ahead=ahead)
            for sp in FEW_SPLITS:
                key = f"B={b} L={L} n{n} w{w} s{st}{' ahead' if ahead else ''} S{sp}"
                _record(
                    rows, out / "few.json", "few", key, _paged_call(case, sets, o, tiles=t, splits=sp), nbytes, ceil
                )
    return rows


# one: (batch, keys) points, split counts and (block_n, warps, stages) tiles, each with and without the
# last split merging in the kernel; ONE_SETS input sets a graph rotates through (more bytes than the L2).
ONE_POINTS = [(1, 1024), (1, 4096), (4, 1024), (4, 4096)]
ONE_SPLITS = (3, 4, 8, 16, 32)
ONE_TILES = [(64, 4, 2), (64, 4, 3), (64, 8, 5), (32, 4, 2), (128, 4, 2)]
ONE_SETS = 24


def one(out: Path, ceil) -> dict:
    """Decodes of 1 and 4 sequences over 1024 and 4096 keys at Llama-3-8B's heads, as the engine's
    batch-1 step runs them (32 layers of keys: no layer finds its keys in the L2, so each graph
    rotates through ``ONE_SETS`` caches): the default plan of 1536 keys' graph (3 splits) against
    ``ONE_SPLITS`` x ``ONE_TILES``, the splits merged by the merge kernel or by the last split."""
    rows, path = {}, out / "one.json"
    for b, L in ONE_POINTS:
        case = PagedCase(f"decode B={b} L={L}", b, 1, L, peers=())
        sets = [_inputs(case, torch.bfloat16, DEV, seed) for seed in range(ONE_SETS)]
        o = torch.empty(b, 32, 128, device=DEV, dtype=torch.bfloat16)
        nbytes = b * L * 8 * 128 * 2 * 2
        default = launch.default_tiles(sets[0]["q"], sets[0]["k_cache"], sets[0]["v_cache"], b, 1, L, 3)
        for sp in ONE_SPLITS:
            variants = [(default.block_n, default.num_warps, default.num_stages, False, True)]
            variants += [(*t, merge, False) for t in ONE_TILES for merge in (False, True)]
            for n, w, st, merge, is_default in variants:
                t = TileConfig(default.block_q, default.block_m, n, w, st, merge_in_kernel=merge)
                key = f"B={b} L={L} S{sp} {'default ' if is_default else ''}n{n} w{w} s{st}{' merged' if merge else ''}"
                try:
                    r = _timed(_paged_call(case, sets, o, tiles=t, splits=sp), ONE_SETS)
                except Exception as exc:
                    rows[key] = peers.error_line(exc)
                    print(f"one {key:<44} {rows[key]}", flush=True)
                    continue
                r["frac_copy"] = nbytes / r["ms"] / 1e9 / ceil.copy_tb_s
                rows[key] = r
                print(f"one {key:<44} {r['ms'] * 1000:.1f} us spread {r['spread']:.1%} {r['frac_copy']:.0%} of copy",
                      flush=True)  # fmt: skip
                path.write_text(json.dumps(rows, indent=1))
    return rows


# The rotary write's token counts: a decode batch, a short prompt chunk, the engine's 16,384-token chunk.
ROTARY_TOKENS = (256, 2048, 16384)
# (tokens, heads, warps) a program; the first is the default.
ROTARY_PROGRAMS = [(1, 1, 1), (1, 4, 1), (1, 8, 2), (1, 8, 4), (2, 8, 4), (4, 8, 4), (4, 4, 4), (8, 1, 4), (16, 1, 4)]


def rotary(out: Path, ceil) -> dict:
    """The rotary K/V write at Llama-3-8B's heads (Hq 32 / Hkv 8 / D 128, bf16, page 16) over
    ``ROTARY_TOKENS`` tokens, q/k/v views of one projection as the layer passes them: the default
    program against ``ROTARY_PROGRAMS``. A prompt-chunk step of 16,384 tokens spent 0.95 ms a layer in
    it on an H200, about 10x its bytes' time (benchmarks/results/engine_h200/round11)."""
    rows = {}
    hq, hkv, d, page = 32, 8, 128, 16
    for t in ROTARY_TOKENS:
        qkv = torch.randn(t, hq + 2 * hkv, d, device=DEV, dtype=torch.bfloat16)
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
        cos, sin = (torch.randn(t, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        pages = -(-t // page) + 1
        caches = [torch.zeros(pages, page, hkv, d, device=DEV, dtype=torch.bfloat16) for _ in "kv"]
        slots = torch.randperm(pages * page, device=DEV)[:t]
        nbytes = 2 * qkv.numel() * 2 + 2 * cos.numel() * 2  # q, k, v read and written; cos and sin read
        args = (q, k, v, cos, sin, *caches, slots)
        for bt, bh, w in ROTARY_PROGRAMS:
            tiles = RotaryTiles(bt, bh, w)
            fn = lambda i, args=args, tiles=tiles: rotary_kv_write(*args, tiles=tiles)
            _record(rows, out / "rotary.json", "rotary", f"T={t} t{bt} h{bh} w{w}", fn, nbytes, ceil)
    return rows


# SmolLM2-135M's batch-1 projections (hidden 576, intermediate 1536, 9 / 3 heads of 64, vocabulary
# 49,152): (name, out features, in features, gated, rotary), and the tiles timed against each default.
SMALL_LINEARS = [("gate_up", 1536, 576, True, False), ("down", 576, 1536, False, False),
                 ("qkv", 960, 576, False, True), ("lm_head", 49152, 576, False, False)]  # fmt: skip
SMALL_LINEAR_TILES = {
    "gate_up": [(16, 64, 4, 4), (16, 128, 4, 3), (16, 128, 2, 3), (16, 256, 2, 3), (16, 256, 8, 3), (32, 128, 4, 3),
                (32, 256, 4, 3), (16, 1024, 4, 1), (16, 1024, 8, 1)],
    "down": [(16, 64, 4, 4), (16, 128, 2, 4), (16, 128, 8, 4), (16, 256, 4, 3), (16, 256, 8, 3), (16, 512, 4, 2),
             (16, 512, 8, 2), (16, 2048, 4, 1), (16, 2048, 8, 1), (32, 256, 4, 3)],
    "qkv": [(16, 1024, 2, 1), (16, 1024, 8, 1), (16, 256, 4, 3), (16, 128, 4, 4), (32, 1024, 4, 1), (32, 1024, 8, 1),
            (64, 1024, 8, 1)],
    "lm_head": [(16, 1024, 4, 1), (32, 1024, 4, 1), (32, 1024, 8, 1), (64, 1024, 8, 1), (64, 256, 4, 3)],
}  # fmt: skip


def small_linears(out: Path, ceil) -> dict:
    """``norm_linear`` (``norm_linear_rotary`` for q/k/v) at SmolLM2-135M's shapes, 1 and 8 rows in
    bf16: the default tiles (``linear_tiles``; for the down projection also the engine's own launch,
    ``small_linear``) against ``SMALL_LINEAR_TILES`` (block_n, block_k, warps, stages), as a fraction of
    copy over the weight's bytes; the LM head also as the engine runs it
    (``torch.mm`` into float32, then the argmax). A batch-1 decode graph of the model spends most of
    its 0.66 ms in these launches (benchmarks/results/engine_h200/round10)."""
    from portattn.kernels.triton.fused_launch import LinearTiles, linear_tiles, norm_linear, norm_linear_rotary
    from portattn.kernels.triton.launch import next_pow2
    from portattn.models.layers.linear import SMALL_LINEAR_FEW_ROWS

    rows = {}
    hidden, heads, kv_heads, head_dim = 576, 9, 3, 64
    for name, n_out, k_in, gated, rotary_ in SMALL_LINEARS:
        w = torch.randn(n_out * (2 if gated else 1), k_in, device=DEV, dtype=torch.bfloat16) / k_in**0.5
        nbytes = w.numel() * 2
        for m in (1, 8):
            x = torch.randn(m, k_in, device=DEV, dtype=torch.bfloat16)
            res = torch.randn(m, k_in, device=DEV, dtype=torch.bfloat16)
            nw = torch.ones(k_in, device=DEV, dtype=torch.bfloat16)
            norm = dict(norm_weight=nw, eps=1e-5, residual=res) if k_in == hidden else {}
            if rotary_:
                cos, sin = (torch.randn(m, head_dim, device=DEV, dtype=torch.bfloat16) for _ in range(2))
                kc, vc = (torch.zeros(4, 16, kv_heads, head_dim, device=DEV, dtype=torch.bfloat16) for _ in "kv")
                slots = torch.arange(m, device=DEV)

                def call(tiles, x=x, w=w, norm=norm, cos=cos, sin=sin, kc=kc, vc=vc, slots=slots):
                    return lambda i: norm_linear_rotary(x, w, None, cos, sin, kc, vc, slots, num_q_heads=heads,
                                                        num_kv_heads=kv_heads, tiles=tiles, **norm)  # fmt: skip
            else:

                def call(tiles, x=x, w=w, norm=norm, gated=gated):
                    return lambda i: norm_linear(x, w, act="silu" if gated else None, tiles=tiles, **norm)

            label = f"{name} M={m}"
            path = out / "small_linears.json"

            def record(key, fn, label=label, path=path, nbytes=nbytes):
                _record(rows, path, "small_linears", f"{label} {key}", fn, nbytes, ceil)

            if name == "down":  # the engine's launch of it (models/layers/linear.py: small_linear)
                d = LinearTiles(16, next_pow2(k_in), 4 if m <= SMALL_LINEAR_FEW_ROWS else 8, 1)
                record(f"engine n{d.block_n} k{d.block_k} w{d.num_warps} s{d.num_stages}", call(d))
            d = linear_tiles(n_out, k_in, DEV, gated=gated, rows=m)
            record(f"default n{d.block_n} k{d.block_k} w{d.num_warps} s{d.num_stages}", call(None))
            for bn, bk, nw_, st in SMALL_LINEAR_TILES[name]:
                record(f"n{bn} k{bk} w{nw_} s{st}", call(LinearTiles(bn, bk, nw_, st)))
            if name == "lm_head":
                from portattn.models.layers.embedding import linear_float32

                logits = torch.empty(m, n_out, device=DEV)
                ids = torch.empty(m, dtype=torch.int64, device=DEV)

                def engine_head(i, x=x, w=w, logits=logits, ids=ids):
                    logits.copy_(linear_float32(x, w))
                    torch.argmax(logits, dim=-1, out=ids)

                record("torch.mm float32 + copy + argmax", engine_head)
                record("torch.mm float32", lambda i, x=x, w=w: linear_float32(x, w))
                record("argmax", lambda i, logits=logits, ids=ids: torch.argmax(logits, dim=-1, out=ids))
    return rows


# -- wide linears: the decode step's projections at Llama-3-8B's width (batch 1) ---------------------

# (name, output features, input features, what precedes / follows it in the layer)
WIDE_LINEARS = [("qkv", 6144, 4096, "norm rotary"), ("o", 4096, 4096, ""), ("gate_up", 14336, 4096, "norm gated"),
                ("down", 4096, 14336, "")]  # fmt: skip
# norm_linear's tiles swept over the plain projections: (block_n, block_k, warps, stages)
WIDE_LINEAR_TILES = (
    [(16, k, w, s) for k in (256, 512, 1024) for w in (4, 8) for s in (2, 3, 4)]
    + [(32, k, w, s) for k in (128, 256, 512) for w in (4, 8) for s in (3, 4)]
    + [(64, k, w, 3) for k in (128, 256) for w in (4, 8)]
)
# The plain sweep's fastest tiles (summed over the shapes) that the fused launches are timed with.
WIDE_LINEAR_SHORTLIST = 5
# _gemv_kernel's (block_n, block_k, warps, stages): one row, products summed on the CUDA cores.
GEMV_TILES = [(n, k, w, s) for n in (8, 16, 32) for k in (256, 512) for w in (4,) for s in (1, 3)]
WIDE_LINEAR_BYTES = 160e6  # weight copies a graph rotates through: more than the L2 holds


@triton.jit
def _gemv_kernel(X, W, Out, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``Out[n] = X . W[n]`` for one row: a ``[BLOCK_N, BLOCK_K]`` float32 partial a step, summed at the end."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(W + cols.to(tl.int64)[:, None] * stride_w + (k0 + ks)[None, :])
        x = tl.load(X + k0 + ks)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(Out + cols, tl.sum(acc, 1).to(Out.dtype.element_ty))


def _wide_record(rows: dict, path: Path, ceil, label: str, fn, nbytes: int, copies: int) -> float | None:
    """Time ``fn`` over ``copies`` weights into ``rows[label]`` with its fraction of copy; its ms or None."""
    try:
        r = _timed(fn, copies)
    except Exception as exc:
        rows[label] = peers.error_line(exc)
        print(f"wide {label:<48} {rows[label]}", flush=True)
        return None
    r["frac_copy"] = nbytes / r["ms"] / 1e9 / ceil.copy_tb_s
    rows[label] = r
    print(f"wide {label:<48} {r['ms']:.4f} ms spread {r['spread']:.1%} {r['frac_copy']:.0%} of copy", flush=True)
    path.write_text(json.dumps(rows, indent=1))
    return r["ms"]


def wide_linears(out: Path, ceil) -> dict:
    """``norm_linear`` at Llama-3-8B's projections (q/k/v 6144 x 4096, o 4096 x 4096, gate/up 2 x 14336
    x 4096, down 4096 x 14336), one bf16 row, against cuBLAS (``F.linear``), as a fraction of copy over
    the weight's bytes; each graph rotates through copies of the weight that together exceed the L2
    (the model's 32 layers never find a weight there). First the plain product over
    ``WIDE_LINEAR_TILES`` and ``_gemv_kernel`` over ``GEMV_TILES``; then, with the sweep's fastest
    tiles, the fused launches against the unfused layer (q/k/v: ``add_rmsnorm``, the product and
    ``rotary_kv_write`` against ``norm_linear_rotary``; gate/up: ``add_rmsnorm``, the product and
    ``gated_activation`` against ``norm_linear`` with the norm and the activation)."""
    import torch.nn.functional as F

    from portattn.kernels.triton.fused_launch import (
        LinearTiles,
        add_rmsnorm,
        gated_activation,
        linear_tiles,
        norm_linear,
        norm_linear_rotary,
    )

    rows, path = {}, out / "wide_linears.json"
    heads, kv_heads, head_dim = (int(os.environ.get(f"WIDE_{k}", d)) for k, d in (("HEADS", 32), ("KV_HEADS", 8),
                                                                                   ("HEAD_DIM", 128)))  # fmt: skip
    m = 1
    plain_ms: dict = {}
    shapes = {}
    for name, n_out, k_in, fused in WIDE_LINEARS:
        n_w = n_out * (2 if "gated" in fused else 1)
        nbytes = n_w * k_in * 2
        copies = max(2, int(-(-WIDE_LINEAR_BYTES // nbytes)))
        ws = [torch.randn(n_w, k_in, device=DEV, dtype=torch.bfloat16) / k_in**0.5 for _ in range(copies)]
        x = torch.randn(m, k_in, device=DEV, dtype=torch.bfloat16)
        shapes[name] = (ws, x, nbytes, copies, fused, k_in)
        ref = F.linear(x, ws[0]).float()

        def record(key, fn, name=name, nbytes=nbytes, copies=copies):
            return _wide_record(rows, path, ceil, f"{name} {key}", fn, nbytes, copies)

        record("cublas", lambda i, x=x, ws=ws: F.linear(x, ws[i]))
        d = linear_tiles(n_w, k_in, DEV)
        record(f"default n{d.block_n} k{d.block_k} w{d.num_warps} s{d.num_stages}",
               lambda i, x=x, ws=ws: norm_linear(x, ws[i]))  # fmt: skip
        for t in WIDE_LINEAR_TILES:
            tiles, key = LinearTiles(*t), "n{} k{} w{} s{}".format(*t)
            ms = record(key, lambda i, x=x, ws=ws, tiles=tiles: norm_linear(x, ws[i], tiles=tiles))
            if ms is not None:
                plain_ms.setdefault(t, {})[name] = ms
                got = norm_linear(x, ws[0], tiles=tiles)[0].float()
                rows[f"{name} {key}"]["max_error"] = (got - ref).abs().max().item()
        o = torch.empty(n_w, device=DEV, dtype=torch.bfloat16)
        for t in GEMV_TILES:
            key = "gemv n{} k{} w{} s{}".format(*t)

            def gemv(i, x=x, ws=ws, o=o, t=t, n_w=n_w, k_in=k_in):
                _gemv_kernel[(n_w // t[0],)](x, ws[i], o, n_w, k_in, ws[i].stride(0), BLOCK_N=t[0], BLOCK_K=t[1],
                                             num_warps=t[2], num_stages=t[3])  # fmt: skip

            if record(key, gemv) is not None:
                gemv(0)
                rows[f"{name} {key}"]["max_error"] = (o.float() - ref[0]).abs().max().item()
    complete = [t for t in plain_ms if len(plain_ms[t]) == len(WIDE_LINEARS)]
    shortlist = sorted(complete, key=lambda t: sum(plain_ms[t].values()))[:WIDE_LINEAR_SHORTLIST]
    rows["shortlist"] = [list(t) for t in shortlist]
    print(f"wide shortlist {shortlist}", flush=True)
    cos = torch.randn(m, head_dim, device=DEV, dtype=torch.bfloat16)
    sin = torch.randn(m, head_dim, device=DEV, dtype=torch.bfloat16)
    kc, vc = (torch.zeros(64, 16, kv_heads, head_dim, device=DEV, dtype=torch.bfloat16) for _ in "kv")
    slots = torch.arange(m, device=DEV) * 7
    for name, (ws, x, nbytes, copies, fused, k_in) in shapes.items():
        if not fused:
            continue
        res = torch.randn(m, k_in, device=DEV, dtype=torch.bfloat16)
        nw = torch.rand(k_in, device=DEV, dtype=torch.bfloat16) + 0.5

        def record(key, fn, name=name, nbytes=nbytes, copies=copies):
            return _wide_record(rows, path, ceil, f"{name} {key}", fn, nbytes, copies)

        if "rotary" in fused:

            def unfused(i, x=x, ws=ws, res=res, nw=nw):
                h, _ = add_rmsnorm(x, nw, 1e-5, res)
                q, k, v = F.linear(h, ws[i]).view(m, -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
                rotary_kv_write(q, k, v, cos, sin, kc, vc, slots)

            record("unfused: add_rmsnorm + cublas + rotary_kv_write", unfused)
            for t in shortlist:
                tiles = LinearTiles(*t)
                record("norm_linear_rotary n{} k{} w{} s{}".format(*t), lambda i, x=x, ws=ws, res=res, nw=nw,
                       tiles=tiles: norm_linear_rotary(x, ws[i], None, cos, sin, kc, vc, slots, num_q_heads=heads,
                       num_kv_heads=kv_heads, norm_weight=nw, eps=1e-5, residual=res, tiles=tiles))  # fmt: skip
        else:

            def unfused(i, x=x, ws=ws, res=res, nw=nw):
                h, _ = add_rmsnorm(x, nw, 1e-5, res)
                gated_activation("silu", F.linear(h, ws[i]))

            record("unfused: add_rmsnorm + cublas + gated_activation", unfused)
            for t in shortlist:
                tiles = LinearTiles(*t)
                record("norm_linear gated n{} k{} w{} s{}".format(*t), lambda i, x=x, ws=ws, res=res, nw=nw,
                       tiles=tiles: norm_linear(x, ws[i], norm_weight=nw, eps=1e-5, residual=res, act="silu",
                       tiles=tiles))  # fmt: skip
    return rows


# row_linear's (block_n, block_k, warps) over WIDE_LINEARS; the first is the default (ROW_LINEAR_TILES).
# Other models' one-row projections (name, output features, input features, fused), timed with the
# default tiles only: Qwen2.5-7B (3584 features, 28 / 4 heads of 128, 18,944 intermediate), Llama-3.2-3B
# (3072, 24 / 8 of 128, 8192), Llama-3.2-1B (2048, 32 / 8 of 64, 8192), Qwen2.5-1.5B (1536, 12 / 2 of
# 128, 8960).
ROW_LINEAR_WIDTHS = [
    ("7B qkv", 4608, 3584, "norm"), ("7B o", 3584, 3584, ""), ("7B gate_up", 18944, 3584, "norm gated"),
    ("7B down", 3584, 18944, ""), ("3B qkv", 5120, 3072, "norm"), ("3B o", 3072, 3072, ""),
    ("3B gate_up", 8192, 3072, "norm gated"), ("3B down", 3072, 8192, ""), ("1B qkv", 3072, 2048, "norm"),
    ("1B o", 2048, 2048, ""), ("1B gate_up", 8192, 2048, "norm gated"), ("1B down", 2048, 8192, ""),
    ("1.5B qkv", 2048, 1536, "norm"), ("1.5B o", 1536, 1536, ""), ("1.5B gate_up", 8960, 1536, "norm gated"),
    ("1.5B down", 1536, 8960, ""),
]  # fmt: skip
ROW_LINEAR_TILES = [(8, 1024, 4), (8, 512, 4), (4, 1024, 4), (4, 512, 4), (16, 256, 4), (8, 256, 4), (8, 512, 8),
                    (16, 512, 8), (4, 512, 2), (16, 1024, 8)]  # fmt: skip


def row_linears(out: Path, ceil) -> dict:
    """``row_linear`` (one row on the vector units) at Llama-3-8B's projections, bf16, against what the
    engine runs there today: the plain product against cuBLAS; q/k/v with its norm (``add_rmsnorm``
    then cuBLAS); gate/up with its norm and SiLU (``add_rmsnorm``, cuBLAS, ``gated_activation``) over
    ``ROW_LINEAR_TILES``; other models' widths (``ROW_LINEAR_WIDTHS``) with the default tiles; each graph
    rotates through weight copies that exceed the L2."""
    import torch.nn.functional as F

    from portattn.kernels.triton.fused_launch import LinearTiles, add_rmsnorm, gated_activation, row_linear

    rows, path = {}, out / "row_linears.json"
    shapes = [(*shape, ROW_LINEAR_TILES) for shape in WIDE_LINEARS]
    shapes += [(*shape, ROW_LINEAR_TILES[:1]) for shape in ROW_LINEAR_WIDTHS]
    for name, n_out, k_in, fused, tile_list in shapes:
        gated = "gated" in fused
        n_w = n_out * (2 if gated else 1)
        nbytes = n_w * k_in * 2
        copies = max(2, int(-(-WIDE_LINEAR_BYTES // nbytes)))
        ws = [torch.randn(n_w, k_in, device=DEV, dtype=torch.bfloat16) / k_in**0.5 for _ in range(copies)]
        x = torch.randn(1, k_in, device=DEV, dtype=torch.bfloat16)
        res = torch.randn(1, k_in, device=DEV, dtype=torch.bfloat16)
        nw = torch.rand(k_in, device=DEV, dtype=torch.bfloat16) + 0.5

        def record(key, fn, name=name, nbytes=nbytes, copies=copies):
            return _wide_record(rows, path, ceil, f"{name} {key}", fn, nbytes, copies)

        ref = F.linear(x, ws[0]).float()
        record("cublas", lambda i, x=x, ws=ws: F.linear(x, ws[i]))
        for t in tile_list:
            tiles, key = LinearTiles(*t, 1), "row n{} k{} w{}".format(*t)
            if record(key, lambda i, x=x, ws=ws, tiles=tiles: row_linear(x, ws[i], tiles=tiles)) is not None:
                got = row_linear(x, ws[0], tiles=tiles)[0].float()
                rows[f"{name} {key}"]["max_error"] = (got - ref).abs().max().item()
        if not fused:
            continue
        act = "silu" if gated else None

        def unfused(i, x=x, ws=ws, res=res, nw=nw, act=act):
            h, _ = add_rmsnorm(x, nw, 1e-5, res)
            y = F.linear(h, ws[i])
            return gated_activation(act, y) if act else y

        record(f"unfused: add_rmsnorm + cublas{' + gated_activation' if act else ''}", unfused)
        for t in tile_list:
            tiles, key = LinearTiles(*t, 1), "row norm{} n{} k{} w{}".format(" silu" if act else "", *t)
            fn = lambda i, x=x, ws=ws, res=res, nw=nw, act=act, tiles=tiles: row_linear(
                x, ws[i], norm_weight=nw, eps=1e-5, residual=res, act=act, tiles=tiles)  # fmt: skip
            if record(key, fn) is not None:
                got = fn(0)[0].float()
                rows[f"{name} {key}"]["max_error"] = (got - unfused(0).float()).abs().max().item()
    return rows


# gated_rows' gate/up projections (name, intermediate, hidden) and row_linear tiles (block_n, block_k, warps)
GATED_ROWS = [("8B", 14336, 4096), ("7B", 18944, 3584), ("3B", 8192, 3072), ("1B", 8192, 2048), ("1.5B", 8960, 1536)]
GATED_ROW_TILES = [(8, 1024, 4), (4, 1024, 4), (16, 1024, 4), (8, 2048, 4), (4, 2048, 4), (4, 512, 4)]


def gated_rows(out: Path, ceil) -> dict:
    """``row_linear``'s gate/up launch (norm, SiLU) with the weight's gate and up rows in two blocks (a
    program reads two runs ``I`` rows apart) against alternating rows (``interleaved``: one run of
    ``2 * block_n`` rows), beside the plain product over the same bytes; 8B's shape over
    ``GATED_ROW_TILES``, the others with the first two."""
    import torch.nn.functional as F

    from portattn.kernels.triton.fused_launch import LinearTiles, gated_activation, norm_linear, row_linear

    rows, path = {}, out / "gated_rows.json"
    for name, inter, hidden in GATED_ROWS:
        nbytes = 2 * inter * hidden * 2
        copies = max(2, int(-(-WIDE_LINEAR_BYTES // nbytes)))
        ws = [torch.randn(2 * inter, hidden, device=DEV, dtype=torch.bfloat16) / hidden**0.5 for _ in range(copies)]
        wi = [w.view(2, inter, hidden).transpose(0, 1).reshape(2 * inter, hidden) for w in ws]
        x = torch.randn(1, hidden, device=DEV, dtype=torch.bfloat16)
        res = torch.randn(1, hidden, device=DEV, dtype=torch.bfloat16)
        nw = torch.rand(hidden, device=DEV, dtype=torch.bfloat16) + 0.5

        def record(key, fn, name=name, nbytes=nbytes, copies=copies):
            return _wide_record(rows, path, ceil, f"{name} {key}", fn, nbytes, copies)

        for t in GATED_ROW_TILES if name == "8B" else GATED_ROW_TILES[:2]:
            tiles, tag = LinearTiles(*t, 1), "n{} k{} w{}".format(*t)
            record(f"plain {tag}", lambda i, ws=ws, x=x, tiles=tiles: row_linear(x, ws[i], tiles=tiles))
            for layout, weights in (("two blocks", ws), ("interleaved", wi)):
                il = layout == "interleaved"
                fn = lambda i, w=weights, x=x, res=res, nw=nw, tiles=tiles, il=il: row_linear(
                    x, w[i], norm_weight=nw, eps=1e-5, residual=res, act="silu", tiles=tiles, interleaved=il
                )  # fmt: skip
                if record(f"norm silu {layout} {tag}", fn) is not None:
                    ref = row_linear(x, ws[0], norm_weight=nw, eps=1e-5, residual=res, act="silu", tiles=tiles)[0]
                    rows[f"{name} norm silu {layout} {tag}"]["max_error"] = (fn(0)[0] - ref).abs().max().item()
            fn = lambda i, wi=wi, x=x, tiles=tiles: row_linear(x, wi[i], act="silu", tiles=tiles, interleaved=True)
            record(f"silu interleaved {tag}", fn)
    # Where the layout reaches other launches: the 8B's at 8 and 64 rows (cuBLAS, then gated_activation),
    # SmolLM2's (1536 x 576) at 1 and 8 rows (norm_linear with its norm and SiLU, default tiles).
    for name, inter, hidden, counts in (("8B", 14336, 4096, (8, 64)), ("SmolLM2", 1536, 576, (1, 8))):
        nbytes = 2 * inter * hidden * 2
        copies = max(2, int(-(-WIDE_LINEAR_BYTES // nbytes)))
        ws = [torch.randn(2 * inter, hidden, device=DEV, dtype=torch.bfloat16) / hidden**0.5 for _ in range(copies)]
        wi = [w.view(2, inter, hidden).transpose(0, 1).reshape(2 * inter, hidden) for w in ws]
        nw = torch.rand(hidden, device=DEV, dtype=torch.bfloat16) + 0.5
        for count in counts:
            x = torch.randn(count, hidden, device=DEV, dtype=torch.bfloat16)
            res = torch.randn(count, hidden, device=DEV, dtype=torch.bfloat16)
            for layout, weights in (("two blocks", ws), ("interleaved", wi)):
                il = layout == "interleaved"
                if name == "8B":
                    fn = lambda i, w=weights, x=x, il=il: gated_activation("silu", F.linear(x, w[i]), il)
                    label = f"{name} {count} rows cublas + gated_activation {layout}"
                else:
                    fn = lambda i, w=weights, x=x, res=res, nw=nw, il=il: norm_linear(
                        x, w[i], norm_weight=nw, eps=1e-5, residual=res, act="silu", interleaved=il)[0]  # fmt: skip
                    label = f"{name} {count} rows norm_linear norm silu {layout}"
                _wide_record(rows, path, ceil, label, fn, nbytes, copies)
    return rows


# -- prefill: where the paged kernel's time goes, against a descriptor (TMA) kernel on contiguous K/V --


@triton.jit
def _tma_prefill_kernel(
    q_desc, k_desc, v_desc, o_desc, qk_scale, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    """Causal attention of one sequence, ``BLOCK_M`` queries of one head a program, K/V tiles through
    tensor descriptors (TMA on Hopper): the probe's reference for what contiguous loads give."""
    block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    col = head * HEAD_DIM
    kv_col = (head // GROUP) * HEAD_DIM
    m0 = block * BLOCK_M
    q = q_desc.load([m0, col])
    scale = qk_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    rows = m0 + tl.arange(0, BLOCK_M)
    for phase in tl.static_range(2):  # keys every row sees, then the diagonal block
        lo = 0 if phase == 0 else m0
        hi = m0 if phase == 0 else m0 + BLOCK_M
        for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            k = k_desc.load([start, kv_col])
            s = tl.dot(q, tl.trans(k))
            if phase == 1:
                cols = start + tl.arange(0, BLOCK_N)
                s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s * scale - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = v_desc.load([start, kv_col])
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
    o_desc.store([m0, col], (acc / l_i[:, None]).to(o_desc.dtype))


@triton.jit
def _pointer_prefill_kernel(
    Q, K, V, O, qk_scale, stride_q, stride_k, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """``_tma_prefill_kernel`` with pointer loads (asynchronous copies) in place of the descriptors:
    what the load path alone is worth."""
    block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    m0 = block * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + rows[:, None].to(tl.int64) * stride_q + head * HEAD_DIM + offs_d[None, :])
    scale = qk_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for phase in tl.static_range(2):
        lo = 0 if phase == 0 else m0
        hi = m0 if phase == 0 else m0 + BLOCK_M
        for start in tl.range(lo, hi, BLOCK_N):
            keys = (start + offs_n).to(tl.int64) * stride_k + kv_head * HEAD_DIM
            k = tl.load(K + keys[:, None] + offs_d[None, :])
            s = tl.dot(q, tl.trans(k))
            if phase == 1:
                s = tl.where((start + offs_n)[None, :] <= rows[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s * scale - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + keys[:, None] + offs_d[None, :])
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
    o = (acc / l_i[:, None]).to(O.dtype.element_ty)
    tl.store(O + rows[:, None].to(tl.int64) * stride_q + head * HEAD_DIM + offs_d[None, :], o)


def pointer_prefill(q, k, v, out, scale, block_m=128, block_n=128, num_warps=8, num_stages=2):
    L, hq, d = q.shape
    grid = (triton.cdiv(L, block_m), hq)
    _pointer_prefill_kernel[grid](
        q, k, v, out, scale, q.stride(0), k.stride(0), GROUP=hq // k.shape[1], BLOCK_M=block_m,
        BLOCK_N=block_n, HEAD_DIM=d, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def tma_prefill(q, k, v, out, scale, block_m=128, block_n=128, num_warps=8, num_stages=2, ws=False):
    """``q`` / ``out`` ``[L, Hq, D]``, ``k`` / ``v`` ``[L, Hkv, D]`` of one causal sequence."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    L, hq, d = q.shape
    hkv = k.shape[1]
    descs = [
        TensorDescriptor.from_tensor(t.view(L, -1), [block_m if t.shape[1] == hq else block_n, d])
        for t in (q, k, v, out)
    ]
    grid = (triton.cdiv(L, block_m), hq)
    _tma_prefill_kernel[grid](
        *descs, scale, GROUP=hq // hkv, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, WARP_SPECIALIZE=ws,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


# (block_m, block_n, warps, stages) of the paged kernel at P=16; (page size) with the default tiles
PREFILL_TILES = [(128, 128, 8, 3)]  # 128 x 64 (8 or 4 warps) and 64 x 64: 0.8x the default
PREFILL_PAGES = (64, 128)
# the descriptor kernel: (block_m, block_n, warps, stages, warp-specialized loop)
TMA_TILES = [(128, 128, 8, 3, False), (128, 128, 8, 2, True)]  # 128 x 64 tiles and 2 stages: slower
POINTER_TILES = [(128, 128, 8, 3)]  # the same kernel with pointer loads


def prefill(out: Path, ceil, length: int = 8192) -> dict:
    """Causal prefill of one sequence (Hq 32 / Hkv 8 / D 128, bf16): the paged kernel at P=16 (default
    and other tiles), at larger pages, over contiguous K/V (the varlen path), the descriptor kernel
    above, and SDPA's cuDNN and FlashAttention in the same process; TFLOP/s against the matmul ceiling."""
    rows: dict = {}
    flops = 4 * 32 * 128 * length * length / 2  # causal: half of the two dots

    def record(key, fn, flops=flops):
        _record(rows, out / "prefill.json", "prefill", key, fn, 0, ceil, flops=flops)

    case = PagedCase(f"prefill B=1 L={length}", 1, length, length, peers=())
    sets = [_inputs(case, torch.bfloat16, DEV, seed) for seed in range(2)]
    o = torch.empty(length, 32, 128, device=DEV, dtype=torch.bfloat16)
    default = choose_tiles(length, 4, 128, 128, interpret=False)
    record(f"paged P=16 default m{default.block_m} n{default.block_n} w{default.num_warps} s{default.num_stages}",
           _paged_call(case, sets, o))  # fmt: skip
    for m, n, w, st in PREFILL_TILES:
        t = TileConfig(m // 4, m, n, w, st)
        record(f"paged P=16 m{m} n{n} w{w} s{st}", _paged_call(case, sets, o, tiles=t))
    for st in (2, 3):  # page ids a tile ahead: the pipeliner's stages then all hold K/V tiles
        t = TileConfig(default.block_q, default.block_m, default.block_n, default.num_warps, st, pages_ahead=True)
        record(f"paged P=16 ahead s{st}", _paged_call(case, sets, o, tiles=t))
    # whole pages a tile (TileConfig.whole_pages): one page id a page, its outputs against the default's
    _paged_call(case, sets, o)(0)
    want = o.clone()
    for st in (2, 3):
        t = dataclasses.replace(default, num_stages=st, whole_pages=True)
        fn = _paged_call(case, sets, o, tiles=t)
        fn(0)
        error = max_error(o, want)
        record(f"paged P=16 whole pages{' ahead' if t.pages_ahead else ''} s{st}", fn)
        print(f"prefill whole pages s{st}: max |difference| from the default launch {error:.2e}", flush=True)
    for p in PREFILL_PAGES:
        pc = PagedCase(f"prefill P={p}", 1, length, length, page_size=p, peers=())
        psets = [_inputs(pc, torch.bfloat16, DEV, seed) for seed in range(2)]
        record(f"paged P={p} default", _paged_call(pc, psets, o))
        whole = dataclasses.replace(default, whole_pages=True)
        record(f"paged P={p} whole pages", _paged_call(pc, psets, o, tiles=whole))
        del psets
    # contiguous K/V [L, Hkv, D] (the same keys), through the kernel's varlen path and the descriptor kernel
    flat = [{n: s[n][s["page_table"][0].long()].flatten(0, 1)[:length].contiguous() for n in ("k_cache", "v_cache")}
            for s in sets]  # fmt: skip
    cu = torch.tensor([0, length], device=DEV, dtype=torch.int32)
    lens = torch.tensor([length], device=DEV, dtype=torch.int32)
    start = torch.zeros(1, device=DEV, dtype=torch.int32)
    scale = 128**-0.5

    def contiguous(i, tiles=None):
        return attention_forward(sets[i]["q"], flat[i]["k_cache"], flat[i]["v_cache"], o, cu, lens,
                                 max_seqlen_q=length, scale=scale, kv_start=start, tiles=tiles)  # fmt: skip

    record("contiguous default", contiguous)
    s3 = TileConfig(default.block_q, default.block_m, default.block_n, default.num_warps, 3)
    record("contiguous s3", lambda i: contiguous(i, s3))
    ref = contiguous(0).clone()
    for m, n, w, st, ws in TMA_TILES:
        key = f"descriptors m{m} n{n} w{w} s{st}{' warp-specialized' if ws else ''}"

        def fn(i, m=m, n=n, w=w, st=st, ws=ws):
            return tma_prefill(sets[i]["q"], flat[i]["k_cache"], flat[i]["v_cache"], o, scale, m, n, w, st, ws)

        try:
            err = (fn(0).float() - ref.float()).abs().max().item()
        except Exception as exc:
            rows[key] = peers.error_line(exc)
            print(f"prefill {key:<44} {rows[key]}", flush=True)
            continue
        record(key, fn)
        if isinstance(rows.get(key), dict):
            rows[key]["max_error_vs_contiguous"] = err
            print(f"prefill {key:<44} max |difference| from the kernel's {err:.2e}", flush=True)
    for m, n, w, st in POINTER_TILES:
        key = f"pointers m{m} n{n} w{w} s{st}"

        def fn(i, m=m, n=n, w=w, st=st):
            return pointer_prefill(sets[i]["q"], flat[i]["k_cache"], flat[i]["v_cache"], o, scale, m, n, w, st)

        err = (fn(0).float() - ref.float()).abs().max().item()
        record(key, fn)
        if isinstance(rows.get(key), dict):
            rows[key]["max_error_vs_contiguous"] = err
    q4 = [s["q"].view(1, length, 32, 128).transpose(1, 2).contiguous() for s in sets]
    k4 = [f["k_cache"].transpose(0, 1)[None].contiguous() for f in flat]
    v4 = [f["v_cache"].transpose(0, 1)[None].contiguous() for f in flat]
    for name in ("cudnn", "flash"):
        peer = peers.sdpa_peer(name, q4, k4, v4, mode="prefill", scale=scale)
        if isinstance(peer, str):
            rows[f"sdpa {name}"] = peer
            print(f"prefill sdpa {name}: {peer}", flush=True)
        else:
            record(f"sdpa {name}", peer)
    record("paged P=16 default again", _paged_call(case, sets, o))
    # the benchmark's extend: 8 sequences of 512 new tokens over 8192 cached ones
    ext = PagedCase("extend B=8 512 over 8192", 8, 512, 8192 + 512, peers=())
    esets = [_inputs(ext, torch.bfloat16, DEV, seed) for seed in range(2)]
    eo = torch.empty(8 * 512, 32, 128, device=DEV, dtype=torch.bfloat16)
    eflops = 4 * 32 * 128 * 8 * 512 * (8192 + 256.5)
    record("extend default", _paged_call(ext, esets, eo), eflops)
    for st in (2, 3):
        t = TileConfig(default.block_q, default.block_m, default.block_n, default.num_warps, st, pages_ahead=True)
        record(f"extend ahead s{st}", _paged_call(ext, esets, eo, tiles=t), eflops)
    whole = dataclasses.replace(default, whole_pages=True)
    record("extend whole pages", _paged_call(ext, esets, eo, tiles=whole), eflops)
    return rows


def fp32(out: Path) -> dict:
    rows = {}
    case = make_paged_case([1, 9, 64], [300, 40, 700], page_size=16, head_dim=128, dtype=torch.float32, device=DEV)
    ref = paged_attention_ref(**case.inputs())
    from ops.test_mla import make_mla_case

    mla = make_mla_case([1, 40, 600], page_size=16, num_heads=16, dtype=torch.float32, device=DEV)
    mref = mla_decode_ref(**mla.inputs(), scale=0.1)
    import portattn

    for precision in ("highest", "high"):
        torch.set_float32_matmul_precision(precision)
        got = portattn.paged_attention(**case.inputs(), backend="triton")
        rows[f"paged {precision}"] = max_error(got, ref) / float(ref.abs().max())
        got = portattn.mla_decode(**mla.inputs(), scale=0.1, backend="triton", num_kv_splits=2)
        rows[f"mla {precision}"] = max_error(got, mref) / float(mref.abs().max())
    torch.set_float32_matmul_precision("highest")
    for k, v in rows.items():
        print(f"fp32 {k:<20} max error / max |ref| = {v:.2e}", flush=True)
    (out / "fp32.json").write_text(json.dumps(rows, indent=1))
    return rows


def plot(rows: dict, path: Path) -> None:
    """A bar per timed row of ``rows`` (those with "ms"), written to ``path`` (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [(key, r["ms"]) for key, r in rows.items() if isinstance(r, dict) and "ms" in r]
    if not timed:
        return
    if path.stem == "mla_splits":
        return _plot_mla_splits(rows, path, plt)
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(timed) + 1.2))
    ax.barh([k for k, _ in timed][::-1], [ms for _, ms in timed][::-1], color="tab:blue")
    ax.set_xlabel("ms (graph replays, median)")
    ax.set_title(path.stem)
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_mla_splits(rows: dict, path: Path, plt) -> None:
    """mla-splits: microseconds against the split count, a line per batch (default tiles), a panel per
    (heads, keys); a star where the current rule (``choose_num_kv_splits`` for a graph of L + 512 keys) is."""
    from portattn.kernels.triton.mla_workspace import choose_num_kv_splits as mla_splits_for

    panels = sorted({tuple(key.split()[:2]) for key in rows}, key=lambda p: (-int(p[0][2:]), int(p[1][2:])))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (heads, keys) in zip(axes[0], panels):
        num_heads, num_keys = int(heads[2:]), int(keys[2:])
        for b in MLA_SPLIT_BATCHES:
            prefix = f"{heads} {keys} B={b} default "
            line = sorted(
                (int(key.rsplit("=", 1)[1]), r["ms"] * 1e3)
                for key, r in rows.items()
                if key.startswith(prefix) and isinstance(r, dict) and "ms" in r
            )
            if not line:
                continue
            ax.plot([s for s, _ in line], [us for _, us in line], "o-", ms=3, label=f"B={b}")
            # the kernel cuts at least 64 keys a split: more splits than the keys fill run as that many
            chosen = min(mla_splits_for(num_keys + 512, b, num_heads), -(-num_keys // 64))
            at = [us for s, us in line if s == chosen]
            if at:
                ax.plot(chosen, at[0], "k*", ms=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("key splits")
        ax.set_ylabel("us a call (graph replays)")
        ax.set_title(f"MLA decode, {num_heads} heads, {num_keys} keys", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("star: the splits the current rule runs (chosen for a graph of L + 512 keys)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Each section: (whether it needs the ceilings, how it runs from the output folder, the ceilings and the arguments).
SECTIONS = {
    "headdims-unaligned": (False, lambda out, ceil, args: headdims_unaligned(out, args.dims)),
    "fp8": (True, lambda out, ceil, args: fp8(out, ceil)),
    "mla-fp8": (True, lambda out, ceil, args: mla_fp8(out, ceil)),
    "mla-splits": (True, lambda out, ceil, args: mla_splits(out, ceil)),
    "job": (True, lambda out, ceil, args: job(out, ceil)),
    "served": (True, lambda out, ceil, args: served(out, ceil)),
    "fp8ab": (True, lambda out, ceil, args: fp8_ab(out, ceil, args.rounds)),
    "long": (True, lambda out, ceil, args: long(out, ceil)),
    "splits": (True, lambda out, ceil, args: splits(out, ceil)),
    "short": (True, lambda out, ceil, args: short(out, ceil)),
    "prefill": (True, lambda out, ceil, args: prefill(out, ceil)),
    "batched": (True, lambda out, ceil, args: batched(out, ceil)),
    "few": (True, lambda out, ceil, args: few(out, ceil)),
    "one": (True, lambda out, ceil, args: one(out, ceil)),
    "rotary": (True, lambda out, ceil, args: rotary(out, ceil)),
    "small-linears": (True, lambda out, ceil, args: small_linears(out, ceil)),
    "wide-linears": (True, lambda out, ceil, args: wide_linears(out, ceil)),
    "row-linears": (True, lambda out, ceil, args: row_linears(out, ceil)),
    "gated-rows": (True, lambda out, ceil, args: gated_rows(out, ceil)),
    "fp32": (False, lambda out, ceil, args: fp32(out)),
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("sections", nargs="*", help=f"any of {', '.join(SECTIONS)}")
    parser.add_argument("--replot", nargs="+", type=Path, default=None, help="plot these result JSONs again")
    parser.add_argument("--out", default="/tmp/probe")
    parser.add_argument("--dims", type=int, nargs="*", default=[40, 59, 72])
    parser.add_argument("--rounds", type=int, default=4, help="fp8ab: alternations")
    args = parser.parse_args()
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"expected sections among {', '.join(SECTIONS)}, got {', '.join(unknown)}")
    if args.replot:
        for path in args.replot:
            plot(json.loads(path.read_text()), path.with_suffix(".png"))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ceil = None
    for section in args.sections:
        t0 = time.time()
        needs_ceilings, run = SECTIONS[section]
        if needs_ceilings and ceil is None:
            ceil = measure_ceilings(DEV)
            print(
                f"ceilings: copy {ceil.copy_tb_s:.2f} TB/s, bf16 matmul {ceil.matmul_tflop_s:.0f} TFLOP/s", flush=True
            )
            (out / "ceilings.json").write_text(json.dumps(vars(ceil)))
        run(out, ceil, args)
        if (out / f"{section}.json").exists():
            plot(json.loads((out / f"{section}.json").read_text()), out / f"{section}.png")
        print(f"== {section}: {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
