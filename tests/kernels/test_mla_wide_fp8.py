"""MLA decode over an fp8 cache with fp8 scores (``mla_decode_wide_fp8``, ``MLATileConfig(fp8_scores=True)``).

On any machine: the tiles it takes, what an explicit request says where it cannot run, and the kernel compiled for
sm_90 in a child process (Gluon has no interpreter): twelve warps, the scores an fp8 product once a tile
(``m64n{BLOCK_N/2}k32``, e4m3 queries against either fp8 cache), the values' float16 product, the tiles copied by
``cp.async`` or TMA, each latent value converted once by the producer, within Hopper's shared memory, no spills. On
a Hopper GPU: results against the float64 reference of the queries quantized as the kernel quantizes them, on the
ops' poisoned fixture (NaN in every slot no sequence owns, an out-of-range page id in each row's tail), with TMA
copies and with cp.async ones where the cache allows both, and the cost of that quantization next to the fp8
cache's own.
"""

from __future__ import annotations

import itertools
import textwrap
import types

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

from kernels.mla_checks import run_compile_child
from ops.test_mla import make_mla_case
from portattn.device import is_triton_interpreter
from portattn.kernels.triton import mla_decode_seesaw_fp8 as seesaw_fp8
from portattn.kernels.triton import mla_decode_wide_fp8 as wide_fp8
from portattn.kernels.triton.mla_decode_launch import WIDE_PRODUCER_TILES, MLATileConfig, mla_decode_forward
from portattn.kv_quant import dequantize_kv, quantize_kv
from portattn.testing import gather_sequence, max_error, mla_decode_ref, tolerance

HOPPER_SHARED = 232_448  # bytes of shared memory a program may take on compute capability 9.0
FP8_SCORES_TILES = MLATileConfig(64, 64, 8, 2, wide=True, producer=True, fp8_scores=True)


def _runs_here() -> bool:
    return torch.cuda.is_available() and not is_triton_interpreter() and torch.cuda.get_device_capability()[0] == 9


