"""MLA decode for 64-head blocks on Hopper's warpgroup MMA (``mla_decode_wide``).

On any machine: the tile rules (which tiles launch it, which are refused, what an explicit request says where it
cannot run). Compiled for sm_90 in a child process (Gluon has no interpreter): each key step issues the scores'
MMAs once (split by keys between the warpgroups, ``m64n{BLOCK_N/2}k16``, 36 a step) and the values' ``m64n256k16``,
copies the tile in 16-byte ``cp.async``, converts an fp8 tile once (``cvt.rn.f16x2.e4m3x2``), takes at most 6
barriers a step (8 converting), fits Hopper's shared memory and spills nothing; a launch's arguments pass Triton's
runtime binder. On a Hopper GPU: results against the float64 reference and against the portable kernel on the
ops' poisoned fixture (NaN in every slot no sequence owns, an out-of-range page id in each row's tail), over
bfloat16, float16, e4m3 and e5m2 caches.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

from kernels.mla_checks import check_against_reference_and_portable, record_launches, run_compile_child
from ops.test_mla import make_mla_case
from portattn.device import is_triton_interpreter
from portattn.kernels.triton import mla_decode_wide as wide
from portattn.kernels.triton.mla_decode_launch import (
    WIDE_FP8_SCORES_TILES,
    WIDE_FP8_TILES,
    WIDE_FP8_VALUES_TILES,
    WIDE_PRODUCER_TILES,
    WIDE_TILES,
    MLATileConfig,
    choose_tiles,
    mla_decode_forward,
)
from portattn.kv_quant import dequantize_kv, quantize_kv
from portattn.testing import max_error, mla_decode_ref, tolerance

HOPPER_SHARED = 232_448  # bytes of shared memory a program may take on compute capability 9.0

CHILD = textwrap.dedent(
    """
    import re, sys
    try:
        from triton.experimental.gluon import language as gl
    except ImportError as exc:
        print("no compiler:", exc); sys.exit(3)
    from kernels.mla_checks import compile_for_hopper, key_loop, stack_bytes
    from portattn.kernels.triton import mla_decode_wide as wide

    fn = wide.mla_decode_wide_kernel
    ptrs = {"QNope": "*bf16", "QRope": "*bf16", "PageTable": "*i32", "SeqLensK": "*i32", "Out": "*bf16",
            "Lse": "*fp32", "PartOut": "*fp32", "PartLse": "*fp32"}
    for kv, block_n, stages, page_size in (("*bf16", 64, 2, 64), ("*bf16", 32, 3, 16), ("*fp8e4nv", 64, 2, 7),
                                           ("*fp8e4nv", 32, 3, 64), ("*fp8e5", 64, 2, 1)):
        fp8 = kv != "*bf16"
        const = {**wide.constexprs(block_n, stages, fp8), "PAGE_SIZE": page_size, "WRITE_PARTIAL": True,
                 "WRITE_LSE": True, "MIN_SPLIT": 256, "DOT": gl.float16 if fp8 else gl.bfloat16}
        kernel = compile_for_hopper(fn, {**ptrs, "KV": kv}, const, {"num_warps": wide.NUM_WARPS})
        text = key_loop(kernel.asm["ptx"])
        scores = rf"wgmma\\.mma_async\\.sync\\.aligned\\.m64n{block_n // 2}k16\\.f32\\.(?:bf16|f16)"
        counts = {name: len(re.findall(rx, text)) for name, rx in (
            ("scores", scores), ("values", r"wgmma\\.mma_async\\.sync\\.aligned\\.m64n256k16"),
            ("copies", r"cp\\.async\\.cg\\.shared\\.global(?:\\.L2::\\w+)? \\[[^]]+\\], \\[[^]]+\\], (?:16|0x10)"),
            ("e4m3", r"cvt\\.rn\\.f16x2\\.e4m3x2"), ("byte", r"ld\\.shared\\.(?:u8|b8|s8)"),
            ("barriers", r"\\bbar\\.sync"))}
        print("kernel", kv, block_n, stages, page_size, f"shared={kernel.metadata.shared}",
              f"stack={stack_bytes(kernel)}", " ".join(f"{k}={v}" for k, v in counts.items()), flush=True)

    # as a launch binds them: the runtime's binder and packing over real (CPU) tensors, then the compile
    from kernels.mla_checks import compile_as_launched
    grid, kv, q_scale, shared = compile_as_launched(wide, 70, wide.mla_decode_wide_kernel)
    print("launched", *grid, kv, q_scale, shared, flush=True)
    """
)


def test_the_kernel_compiles_for_hopper_with_one_set_of_score_mmas_and_no_spills(tmp_path):
    lines = run_compile_child(tmp_path, CHILD, "compile_mla_wide", timeout=600)
    kernels = [line.split() for line in lines if line.startswith("kernel ")]
    assert len(kernels) == 5, lines
    for _, kv, block_n, stages, page_size, *fields in kernels:
        counts = {k: int(v) for k, v in (field.split("=") for field in fields)}
        keys, fp8 = int(block_n), kv != "*bf16"
        # A step: the scores' 32 + 4 K-steps of 16 (latent, rope) once, each warpgroup its half of the keys; the
        # values' keys / 16; the copy a lane's 16-byte share of keys x 576 elements (8 warps; 32 keys of fp8 rope
        # are half a copy's width: two lanes copy the same bytes); each fp8 value converted once, in pairs (counted
        # for e4m3).
        per_lane = 16 if fp8 else 8
        copies = keys * 512 // (256 * per_lane) + max(1, keys * 64 // (256 * per_lane))  # (rope: some twice)
        expected = {"scores": 36, "values": keys // 16, "copies": copies, "byte": 0}
        if kv == "*fp8e4nv":
            expected["e4m3"] = keys * 576 // 256 // 2
        assert {k: counts[k] for k in expected} == expected, (kv, block_n, stages, page_size, counts)
        # the step's (and Triton's own after the copies' wait), the row maximum's, the probabilities'; Triton 3.6
        # one after the next tile's copy, Triton 3.9 one after each warpgroup MMA's wait; converting, the
        # converted halves (Triton does not tell the slices of one buffer apart: one barrier between them)
        assert counts["barriers"] <= (8 if fp8 else 6), (kv, block_n, counts)
        assert counts["shared"] <= HOPPER_SHARED
        assert counts["shared"] >= wide.shared_bytes(keys, int(stages), fp8)
        assert counts["stack"] in (0, -1), (kv, block_n, counts)  # no spills (-1: no cuobjdump to ask)
    launched = [line.split() for line in lines if line.startswith("launched ")]
    assert launched and launched[0][1:6] == ["2", "2", "3", "*fp8e4nv", "fp32"], lines


WS_CHILD = textwrap.dedent(
    """
    import re, sys
    try:
        from triton.experimental.gluon import language as gl
    except ImportError as exc:
        print("no compiler:", exc); sys.exit(3)
    from kernels.mla_checks import compile_for_hopper, serialized_mma_notes
    from portattn.kernels.triton import mla_decode_wide as wide

    fn = wide.mla_decode_wide_ws_kernel
    ptrs = {"QNope": "*bf16", "QRope": "*bf16", "PageTable": "*i32", "SeqLensK": "*i32", "Out": "*bf16",
            "Lse": "*fp32", "PartOut": "*fp32", "PartLse": "*fp32"}
    for kv, block_n, page_size in (("*bf16", 64, 64), ("*fp8e4nv", 64, 7), ("*fp8e5", 32, 16)):
        fp8 = kv != "*bf16"
        const = {**wide.constexprs(block_n, 2, fp8, producer=True), "PAGE_SIZE": page_size, "WRITE_PARTIAL": True,
                 "WRITE_LSE": True, "MIN_SPLIT": 256, "DOT": gl.float16 if fp8 else gl.bfloat16}
        kernel = compile_for_hopper(fn, {**ptrs, "KV": kv}, const,
                                    {"num_warps": wide.NUM_WARPS, "maxnreg": wide.PRODUCER_MAXNREG})
        ptx = kernel.asm["ptx"]
        counts = {name: len(re.findall(rx, ptx)) for name, rx in (
            ("scores", rf"wgmma\\.mma_async\\.sync\\.aligned\\.m64n{block_n // 2}k16"),
            ("values", r"wgmma\\.mma_async\\.sync\\.aligned\\.m64n256k16"),
            ("e4m3", r"cvt\\.rn\\.f16x2\\.e4m3x2"), ("copies", r"cp\\.async\\.cg"),
            ("waits", r"mbarrier\\.try_wait"), ("arrives", r"mbarrier\\.arrive"))}
        regs = sorted(set(int(n) for n in re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)))
        notes = serialized_mma_notes(kernel)
        print("kernel", kv, block_n, f"warps={kernel.metadata.num_warps}", f"shared={kernel.metadata.shared}",
              f"regs={','.join(map(str, regs))}", " ".join(f"{k}={v}" for k, v in counts.items()),
              f"serialized={-1 if notes is None else len(notes)}", flush=True)
    """
)


def test_the_warp_specialized_form_compiles_for_hopper_with_a_producer_warpgroup(tmp_path):
    """``mla_decode_wide_ws_kernel`` compiled for sm_90: twelve warps (the producer's four beside the consumers'
    eight), ``setmaxnreg`` giving the producer ``PRODUCER_REGS`` (``PRODUCER_REGS_FP8`` over fp8) and the
    consumers the rest of ``PRODUCER_MAXNREG``, the consumers' products once a tile, an fp8 tile converted by the
    producer (no copies then), a 16-bit one copied by ``cp.async``, the slots' mbarriers waited and arrived on,
    within Hopper's shared memory, no product serialized by ptxas."""
    lines = run_compile_child(tmp_path, WS_CHILD, "compile_mla_wide_ws", timeout=600)
    kernels = [line.split() for line in lines if line.startswith("kernel ")]
    assert len(kernels) == 3, lines
    for _, kv, block_n, *fields in kernels:
        counts = dict(field.split("=") for field in fields)
        keys, fp8 = int(block_n), kv != "*bf16"
        producer = (wide.PRODUCER_REGS_FP8 if fp8 else wide.PRODUCER_REGS).value
        consumers = (wide.PRODUCER_MAXNREG * 12 - producer * wide.PRODUCER_WARPS.value) // 8
        assert counts["warps"] == "12" and int(counts["shared"]) <= HOPPER_SHARED, (kv, counts)
        assert int(counts["shared"]) >= wide.shared_bytes(keys, 2, fp8, producer=True), (kv, counts)
        assert {str(producer), str(consumers)} <= set(counts["regs"].split(",")), (kv, counts)
        assert (counts["scores"], counts["values"]) == ("36", str(keys // 16)), (kv, counts)
        assert int(counts["waits"]) >= 2 and int(counts["arrives"]) >= 2, (kv, counts)
        assert int(counts["serialized"]) <= 0, (kv, counts)  # ptxas issues the products back to back (-1: no ptxas)
        if fp8:
            assert counts["copies"] == "0", (kv, counts)
        else:
            assert int(counts["copies"]) > 0 and counts["e4m3"] == "0", (kv, counts)
        if kv == "*fp8e4nv":
            # each value once, in pairs, by the producer's lanes
            assert counts["e4m3"] == str(keys * 576 // 2 // (32 * wide.PRODUCER_WARPS.value)), (kv, counts)


CONFLICTS_CHILD = textwrap.dedent(
    """
    import sys
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError as exc:
        print("no compiler:", exc); sys.exit(3)
    from portattn.kernels.triton import mla_decode_wide as wide

    @gluon.jit
    def conflicts(X, LD: gl.constexpr, LD_PE: gl.constexpr, C_16: gl.constexpr, PE_16: gl.constexpr,
                  FP8: gl.constexpr, BLOCK_N: gl.constexpr):
        if FP8:  # converted to float16
            gl.static_print("conflicts latent", gl.bank_conflicts(gl.distributed_type(gl.float16, [BLOCK_N, 128], LD),
                            gl.shared_memory_descriptor_type(gl.float16, [BLOCK_N, 128], C_16, [BLOCK_N, 128])))
            gl.static_print("conflicts rope", gl.bank_conflicts(gl.distributed_type(gl.float16, [BLOCK_N, 64], LD_PE),
                            gl.shared_memory_descriptor_type(gl.float16, [BLOCK_N, 64], PE_16, [BLOCK_N, 64])))
        else:
            gl.static_print("conflicts latent", gl.bank_conflicts(gl.distributed_type(gl.bfloat16, [BLOCK_N, 128], LD),
                            gl.shared_memory_descriptor_type(gl.bfloat16, [BLOCK_N, 128], C_16, [BLOCK_N, 128])))
            gl.static_print("conflicts rope", gl.bank_conflicts(gl.distributed_type(gl.bfloat16, [BLOCK_N, 64], LD_PE),
                            gl.shared_memory_descriptor_type(gl.bfloat16, [BLOCK_N, 64], PE_16, [BLOCK_N, 64])))

    for fp8 in (False, True):
        for block_n in (32, 64):
            c = wide.constexprs(block_n, 2, fp8, producer=True)
            const = {name: c[name] for name in ("LD", "LD_PE", "C_16", "PE_16")}
            const |= {"FP8": fp8, "BLOCK_N": block_n}
            print("case", "fp8" if fp8 else "bf16", block_n, flush=True)
            src = GluonASTSource(fn=conflicts, signature={"X": "*i32", **{k: "constexpr" for k in const}},
                                 constexprs=const)
            try:
                triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": wide.PRODUCER_WARPS.value})
            except (FileNotFoundError, RuntimeError) as exc:
                if "ptxas" in str(exc):
                    print("no ptxas:", exc); sys.exit(3)
                raise
    """
)


def test_the_producers_stores_into_the_ring_are_free_of_bank_conflicts(tmp_path):
    """The warp-specialized form's producer stores each [keys, 128] chunk of the latent and the rope into the ring
    (Hopper's swizzled tensor-core layout) from its loads' registers: over fp8 converted to float16, a lane's 16
    bytes become two 16-byte stores. Triton's count of the extra wavefronts those stores take is 0 for every cache
    and tile (over fp8 the earlier layout, eight lanes on 128 bytes of one key, took one extra: two wavefronts a
    quarter-warp; an H100 profile counted 14% of the step's shared-memory wavefronts excessive)."""
    lines = run_compile_child(tmp_path, CONFLICTS_CHILD, "compile_mla_wide_conflicts", timeout=300)
    counts = [line for line in lines if line.startswith("conflicts")]
    assert len([line for line in lines if line.startswith("case ")]) == 4 and len(counts) == 8, lines
    assert all(line.endswith(" 0") for line in counts), lines


def _runs_here() -> bool:
    return torch.cuda.is_available() and not is_triton_interpreter() and torch.cuda.get_device_capability()[0] == 9


# (page size, keys a step, stages, heads, cache): whole tiles in a page (64), several pages a tile (16, 7, 3, 1); one
# head block, a partial one (40; 17 and 32, which the default gives it), a full and a partial one (100); each cache
# dtype at both tile shapes
CASES = [
    (3, 64, 2, 17, "same"),
    (64, 32, 3, 32, "same"),
    (7, 64, 2, 32, torch.float8_e4m3fn),
    (64, 64, 2, 128, "same"),
    (7, 64, 2, 40, torch.float8_e4m3fn),
    (16, 64, 2, 100, torch.float8_e5m2),
    (1, 32, 3, 100, "same"),
    (16, 32, 3, 128, torch.float8_e4m3fn),
    (64, 32, 3, 40, torch.float8_e5m2),
]


@pytest.mark.skipif(not _runs_here(), reason="needs an NVIDIA GPU of compute capability 9.x (no Gluon interpreter)")
@pytest.mark.parametrize("producer", [False, True], ids=["plain", "producer"])
@pytest.mark.parametrize(("page_size", "block_n", "stages", "num_heads", "cache"), CASES)
def test_against_the_reference_and_the_portable_kernel(page_size, block_n, stages, num_heads, cache, producer):
    lens = [1, max(page_size - 1, 1), page_size, page_size + 1, 63, 64, 65, 300, 0]
    case = make_mla_case(lens, page_size=page_size, num_heads=num_heads, rank=512, rope_dim=64, device="cuda",
                         seed=page_size + block_n)  # fmt: skip
    scale, kv_scale = 0.07, (1.0 if cache == "same" else 0.0625)
    tiles = MLATileConfig(block_h=64, block_n=block_n, num_warps=8, num_stages=stages, wide=True, producer=producer)
    for dtype in (torch.bfloat16, torch.float16):
        queries = {"q_nope": case.q_nope.to(dtype), "q_rope": case.q_rope.to(dtype)}
        if cache == "same":
            kv_cache = case.kv_cache.to(dtype)
            exact = kv_cache.double()
        else:
            kv_cache = quantize_kv(case.kv_cache, cache, kv_scale)
            exact = dequantize_kv(kv_cache, kv_scale, torch.float64)
        inputs = {**case.inputs(), "kv_cache": kv_cache, **queries}
        ref, ref_lse = mla_decode_ref(**{**inputs, "kv_cache": exact}, scale=scale, return_lse=True)
        lowp = mla_decode_ref(**{**inputs, "kv_cache": exact.to(dtype)}, scale=scale, upcast=False)
        check_against_reference_and_portable(inputs, tiles, scale=scale, kv_scale=kv_scale, ref=ref, ref_lse=ref_lse,
                                             tol=tolerance(ref, lowp, dtype), lse_rel_tol=1e-4)  # fmt: skip


def test_explicit_wide_tiles_name_what_they_need_here():
    """Asked for where it cannot run (this machine: no Hopper GPU, or an interpreter), the launcher says what it
    needs; ``wide=True`` picks the tiles for more than 16 heads of 16-bit queries over any cache (over fp8 its
    fp8-scores form with fp8 values, unless ``fp8_scores=False``), never interpreted."""
    if _runs_here():
        pytest.skip("the kernel runs here")
    case = make_mla_case([3], page_size=4, num_heads=2, rank=512, rope_dim=64, device="cpu")
    inputs = case.inputs()
    out = torch.empty_like(case.q_nope)
    args = (inputs["q_nope"], inputs["q_rope"], inputs["kv_cache"], inputs["page_table"], inputs["seq_lens"], out)
    needs = r"expected (a GPU without TRITON_INTERPRET|an NVIDIA GPU|compute capability 9\.x).*wide=True"
    with pytest.raises(ValueError, match=needs):
        mla_decode_forward(*args, scale=0.1, num_kv_splits=1, tiles=WIDE_TILES)
    assert choose_tiles(128, torch.bfloat16, interpret=False, wide=True) == WIDE_PRODUCER_TILES
    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert choose_tiles(128, torch.bfloat16, interpret=False, kv_dtype=kv_dtype, wide=True) == WIDE_FP8_VALUES_TILES
        tiles = choose_tiles(128, torch.bfloat16, interpret=False, kv_dtype=kv_dtype, wide=True, fp8_scores=False)
        assert tiles == WIDE_PRODUCER_TILES
    assert choose_tiles(17, torch.bfloat16, interpret=False, wide=True) == WIDE_PRODUCER_TILES
    assert not choose_tiles(16, torch.bfloat16, interpret=False, wide=True).wide
    assert not choose_tiles(128, torch.float32, interpret=False, wide=True).wide
    assert not choose_tiles(128, torch.bfloat16, interpret=True, wide=True).wide
    assert not choose_tiles(128, torch.bfloat16, interpret=False, wide=False).wide


def test_by_default_more_than_16_heads_take_the_kernel(monkeypatch):
    """``WIDE`` picks the kernel over bf16 and fp16 caches for more than 16 heads (``WIDE_MIN_HEADS``: 17-32 heads
    fill part of a block and still ran 1.6-1.7x faster than the portable kernel's 32-head blocks), ``WIDE_FP8``
    over fp8 ones past the ``fp8_mma`` kernel's 32, both in its warp-specialized form (``WIDE_PRODUCER_TILES``,
    also named ``WIDE_FP8_TILES``; both on), over fp8 its fp8-scores form with fp8 values
    (``WIDE_FP8_VALUES_TILES``, ``WIDE_FP8_SCORES`` and ``WIDE_FP8_VALUES`` on; from 17 heads where the batch is not
    known or holds ``WIDE_FP8_MIN_BATCH`` sequences); an explicit ``wide`` overrides both."""
    from portattn.kernels.triton import mla_decode_launch as launch

    bf16, e4m3, e5m2 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2
    assert launch.WIDE and launch.WIDE_FP8
    assert choose_tiles(128, bf16, interpret=False) == WIDE_PRODUCER_TILES
    assert choose_tiles(40, torch.float16, interpret=False, kv_dtype=torch.float16) == WIDE_PRODUCER_TILES
    assert choose_tiles(128, bf16, interpret=False, kv_dtype=e4m3) == WIDE_FP8_VALUES_TILES
    assert choose_tiles(128, bf16, interpret=False, kv_dtype=e4m3, fp8_values=False) == WIDE_FP8_SCORES_TILES
    assert MLATileConfig(64, 64, 8, 2, wide=True, producer=True) == WIDE_PRODUCER_TILES == WIDE_FP8_TILES
    assert MLATileConfig(64, 64, 8, 2, wide=True) == WIDE_TILES  # the plain form, when asked for
    assert launch.WIDE_MIN_HEADS == 16
    assert choose_tiles(32, bf16, interpret=False) == WIDE_PRODUCER_TILES
    assert choose_tiles(17, torch.float16, interpret=False, kv_dtype=torch.float16) == WIDE_PRODUCER_TILES
    assert choose_tiles(16, bf16, interpret=False) == MLATileConfig(16, 32, 4, 3)
    assert choose_tiles(32, bf16, interpret=False, kv_dtype=e4m3) == WIDE_FP8_VALUES_TILES
    assert choose_tiles(32, bf16, interpret=False, kv_dtype=e4m3, batch=4) == launch.FP8_MMA_TILES
    assert choose_tiles(32, bf16, interpret=False, kv_dtype=e4m3, fp8_mma=True) == launch.FP8_MMA_32_HEAD_TILES
    assert choose_tiles(32, bf16, interpret=False, kv_dtype=e4m3, fp8_mma=False) == WIDE_FP8_VALUES_TILES
    assert choose_tiles(32, bf16, interpret=False, wide=False) == MLATileConfig(32, 32, 8, 3)
    assert choose_tiles(128, bf16, interpret=False, wide=False) == MLATileConfig(64, 32, 8, 3)
    monkeypatch.setattr(launch, "WIDE_FP8", False)
    assert choose_tiles(128, bf16, interpret=False, kv_dtype=e5m2) == MLATileConfig(64, 64, 8, 2)
    assert choose_tiles(128, bf16, interpret=False, kv_dtype=e5m2, wide=True) == WIDE_FP8_VALUES_TILES
    assert choose_tiles(128, bf16, interpret=False) == WIDE_PRODUCER_TILES
    monkeypatch.setattr(launch, "WIDE", False)
    assert choose_tiles(128, bf16, interpret=False) == MLATileConfig(64, 32, 8, 3)


@pytest.mark.parametrize("given", [False, True], ids=["plan_chosen", "given"])
def test_the_plans_split_count_is_cut_to_one_program_an_sm_and_a_given_one_is_kept(given, monkeypatch):
    """Through ``mla_decode_forward`` (the Gluon kernel and the merge replaced: no GPU here), 32 heads over a bf16
    cache: a split count the plan chose (for the portable kernel's smaller blocks) runs at no more splits than fill
    each SM once with 64-head blocks, in the same workspace; a count given to the plan runs as given."""
    from portattn.mla import plan_mla_decode

    launched, merged = record_launches(monkeypatch, wide, compute_units=6)
    case = make_mla_case([300, 500], page_size=64, num_heads=32, rank=512, rope_dim=64, device="cpu")
    inputs = {**case.inputs(), "q_nope": case.q_nope.bfloat16(), "q_rope": case.q_rope.bfloat16()}
    kv = case.kv_cache.bfloat16()
    plan = plan_mla_decode(inputs["page_table"], inputs["seq_lens"], 64, num_heads=32, kv_lora_rank=512,
                           max_seqlen_k=500, num_kv_splits=8 if given else None)  # fmt: skip
    assert plan.num_kv_splits == 8 and plan.splits_chosen is not given  # (256 programs wanted; 500 keys: 8)
    out = torch.empty_like(inputs["q_nope"])
    mla_decode_forward(inputs["q_nope"], inputs["q_rope"], kv, inputs["page_table"], inputs["seq_lens"], out,
                       scale=0.1, num_kv_splits=plan.num_kv_splits, partials=plan.partials, tiles=WIDE_TILES,
                       min_split_keys=plan.min_split_keys, fewer_splits=plan.splits_chosen)  # fmt: skip
    ((grid, args, _),) = launched
    splits = 8 if given else 3  # 6 SMs over 2 sequences of one 64-head block
    assert grid == (1, splits, 2) and merged[0][6] == splits
    part_out, part_lse = args[7], args[8]
    assert part_out.shape == (2, 32, splits, 512) and part_lse.shape == (2, 32, splits)
    assert part_out.data_ptr() == plan.partials[0].data_ptr() and part_lse.data_ptr() == plan.partials[1].data_ptr()
    assert merged[0][0] is part_out and merged[0][1] is part_lse


@pytest.mark.skipif(not _runs_here(), reason="needs an NVIDIA GPU of compute capability 9.x (no Gluon interpreter)")
def test_fewer_splits_than_the_plan_chose_give_the_reference(monkeypatch):
    """On the GPU: 40 sequences of 32 heads over up to 1,100 keys, bf16: the plan chooses 7 splits, the launcher
    runs the wide kernel at no more than fill each SM once (3 on 132 SMs), and the output and LSE are the
    float64 reference's within the bf16 tolerance, as at the plan's 7 run as given."""
    from portattn.kernels.triton import mla_decode_launch
    from portattn.mla import plan_mla_decode

    grids = []
    real = wide.launch_arguments

    def spy(*args, **kwargs):
        launched = real(*args, **kwargs)
        grids.append(launched[0])
        return launched

    monkeypatch.setattr(wide, "launch_arguments", spy)
    lens = [1100 - 27 * i for i in range(40)]
    case = make_mla_case(lens, page_size=16, num_heads=32, rank=512, rope_dim=64, device="cuda", seed=45)
    inputs = {**case.inputs(), "q_nope": case.q_nope.bfloat16(), "q_rope": case.q_rope.bfloat16()}
    kv = case.kv_cache.bfloat16()
    ref, ref_lse = mla_decode_ref(**{**inputs, "kv_cache": kv.double()}, scale=0.07, return_lse=True)
    lowp = mla_decode_ref(**{**inputs, "kv_cache": kv}, scale=0.07, upcast=False)
    tol = tolerance(ref, lowp, torch.bfloat16)
    for given in (False, True):
        plan = plan_mla_decode(inputs["page_table"], inputs["seq_lens"], 16, num_heads=32, kv_lora_rank=512,
                               max_seqlen_k=max(lens), num_kv_splits=7 if given else None)  # fmt: skip
        assert plan.num_kv_splits == 7 and plan.splits_chosen is not given
        out = torch.full_like(inputs["q_nope"], float("nan"))
        lse = torch.full((40, 32), float("nan"), device="cuda")
        mla_decode_forward(inputs["q_nope"], inputs["q_rope"], kv, inputs["page_table"], inputs["seq_lens"], out,
                           scale=0.07, num_kv_splits=plan.num_kv_splits, partials=plan.partials, lse=lse,
                           min_split_keys=plan.min_split_keys, fewer_splits=plan.splits_chosen)  # fmt: skip
        sms = mla_decode_launch.compute_units(torch.device("cuda"))
        assert grids[-1] == (1, 7 if given else max(1, min(7, sms // 40)), 40)
        assert max_error(out, ref) <= tol, (given, max_error(out, ref), tol)
        assert max_error(lse, ref_lse) <= 1e-4 * float(ref_lse.abs().max()), given


def test_the_default_tiles_fit_hoppers_shared_memory():
    assert wide.shared_bytes(WIDE_TILES.block_n, WIDE_TILES.num_stages, fp8=False) <= HOPPER_SHARED
    assert wide.shared_bytes(WIDE_TILES.block_n, WIDE_TILES.num_stages, fp8=True) <= HOPPER_SHARED
    with pytest.raises(ValueError, match="expected 32 or 64 keys a step and at least 2 stages, got 128 and 2"):
        wide.constexprs(128, 2, False)


@pytest.mark.parametrize(
    "fields",
    [{"block_h": 32}, {"num_warps": 4}, {"block_n": 128}, {"num_stages": 1}, {"dequantize_once": True}],
)
def test_wide_tiles_outside_the_kernels_shape_are_refused(fields):
    """The kernel's shape is fixed (64 heads, eight warps, 32 or 64 keys): other tiles would be ignored."""
    base = {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2, "wide": True}
    with pytest.raises(ValueError, match="expected wide tiles of 64 heads, 8 warps"):
        MLATileConfig(**{**base, **fields})