def fp8_queries(q_nope: torch.Tensor, q_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries as ``mla_decode_wide_fp8`` quantizes them, in float64: each head's row (nope and rope) times the
    power of two that takes its largest magnitude into [128, 256), in e4m3, divided by it again."""
    q = torch.cat([q_nope, q_rope], -1).float()
    amax = q.abs().amax(-1, keepdim=True)
    exponent = torch.frexp(torch.where(amax > 0, amax, torch.ones_like(amax))).exponent - 1  # amax in [2^E, 2^(E+1))
    to_fp8 = torch.pow(2.0, 7.0 - exponent.double())
    q8 = (q.double() * to_fp8).float().to(torch.float8_e4m3fn).double() / to_fp8
    return q8[..., : q_nope.shape[-1]], q8[..., q_nope.shape[-1] :]


def test_fp8_scores_tiles_are_warp_specialized_wide_tiles():
    with pytest.raises(ValueError, match="fp8_scores only with wide and producer"):
        MLATileConfig(64, 64, 8, 2, wide=True, fp8_scores=True)
    with pytest.raises(ValueError, match="producer only with wide"):
        MLATileConfig(64, 64, 8, 2, producer=True, fp8_scores=True)


def test_tma_copies_where_a_tile_is_whole_pages_or_a_page_whole_tiles():
    """``tma_rows``: one page's share of a tile a copy where pages of 8+ keys make whole tiles or tiles whole pages
    and the cache's rows lie back to back, 16-byte aligned; None (cp.async copies) otherwise."""

    def cache(page_size, pages=4, width=576, pad=0):
        rows = torch.zeros(pages, page_size, width + pad, dtype=torch.uint8).view(torch.float8_e4m3fn)
        return rows[..., :width]

    got = {page: wide_fp8.tma_rows(cache(page), 64) for page in (1, 3, 4, 7, 8, 16, 24, 32, 48, 64, 128, 192)}
    assert got == {1: None, 3: None, 4: None, 7: None, 8: 8, 16: 16, 24: None, 32: 32, 48: None, 64: 64, 128: 64,
                   192: 64}  # fmt: skip
    assert wide_fp8.tma_rows(cache(16), 32) == 16 and wide_fp8.tma_rows(cache(64), 32) == 32
    assert wide_fp8.tma_rows(cache(64, pad=16), 64) == 64  # padded rows, still 16-byte strides
    assert wide_fp8.tma_rows(cache(64, pad=8), 64) is None  # 584-byte rows
    assert wide_fp8.tma_rows(cache(64, width=512), 64) is None  # another latent
    pages_apart = torch.zeros(4, 2, 64, 576, dtype=torch.uint8).view(torch.float8_e4m3fn)[:, 0]
    assert wide_fp8.tma_rows(pages_apart, 64) is None  # pages not back to back


def test_fp8_scores_name_what_they_need():
    """Asked for over a 16-bit cache (or where Gluon cannot run), the launcher says what the form needs."""
    case = make_mla_case([3], page_size=4, num_heads=2, rank=512, rope_dim=64, device="cpu")
    inputs = case.inputs()
    out = torch.empty_like(case.q_nope)
    args = (inputs["q_nope"], inputs["q_rope"], inputs["kv_cache"], inputs["page_table"], inputs["seq_lens"], out)
    needs = r"expected an fp8 cache \(e4m3 or e5m2\) for MLATileConfig\(fp8_scores=True\).*float32"
    with pytest.raises(ValueError, match=needs):
        mla_decode_forward(*args, scale=0.1, num_kv_splits=1, tiles=FP8_SCORES_TILES)
    fp8 = {**inputs, "kv_cache": quantize_kv(case.kv_cache, torch.float8_e4m3fn, 0.05)}
    args = (fp8["q_nope"], fp8["q_rope"], fp8["kv_cache"], fp8["page_table"], fp8["seq_lens"], out)
    if not _runs_here():
        needs = r"expected (a GPU without TRITON_INTERPRET|an NVIDIA GPU|compute capability 9\.x).*fp8_scores=True"
        with pytest.raises(ValueError, match=needs):
            mla_decode_forward(*args, scale=0.1, num_kv_splits=1, tiles=FP8_SCORES_TILES, kv_scale=0.05)


CHILD = textwrap.dedent(
    """
    import re, sys
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401 (Gluon's Hopper API)
    except ImportError as exc:
        print("no compiler:", exc); sys.exit(3)
    from kernels.mla_checks import cache_descriptors, compile_for_hopper, serialized_mma_notes, stack_bytes
    from portattn.kernels.triton import mla_decode_wide as wide
    from portattn.kernels.triton import mla_decode_wide_fp8 as wide_fp8

    fn = wide_fp8.mla_decode_wide_fp8_kernel
    ptrs = {"QNope": "*bf16", "QRope": "*bf16", "PageTable": "*i32", "SeqLensK": "*i32", "Out": "*bf16",
            "Lse": "*fp32", "PartOut": "*fp32", "PartLse": "*fp32"}
    for kv, block_n, page_size, values, ring, bufs, tma, pipe in (
            ("*fp8e4nv", 64, 64, 0, 3, 1, 0, 0), ("*fp8e4nv", 64, 7, 0, 3, 1, 0, 0), ("*fp8e5", 32, 16, 0, 3, 1, 0, 0),
            ("*fp8e4nv", 64, 64, 1, 3, 2, 0, 0), ("*fp8e5", 64, 7, 1, 4, 1, 0, 0), ("*fp8e4nv", 64, 64, 0, 3, 1, 1, 0),
            ("*fp8e5", 64, 16, 0, 3, 1, 1, 0), ("*fp8e4nv", 32, 8, 1, 3, 2, 1, 0), ("*fp8e4nv", 64, 64, 1, 3, 2, 1, 1),
            ("*fp8e4nv", 64, 64, 0, 3, 1, 1, 1)):
        const = {**wide_fp8.fp8_scores_constexprs(block_n, bool(values), ring, bufs), "PAGE_SIZE": page_size,
                 "WRITE_PARTIAL": True, "WRITE_LSE": True, "MIN_SPLIT": 256, "TMA": bool(tma),
                 "TMA_ROWS": min(page_size, block_n) if tma else 8, "PIPE": bool(pipe)}
        descriptors = cache_descriptors(kv, min(page_size, block_n), const) if tma else {}
        kernel = compile_for_hopper(fn, {**ptrs, "KV": kv, "CDesc": kv, "PeDesc": kv}, const,
                                    {"num_warps": wide.NUM_WARPS, "maxnreg": wide.PRODUCER_MAXNREG}, descriptors)
        ptx = kernel.asm["ptx"]
        b = "e4m3" if kv == "*fp8e4nv" else "e5m2"
        counts = {name: len(re.findall(rx, ptx)) for name, rx in (
            ("scores", rf"wgmma\\.mma_async\\.sync\\.aligned\\.m64n{block_n // 2}k32\\.f32\\.e4m3\\.{b}"),
            ("values", r"wgmma\\.mma_async\\.sync\\.aligned\\.m64n256k16\\.f32\\.f16\\.f16"),
            ("values8", rf"wgmma\\.mma_async\\.sync\\.aligned\\.m64n256k32\\.f32\\.e4m3\\.{b}"),
            ("convert", rf"cvt\\.rn\\.f16x2\\.{b}x2"), ("quantize", r"cvt\\.rn\\.satfinite\\.e4m3x2\\.f32"),
            ("copies", r"cp\\.async\\.cg\\.shared\\.global"), ("tma", r"cp\\.async\\.bulk\\.tensor\\.2d"),
            ("waits", r"mbarrier\\.try_wait"))}
        regs = sorted(set(int(n) for n in re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)))
        notes = serialized_mma_notes(kernel)
        print("kernel", kv, block_n, page_size, values, ring, bufs, tma, pipe, f"warps={kernel.metadata.num_warps}",
              f"shared={kernel.metadata.shared}", f"stack={stack_bytes(kernel)}", f"regs={','.join(map(str, regs))}",
              " ".join(f"{k}={v}" for k, v in counts.items()), f"serialized={-1 if notes is None else len(notes)}",
              flush=True)
    """
)


def test_the_kernel_compiles_for_hopper_with_fp8_scores_and_no_spills(tmp_path):
    """Twelve warps; ``setmaxnreg`` giving the producer ``PRODUCER_REGS_FP8_SCORES`` and the consumers the rest of
    ``PRODUCER_MAXNREG``; a step's scores as 16 + 2 fp8 MMAs (latent, rope; K of 32) with e4m3 queries against the
    cache's own type, its values as keys / 16 float16 ones; the tiles copied by ``cp.async`` or by TMA (a copy of
    each page's latent and rope at each of the first ``RING`` tiles' sites and the loop's), each
    latent value converted once in pairs by the producer's lanes (with TMA, the conversion twice in the code: a
    tile reaching past the sequence's end stores zeros there), the queries quantized; within Hopper's shared memory,
    no stack (spills) beyond a scalar or two, and no product serialized by ptxas."""
    lines = run_compile_child(tmp_path, CHILD, "compile_mla_wide_fp8", timeout=900)
    kernels = [line.split() for line in lines if line.startswith("kernel ")]
    assert len(kernels) == 10, lines
    for _, kv, block_n, page_size, values, ring, bufs, tma, pipe, *fields in kernels:
        counts = {k: int(v) if k != "regs" else v for k, v in (field.split("=") for field in fields)}
        keys, fp8_values, tma = int(block_n), values == "1", tma == "1"
        producer = wide_fp8.PRODUCER_REGS_FP8_SCORES.value
        consumers = (wide_fp8.PRODUCER_MAXNREG * 12 - producer * wide_fp8.PRODUCER_WARPS.value) // 8
        where = (kv, block_n, page_size, tma, counts)
        assert counts["warps"] == 12 and counts["shared"] <= HOPPER_SHARED, where
        assert counts["shared"] >= wide_fp8.shared_bytes(keys, fp8_values, int(ring), int(bufs)), where
        assert {str(producer), str(consumers)} <= set(counts["regs"].split(",")), where
        sites = 2 if pipe == "1" else 1  # pipelined: the first tile's scores and the last tile's values apart
        if fp8_values:  # the values' product in fp8 (K of 32), no conversion: the producer moves bytes
            assert (counts["scores"], counts["values"], counts["values8"]) == (18 * sites, 0, sites * keys // 32), where
            assert counts["convert"] == 0, where
            # a few scalars (the loop's counters) kept on the stack, compiled by Triton 3.6 (16-24 bytes); pipelined,
            # Triton 3.9 keeps 112 bytes there (3.6: 16)
            assert counts["stack"] <= (128 if pipe == "1" else 32), where
        else:
            assert (counts["scores"], counts["values"], counts["values8"]) == (18 * sites, sites * keys // 16, 0), where
            per_lane = keys * 512 // 2 // (32 * wide_fp8.PRODUCER_WARPS.value)
            # with TMA in two copies (ptxas shares some of them)
            assert per_lane <= counts["convert"] <= (2 if tma else 1) * per_lane, where
            # no spills (-1: no cuobjdump to ask) but a scalar or two (8-16 bytes); pipelined, Triton 3.9 keeps 136
            # bytes there (3.6: 8)
            assert counts["stack"] <= (144 if pipe == "1" else 16), where
        if tma:  # a page's latent (its four boxes a runtime loop) and rope, at the first tiles' sites and the loop's
            pages = keys // min(int(page_size), keys)
            assert counts["copies"] == 0 and counts["tma"] == (int(ring) + 1) * pages * 2, where
        else:
            assert counts["copies"] > 0 and counts["tma"] == 0, where
        assert counts["quantize"] > 0 and counts["waits"] >= 3, where
        # ptxas issues the products back to back (-1: no ptxas to ask): with the scores' partial sums added as soon
        # as issued (max_num_imprecise_acc), or in more accumulators than fit, it waits for each product before the
        # next one, every product of the kernel
        assert counts["serialized"] <= 0, where


TRANSPOSITION_CHILD = textwrap.dedent(
    """
    import os, re, subprocess, sys
    try:
        import triton
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
    except ImportError as exc:
        print("no compiler:", exc); sys.exit(3)
    from kernels.mla_checks import compile_for_hopper
    from portattn.kernels.triton import mla_decode_wide_fp8 as wide_fp8

    @gluon.jit
    def transpose(X, BLOCK_N: gl.constexpr, C_8: gl.constexpr, V_S: gl.constexpr, CVT: gl.constexpr,
                  TLOAD: gl.constexpr):
        tile = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_N, 512], C_8)
        values = gl.allocate_shared_memory(gl.float8e4nv, [512, BLOCK_N], V_S)
        wide_fp8._convert_values(tile, values, 0, BLOCK_N, BLOCK_N, CVT, TLOAD, True, False)

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        print("no cuobjdump"); sys.exit(3)
    for block_n in (64, 32):
        const = {k: v for k, v in wide_fp8.fp8_scores_constexprs(block_n, True, 3, 2).items()
                 if k in ("BLOCK_N", "C_8", "V_S", "CVT", "TLOAD")}
        kernel = compile_for_hopper(transpose, {"X": "*fp8e4nv"}, const, {"num_warps": 4})
        path = os.path.join(os.environ["OUT_DIR"], f"transpose{block_n}.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True).stdout
        ops = re.findall(r"/\\*[0-9a-f]{4}\\*/\\s+(?:@!?P\\d\\s+)?([A-Z0-9]+(?:\\.[A-Z0-9]+)*)", sass)
        count = lambda prefix: sum(op.startswith(prefix) for op in ops)
        print("transpose", block_n, f"ldsm={count('LDSM')}", f"sts128={count('STS.128')}", f"sts64={count('STS.64')}",
              f"shfl={count('SHFL')}", f"stsm={count('STSM')}", f"bar={count('BAR')}", flush=True)
    """
)


def test_the_fp8_values_transposition_stays_in_each_threads_registers(tmp_path):
    """The producer's transposition of a tile's latent for fp8 values (``_convert_values`` with ``TLOAD``), compiled
    for sm_90 on its own: each [keys, 128] chunk loaded by ldmatrix (a warp a key's 128 bytes), its bytes
    regrouped in each thread's registers (no shuffle) and stored 16 bytes a row at 64 keys (8 at 32).
    Round 56's layouts exchanged lanes' bytes with 16 shuffles a chunk and stored by ``stmatrix``, their loads and
    stores at 4x and 2x the shared-memory wavefronts needed."""
    lines = run_compile_child(tmp_path, TRANSPOSITION_CHILD, "compile_mla_transpose", timeout=600)
    found = {int(line.split()[1]): dict(f.split("=") for f in line.split()[2:]) for line in lines
             if line.startswith("transpose ")}  # fmt: skip
    assert sorted(found) == [32, 64], lines
    for block_n, counts in found.items():
        counts = {k: int(v) for k, v in counts.items()}
        chunk_bytes_a_thread = block_n * 128 // 128  # four warps
        stores = (counts["sts128"], counts["sts64"])
        assert stores == ((4 * 4, 0) if block_n == 64 else (0, 4 * 4)), (block_n, counts)
        assert counts["ldsm"] == 4 * chunk_bytes_a_thread // 16, (block_n, counts)  # 16 bytes a lane each
        assert (counts["shfl"], counts["stsm"]) == (0, 0), (block_n, counts)
        # Triton 3.9 puts no barrier between the four chunks; 3.6 (the GPU machine's) one between each two
        assert counts["bar"] <= 3, (block_n, counts)


# (page size, keys a step, heads, cache): whole tiles in a page and several pages a tile; a partial head block (17,
# 40), a full one (64) and a full and a partial one (100); both fp8 caches at both tile shapes
# The scores' fp8 products are summed by the tensor cores keeping about 14 bits (their sums added into float32 every
# 128 dims): on an H100, queries quantized exactly (benchmarks/results/round52/scripts/exact_queries.py) moved the LSE
# by 7e-5 to 9e-5 of the largest, the output by 1.1e-3 to 1.4e-3 (the warp-specialized form: 1e-7 and 0.9e-3 to
# 1.0e-3).
LSE_REL_TOL = 5e-4
FP8_SCORES_CASES = [
    (64, 64, 64, torch.float8_e4m3fn),
    (7, 64, 40, torch.float8_e4m3fn),
    (1, 64, 17, torch.float8_e5m2),
    (16, 32, 100, torch.float8_e4m3fn),
    (3, 32, 128, torch.float8_e5m2),
    (8, 64, 64, torch.float8_e5m2),
]


SCALE, KV_SCALE = 0.07, 0.0625  # the GPU tests' softmax scale and fp8 cache scale


def quantized_cases(page_size: int, block_n: int, num_heads: int, cache: torch.dtype, device: str = "cuda"):
    """The GPU tests' problems: the poisoned fixture over an fp8 ``cache`` (lengths 1, P-1, P, P+1, 63-65, 300 and
    0), once for bf16 and once for fp16 queries, each with the float64 reference of its e4m3 queries (``ref``,
    ``ref_lse``), the 16-bit math's tolerance about it (``tol``) and ``drift``: what a relative error of
    ``LSE_REL_TOL`` in every score (the tensor cores' fp8 sums) moves it by."""
    lens = [1, max(page_size - 1, 1), page_size, page_size + 1, 63, 64, 65, 300, 0]
    case = make_mla_case(lens, page_size=page_size, num_heads=num_heads, rank=512, rope_dim=64, device=device,
                         seed=page_size + block_n)  # fmt: skip
    kv_cache = quantize_kv(case.kv_cache, cache, KV_SCALE)
    exact = dequantize_kv(kv_cache, KV_SCALE, torch.float64)
    for dtype in (torch.bfloat16, torch.float16):
        queries = {"q_nope": case.q_nope.to(dtype), "q_rope": case.q_rope.to(dtype)}
        q8 = dict(zip(("q_nope", "q_rope"), fp8_queries(**queries)))
        inputs = {**case.inputs(), "kv_cache": kv_cache, **queries}
        ref, ref_lse = mla_decode_ref(**{**inputs, "kv_cache": exact, **q8}, scale=SCALE, return_lse=True)
        lowp = mla_decode_ref(**{**inputs, "kv_cache": exact.to(dtype), **{k: v.to(dtype) for k, v in q8.items()}},
                              scale=SCALE, upcast=False)  # fmt: skip
        drift = max_error(mla_decode_ref(**{**inputs, "kv_cache": exact, **q8}, scale=SCALE * (1 + LSE_REL_TOL)), ref)
        yield types.SimpleNamespace(case=case, dtype=dtype, inputs=inputs, q8=q8, exact=exact, ref=ref,
                                    ref_lse=ref_lse, tol=tolerance(ref, lowp, dtype), drift=drift)  # fmt: skip


def copies(kv_cache: torch.Tensor, block_n: int) -> tuple[bool, ...]:
    """The ``TMA`` settings a test runs the form with: both where the cache allows TMA copies, else cp.async."""
    return (True, False) if wide_fp8.tma_rows(kv_cache, block_n) else (False,)


@pytest.mark.skipif(not _runs_here(), reason="needs an NVIDIA GPU of compute capability 9.x (no Gluon interpreter)")
@pytest.mark.parametrize(("page_size", "block_n", "num_heads", "cache"), FP8_SCORES_CASES)
def test_fp8_scores_against_the_reference_of_their_queries(page_size, block_n, num_heads, cache, monkeypatch):
    """The fp8-scores form against the float64 reference of the same queries quantized as the kernel does
    (:func:`fp8_queries`), at 1 and 3 splits, on the poisoned fixture: within the tolerance of the 16-bit math plus
    what a relative error of ``LSE_REL_TOL`` in every score moves the output by (the tensor cores' fp8 sums); zeros
    for the sequence without keys; the LSE within ``LSE_REL_TOL`` of the largest. Against the reference of
    the unquantized queries, the queries' e4m3 rounding costs at most 1.5 times what the cache's own rounding does
    (the warp-specialized form's error, which rounds the queries to 16 bits, added)."""
    tiles = MLATileConfig(64, block_n, 8, 2, wide=True, producer=True, fp8_scores=True)
    for c in quantized_cases(page_size, block_n, num_heads, cache):
        dtype, inputs, ref, ref_lse, batch = c.dtype, c.inputs, c.ref, c.ref_lse, len(c.inputs["seq_lens"])
        kv_cache, queries = inputs["kv_cache"], {k: inputs[k] for k in ("q_nope", "q_rope")}
        plain_ref = mla_decode_ref(**{**inputs, "kv_cache": c.exact}, scale=SCALE)  # the unquantized queries
        cache_ref = mla_decode_ref(**{**inputs, "kv_cache": c.case.kv_cache.double()}, scale=SCALE)
        args = [inputs[k] for k in ("q_nope", "q_rope", "kv_cache", "page_table", "seq_lens")]
        for splits, tma, pipe in itertools.product((1, 3), copies(kv_cache, block_n), (False, True)):
            monkeypatch.setattr(wide_fp8, "TMA", tma)
            monkeypatch.setattr(wide_fp8, "PIPELINED", pipe)
            workspace = torch.empty(4 * batch * num_heads * splits * 513, dtype=torch.uint8, device="cuda")
            got = {}
            for name, t in (("fp8 scores", tiles), ("producer", WIDE_PRODUCER_TILES)):
                out = torch.full_like(queries["q_nope"], float("nan"))
                lse = torch.full((batch, num_heads), float("nan"), device="cuda")
                mla_decode_forward(*args, out, scale=SCALE, num_kv_splits=splits, workspace=workspace, lse=lse,
                                   tiles=t, kv_scale=KV_SCALE)  # fmt: skip
                got[name] = out, lse
            out, lse = got["fp8 scores"]
            where = (f"{dtype}, {cache}, page {page_size}, {block_n} keys, {num_heads} heads, {splits} splits,"
                     f" {'TMA' if tma else 'cp.async'}{', pipelined' if pipe else ''}")  # fmt: skip
            finite = torch.isfinite(ref_lse)
            assert torch.equal(torch.isfinite(lse), finite), where
            assert torch.equal(out[-1], torch.zeros_like(out[-1])), where  # no keys: zeros
            measured = {
                "error": max_error(out, ref),
                "lse": max_error(lse[finite], ref_lse[finite]) / float(ref_lse[finite].abs().max()),
                "unquantized": max_error(out, plain_ref),  # what the queries' e4m3 rounding costs ...
            }
            allowed = {
                "error": c.tol + c.drift,
                "lse": LSE_REL_TOL,
                # ... next to what the cache's own rounding costs
                "unquantized": max_error(got["producer"][0], plain_ref) + 1.5 * max_error(plain_ref, cache_ref),
            }
            report = ", ".join(f"{k} {measured[k]:.3e} (allowed {allowed[k]:.3e})" for k in measured)
            print(f"{where}: {report}")  # shown with pytest -s
            assert all(measured[k] <= allowed[k] for k in measured), f"{where}: {report}"


def value_magnitudes(inputs: dict, q8: dict, exact: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum p |v| / sum p, sum |v| / sum p)`` for each output element, in float64, of the quantized queries ``q8``
    over the exactly dequantized cache: what bounds the error of probabilities rounded to e4m3 (a relative 2^-4
    where normal, an absolute 2^-18 below)."""
    batch, heads, rank = q8["q_nope"].shape
    weighted = torch.zeros(batch, heads, rank, dtype=torch.float64, device=exact.device)
    plain = torch.zeros_like(weighted)
    for b, num_keys in enumerate(inputs["seq_lens"].tolist()):
        if num_keys == 0:
            continue
        rows = gather_sequence(exact, inputs["page_table"][b], num_keys)  # [keys, rank + rope]
        s = (q8["q_nope"][b] @ rows[:, :rank].T + q8["q_rope"][b] @ rows[:, rank:].T) * scale
        p = torch.exp(s - s.max(-1, keepdim=True).values)
        total = p.sum(-1, keepdim=True)
        weighted[b] = p @ rows[:, :rank].abs() / total
        plain[b] = rows[:, :rank].abs().sum(0) / total
    return weighted, plain


# (page size, keys a step, heads, cache, ring slots: 2 for the default, three, with two values buffers)
FP8_VALUES_CASES = [
    (64, 64, 64, torch.float8_e4m3fn, 2),
    (7, 64, 40, torch.float8_e4m3fn, 4),
    (1, 64, 17, torch.float8_e5m2, 2),
    (16, 32, 100, torch.float8_e4m3fn, 4),
    (3, 32, 128, torch.float8_e5m2, 2),
    (16, 64, 100, torch.float8_e5m2, 2),
    (8, 64, 40, torch.float8_e4m3fn, 2),
    # up to 32 heads in the seesaw kernel's 64-head programs (pages TMA copies): 16 and 32 rows in one pass
    (64, 64, 17, torch.float8_e4m3fn, 2),
    (16, 64, 32, torch.float8_e5m2, 2),
    (64, 64, 16, torch.float8_e5m2, 2),
]


@pytest.mark.skipif(not _runs_here(), reason="needs an NVIDIA GPU of compute capability 9.x (no Gluon interpreter)")
@pytest.mark.parametrize(("page_size", "block_n", "num_heads", "cache", "ring"), FP8_VALUES_CASES)
def test_fp8_values_within_the_bound_of_their_probabilities_rounding(
    page_size, block_n, num_heads, cache, ring, monkeypatch
):
    """The form with an fp8 value product against the float64 reference of its e4m3 queries, at 1 and 3 splits,
    on the poisoned fixture: each output element within the 16-bit tolerance, the fp8 sums' drift and the bound
    of its probabilities' e4m3 rounding (:func:`value_magnitudes`); the LSE (summed from float32 probabilities)
    within ``LSE_REL_TOL``; zeros for the sequence without keys."""
    heads = num_heads
    tiles = MLATileConfig(64, block_n, 8, ring, wide=True, producer=True, fp8_scores=True, fp8_values=True)
    for c in quantized_cases(page_size, block_n, num_heads, cache):
        dtype, inputs, ref, ref_lse, batch = c.dtype, c.inputs, c.ref, c.ref_lse, len(c.inputs["seq_lens"])
        kv_cache, queries = inputs["kv_cache"], {k: inputs[k] for k in ("q_nope", "q_rope")}
        weighted, plain = value_magnitudes(inputs, c.q8, c.exact, SCALE)
        allowed = c.tol + c.drift + 2.0**-4 * weighted + 2.0**-18 * plain
        args = [inputs[k] for k in ("q_nope", "q_rope", "kv_cache", "page_table", "seq_lens")]
        pipelined = (True, False) if ring == 2 else (False,)  # two values buffers (ring 3): pipelined or not
        # (pipelined, seesaw, value products from registers, the seesaw kernel's first form): the seesaw kernel
        # (mla_decode_seesaw_fp8 as by default, as before PAGE_AHEAD and TRANS_LOAD, or mla_decode_seesaw_vregs)
        # where TMA copies 64-key tiles
        seesaw_forms = [(False, True, False, False), (False, True, False, True), (False, True, True, False)]
        forms = [(pipe, False, False, False) for pipe in pipelined] + seesaw_forms * (block_n == 64)
        for splits, tma, (pipe, seesaw, vregs, first) in itertools.product((1, 3), copies(kv_cache, block_n), forms):
            if seesaw and not tma:
                continue
            monkeypatch.setattr(wide_fp8, "TMA", tma)
            monkeypatch.setattr(wide_fp8, "PIPELINED", pipe)
            monkeypatch.setattr(wide_fp8, "SEESAW", seesaw)
            monkeypatch.setattr(wide_fp8, "SEESAW_VREGS", vregs)
            monkeypatch.setattr(seesaw_fp8, "PAGE_AHEAD", not first)
            monkeypatch.setattr(seesaw_fp8, "TRANS_LOAD", not first)
            workspace = torch.empty(4 * batch * num_heads * splits * 513, dtype=torch.uint8, device="cuda")
            out = torch.full_like(queries["q_nope"], float("nan"))
            lse = torch.full((batch, num_heads), float("nan"), device="cuda")
            mla_decode_forward(*args, out, scale=SCALE, num_kv_splits=splits, workspace=workspace, lse=lse,
                               tiles=tiles, kv_scale=KV_SCALE)  # fmt: skip
            form = f"{'TMA' if tma else 'cp.async'}{', pipelined' if pipe else ''}{', seesaw' if seesaw else ''}"
            form += ", values from registers" if vregs else ", its first form" if first else ""
            where = f"{dtype}, {cache}, page {page_size}, {block_n} keys, {heads} heads, ring {ring}, {splits} splits"
            where += f", {form}"
            finite = torch.isfinite(ref_lse)
            assert torch.equal(torch.isfinite(lse), finite), where
            assert torch.equal(out[-1], torch.zeros_like(out[-1])), where  # no keys: zeros
            error = (out.double() - ref).abs()
            lse_error = max_error(lse[finite], ref_lse[finite]) / float(ref_lse[finite].abs().max())
            report = (f"max error {float(error.max()):.3e}, largest share of its bound "
                      f"{float((error / allowed).max()):.3f}, LSE {lse_error:.3e}")  # fmt: skip
            print(f"{where}: {report}")  # shown with pytest -s
            assert bool((error <= allowed).all()) and lse_error <= LSE_REL_TOL, f"{where}: {report}"


@pytest.mark.skipif(not _runs_here(), reason="needs an NVIDIA GPU of compute capability 9.x (no Gluon interpreter)")
def test_pdl_and_early_copies_change_no_output(monkeypatch):
    """Programmatic dependent launch of the split merge (``launch.PDL``) and the seesaw kernel's ``EARLY_COPIES`` (the
    first copies started by the prologue, not by the producer), ``KEEP_QUERIES`` (the second pass reading the queries
    from shared memory, not from memory again) and ``ONE_PASS`` (32 head rows loaded and rounded in one pass) change
    when loads, copies and kernels start, not what they compute: on the poisoned fixture (17 heads, page 64, e4m3, 3
    splits), each form's output and LSE equal those of the form with none of them, bit for bit, eager and replayed
    from a captured graph."""
    from portattn.kernels.triton import launch

    tiles = MLATileConfig(64, 64, 8, 3, wide=True, producer=True, fp8_scores=True, fp8_values=True)
    c = next(quantized_cases(64, 64, 17, torch.float8_e4m3fn))
    args = [c.inputs[k] for k in ("q_nope", "q_rope", "kv_cache", "page_table", "seq_lens")]
    batch, splits = len(c.inputs["seq_lens"]), 3
    workspace = torch.empty(4 * batch * 17 * splits * 513, dtype=torch.uint8, device="cuda")
    out = torch.full_like(c.inputs["q_nope"], float("nan"))
    lse = torch.full((batch, 17), float("nan"), device="cuda")

    def run():
        mla_decode_forward(*args, out, scale=SCALE, num_kv_splits=splits, workspace=workspace, lse=lse, tiles=tiles,
                           kv_scale=KV_SCALE)  # fmt: skip

    monkeypatch.setattr(wide_fp8, "SEESAW", True)
    assert launch.pdl_options(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}  # compute capability 9
    results = {}
    # (PDL, EARLY_COPIES, KEEP_QUERIES, ONE_PASS): none, each alone, and together as they combine (KEEP_QUERIES acts
    # in the two passes only, ONE_PASS off)
    forms = [(False,) * 4] + [tuple(i == j for j in range(4)) for i in range(4)]
    forms += [(True, True, True, False), (True, True, False, True), (False, True, True, True)]
    for form in forms:
        pdl, early, keep, one_pass = form
        monkeypatch.setattr(launch, "PDL", pdl)
        monkeypatch.setattr(seesaw_fp8, "EARLY_COPIES", early)
        monkeypatch.setattr(seesaw_fp8, "KEEP_QUERIES", keep)
        monkeypatch.setattr(seesaw_fp8, "ONE_PASS", one_pass)
        _, _, kwargs = seesaw_fp8.launch_arguments(
            *args, out, lse, out, lse, q_scale=1.0, qk_scale_log2=1.0, kv_scale=1.0, num_kv_splits=splits,
            write_partial=True, write_lse=True, min_split=1,
        )  # fmt: skip
        assert (kwargs["EARLY_COPIES"], kwargs["KEEP_QUERIES"]) == (early, keep)
        assert kwargs["Q_ROWS"] == (32 if one_pass else 64)
        out.fill_(float("nan")), lse.fill_(float("nan"))
        run()
        results[form, "eager"] = out.clone(), lse.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        out.fill_(float("nan")), lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        results[form, "graph"] = out.clone(), lse.clone()
    plain_out, plain_lse = results[forms[0], "eager"]
    assert torch.isfinite(plain_out).all() and torch.equal(plain_out[-1], torch.zeros_like(plain_out[-1]))
    for form, (o, s) in results.items():
        assert torch.equal(o, plain_out), form
        assert torch.equal(s.nan_to_num(), plain_lse.nan_to_num()) and torch.equal(s.isnan(), plain_lse.isnan()), form
