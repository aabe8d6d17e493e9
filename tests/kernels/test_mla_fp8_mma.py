"""MLA decode over an e4m3 latent cache through relabelled shared-memory views (``mla_decode_fp8_mma``).

On any machine: the labels are bit permutations, and every byte the copy writes is the byte each product's
view names (the views are linear layouts written down as bases; this walks every offset of a tile). Compiled
for sm_90 in a child process (Gluon has no interpreter): the key loop reads the tile only in 16-byte shared
loads, runs the expected MMAs and conversions, spills nothing, and the shared accesses are free of bank
conflicts by Gluon's own count. On an NVIDIA GPU of compute capability 8.9 or newer: results against the
float64 reference over the dequantised cache and against the portable kernel over the same cache, on the ops'
poisoned fixture (NaN in every slot no sequence owns, an out-of-range page id in each row's tail).
"""

from __future__ import annotations

import textwrap
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

from kernels.mla_checks import check_against_reference_and_portable, record_launches, run_compile_child
from ops.test_mla import make_mla_case
from portattn.device import is_triton_interpreter
from portattn.kernels.triton import mla_decode_fp8_mma as mma
from portattn.kernels.triton.mla_decode_launch import (
    FP8_MMA_32_HEAD_TILES,
    FP8_MMA_TILES,
    MLATileConfig,
    choose_tiles,
    fp8_mma_splits,
    mla_decode_forward,
    programs_an_sm,
)
from portattn.kv_quant import dequantize_kv, quantize_kv
from portattn.testing import max_error, mla_decode_ref, tolerance


def _coords(bases: list[list[int]], offset: int) -> tuple[int, ...]:
    """A linear layout's logical coordinates of ``offset``: the XOR of the bases of its set bits."""
    out = [0] * len(bases[0])
    for bit, basis in enumerate(bases):
        if offset >> bit & 1:
            out = [a ^ b for a, b in zip(out, basis)]
    return tuple(out)


@pytest.mark.parametrize("bits", [mma.QK_BITS, mma.PE_BITS, mma.PV_BITS])
def test_labels_are_bit_permutations(bits):
    assert sorted(bits) == list(range(len(bits)))
    size = 1 << len(bits)
    dims = [mma.relabel(label, bits) for label in range(size)]
    assert sorted(dims) == list(range(size))
    assert all(mma.label_of(d, bits) == label for label, d in enumerate(dims))


@pytest.mark.parametrize("bits, name", [(mma.QK_BITS[:7], "QK_AXES"), (mma.PE_BITS, "PE_AXES")])
def test_the_queries_permuted_in_registers_are_under_the_scores_labels(bits, name):
    """``COALESCED_IO``: a chunk of queries loaded in dim order, reshaped to one axis a bit, permuted by the
    kernel's order and reshaped back, holds at label ``j`` the dim the scores' view reads there."""
    import numpy as np

    size = 1 << len(bits)
    x = np.arange(16 * size).reshape(16, size)
    axes = mma.constexprs(64, 2)[name]
    y = x.reshape([16] + [2] * len(bits)).transpose(axes).reshape(16, size)
    assert (y == x[:, [mma.relabel(j, bits) for j in range(size)]]).all()
    assert mma.relabel(127, mma.QK_BITS) == 127 and all(b == i for i, b in enumerate(mma.QK_BITS) if i >= 7)


def test_the_output_permuted_in_registers_is_in_dim_order_32_floats_a_lane():
    """``COALESCED_IO``: the values' columns (labels) permuted back to dims by the kernel's order, and the
    store's layout (``OUT_IO``) is the MMA's output layout so permuted, its registers in dim order."""
    import numpy as np

    c = mma.constexprs(64, 2)
    labels = np.arange(512)
    dims = labels.reshape([1] + [2] * 9).transpose(c["PV_AXES"]).reshape(512)
    assert (dims == [mma.label_of(d, mma.PV_BITS) for d in range(512)]).all()
    # the MMA's [16, 512] output layout (m16n8 fragments, four warps along the columns, 16 repeats), its
    # columns (labels) mapped to dims: the same bases as OUT_IO's, the registers' in another order
    mma_layout = {"reg": [[0, 1], [8, 0], [0, 32], [0, 64], [0, 128], [0, 256]],
                  "lane": [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], "warp": [[0, 8], [0, 16]]}  # fmt: skip
    permuted = {k: [[r, mma.relabel(col, mma.PV_BITS)] for r, col in v] for k, v in mma_layout.items()}
    out_io = c["OUT_IO"]
    assert sorted(permuted["reg"]) == sorted(out_io.reg_bases)
    assert permuted["lane"] == out_io.lane_bases and permuted["warp"] == out_io.warp_bases
    assert out_io.reg_bases[:5] == [[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]]  # 32 contiguous floats a lane


@pytest.mark.parametrize("block_n", [32, 64])
def test_every_view_reads_the_byte_the_copy_wrote(block_n):
    physical, views = mma.physical_layouts(block_n), mma.shared_views(block_n)
    nat, qk, pv = physical["C_NAT"].offset_bases, views["C_QK"].offset_bases, views["C_PV"].offset_bases
    assert len(nat) == len(qk) == len(pv) == (512 * block_n).bit_length() - 1
    seen = set()
    for offset in range(512 * block_n):
        key, dim = _coords(nat, offset)
        assert mma.latent_offset(key, dim, block_n) == offset  # the copy writes (key, dim) here
        seen.add((key, dim))
        label, key_qk = _coords(qk, offset)
        assert (key_qk, mma.relabel(label, mma.QK_BITS)) == (key, dim)
        key_pv, column = _coords(pv, offset)
        assert (key_pv, mma.relabel(column, mma.PV_BITS)) == (key, dim)
    assert len(seen) == 512 * block_n
    pe_nat, pe_qk = physical["PE_NAT"].offset_bases, views["PE_QK"].offset_bases
    seen = set()
    for offset in range(64 * block_n):
        key, dim = _coords(pe_nat, offset)
        assert mma.rope_offset(key, dim) == offset
        seen.add((key, dim))
        label, key_qk = _coords(pe_qk, offset)
        assert (key_qk, mma.relabel(label, mma.PE_BITS)) == (key, dim)
    assert len(seen) == 64 * block_n


def test_a_lanes_scores_bytes_are_contiguous_and_its_pairs_fill_the_banks():
    """The m16n8k16 B fragment's lane (g, t) holds labels 2t, 2t + 1, 2t + 8, 2t + 9 of each 16-label step:
    under QK_BITS the step-pairs s, s + 1, s + 2, s + 3 (one 64-label group) are 16 contiguous dims, and the
    four lanes t of one key start in four different 16-byte bank groups, as do two adjacent keys."""
    for group in range(8):
        for t in range(4):
            labels = [64 * group + 16 * s + base for s in range(4) for base in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)]
            dims = sorted(mma.relabel(label, mma.QK_BITS) for label in labels)
            assert dims == list(range(dims[0], dims[0] + 16))
        for key in range(0, 8, 2):
            starts = {mma.latent_offset(k, mma.relabel(64 * group + 2 * t, mma.QK_BITS), 64) // 16 % 8
                      for t in range(4) for k in (key, key + 1)}  # fmt: skip
            assert len(starts) == 8


def _run_ptx(text: str, word: int) -> tuple[int, int]:
    """The integer unpacking's PTX (``mov``, ``prmt``, ``shr``, ``and``, ``or`` on .b32) run on one input word:
    ``($0, $1)``."""
    regs = {"$2": word}

    def value(operand: str) -> int:
        return int(operand, 0) if operand[0].isdigit() else regs[operand]

    body = text.strip()[1:-1]  # inside { }
    for statement in filter(None, (part.strip() for part in body.split(";"))):
        op, args = statement.split(None, 1)
        dst, *src = (a.strip() for a in args.split(","))
        if op == ".reg":
            continue
        if op == "mov.b32":
            regs[dst] = value(src[0])
        elif op == "prmt.b32":  # default mode: selector nibble i picks byte i of d from {b, a} (a: 0-3, b: 4-7)
            pool = value(src[0]) | value(src[1]) << 32
            regs[dst] = sum(((pool >> 8 * (value(src[2]) >> 4 * i & 7)) & 0xFF) << 8 * i for i in range(4))
        elif op == "shr.b32":
            regs[dst] = value(src[0]) >> value(src[1])
        elif op == "and.b32":
            regs[dst] = value(src[0]) & value(src[1])
        elif op == "or.b32":
            regs[dst] = value(src[0]) | value(src[1])
        else:
            raise AssertionError(f"an instruction this check does not run: {statement}")
    return regs["$0"], regs["$1"]


def _each_byte_in_each_place(text: str, seed: int):
    """``(place, byte, the 16-bit half it became)`` for every byte in each of a word's four places (the other
    three random), through the unpacking PTX ``text``."""
    generator = torch.Generator().manual_seed(seed)
    for place in range(4):
        others = torch.randint(0, 256, (256, 4), generator=generator)
        for byte in range(256):
            word_bytes = [int(b) for b in others[byte]]
            word_bytes[place] = byte
            lo, hi = _run_ptx(text, sum(b << 8 * i for i, b in enumerate(word_bytes)))
            yield place, byte, [lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16][place]


def test_integer_unpacking_is_the_conversion_times_a_power_of_two():
    """Every e4m3 byte, in each of a word's four places, unpacked by the integer instructions as written in the
    kernel: float16 bits of the byte's value times 2^-8, exactly (subnormals and signed zeros included), byte
    ``i`` in half ``i`` of the two outputs; the two NaN bytes give +-1.875 (documented)."""
    every = torch.arange(256, dtype=torch.uint8)
    expected = (every.view(torch.float8_e4m3fn).to(torch.float32) / mma.INT_UNPACK_SCALE.value).to(torch.float16)
    expected_bits = expected.view(torch.int16).to(torch.int32) & 0xFFFF
    nan = {0x7F: 0x3F80, 0xFF: 0xBF80}  # 1.875 * 2^-8 as float16, with the byte's sign
    for place, byte, half in _each_byte_in_each_place(mma.INT_UNPACK_E4M3.value, seed=0):
        want = nan.get(byte, int(expected_bits[byte]))
        assert half == want, (place, hex(byte), hex(half), hex(want))
    assert float(expected[0x38]) * mma.INT_UNPACK_SCALE.value == 1.0  # e4m3 0x38 is 1.0


def test_e5m2_unpacking_is_the_conversion():
    """Every e5m2 byte in each of a word's four places, through the kernel's two ``prmt``: the float16 bits of its
    value (e5m2 is float16's high byte: infinities and NaN included), byte ``i`` in half ``i``."""
    expected = torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2).to(torch.float16)
    for place, byte, half in _each_byte_in_each_place(mma.UNPACK_E5M2.value, seed=1):
        value = torch.tensor([half], dtype=torch.int32).to(torch.int16).view(torch.float16)
        if torch.isnan(expected[byte]):
            assert torch.isnan(value).item(), hex(byte)
        else:
            assert value.item() == expected[byte].item() and half == byte << 8, (place, hex(byte))


CHILD = textwrap.dedent(
    """
    import re, sys
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError as exc:
        print("no compiler:", exc); sys.exit(3)
    from kernels.mla_checks import key_loop
    from portattn.kernels.triton import mla_decode_fp8_mma as mma

    def compile_(fn, signature, constexprs, warps=mma.NUM_WARPS):
        sig = {**signature, **{name: "constexpr" for name in constexprs}}
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if sig[name].startswith("*") or name in ("stride_kv_page", "stride_kv_slot", "stride_qn_b",
                                                          "stride_qn_h", "stride_qr_b", "stride_qr_h")}
        src = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})

    fn = mma.mla_decode_fp8_mma_kernel
    ptrs = {"QNope": "*bf16", "QRope": "*bf16", "PageTable": "*i32", "SeqLensK": "*i32",
            "Out": "*bf16", "Lse": "*fp32", "PartOut": "*fp32", "PartLse": "*fp32"}
    for block_n, page_size, wgmma, alu, e5m2, ahead, coalesced, groups in (
            (64, 64, False, (0, 0), False, False, False, 1), (32, 16, False, (0, 0), False, False, False, 1),
            (64, 7, False, (0, 0), False, False, False, 1), (64, 64, True, (0, 0), False, False, False, 1),
            (64, 64, False, (0b01010, 0b1010), False, False, False, 1),
            (32, 64, False, (0b11111, 0b11), False, False, False, 1), (64, 64, False, (0, 0), True, False, False, 1),
            (32, 7, False, (0, 0), True, False, False, 1), (64, 64, False, (0, 0), False, True, False, 1),
            (64, 7, False, (0, 0), True, True, False, 1), (64, 64, False, (0, 0), False, False, True, 1),
            (32, 7, False, (0, 0), True, True, True, 1), (64, 64, False, (0, 0), False, False, True, 2),
            (64, 1, False, (0, 0), True, False, True, 2), (32, 7, False, (0, 0), False, True, True, 2),
            (64, 64, False, (0, 0), False, False, True, 4), (32, 7, False, (0, 0), True, False, True, 4),
            (64, 64, False, (0, 0), False, False, True, -2), (32, 7, False, (0, 0), True, False, True, -2)):
        ptrs["KV"] = "*fp8e5" if e5m2 else "*fp8e4nv"
        # (groups -2: two groups on four warps, group_regs)
        const = {**mma.constexprs(block_n, 2, wgmma, abs(groups), groups < 0), "PAGE_SIZE": page_size,
                 "WRITE_PARTIAL": True,
                 "WRITE_LSE": True, "MIN_SPLIT": 256, "ALU_QK": alu[0], "ALU_PV": alu[1], "E5M2": e5m2,
                 "PAGES_AHEAD": ahead, "COALESCED_IO": coalesced}
        sig = {name: ptrs.get(name) or ("fp32" if name in ("q_scale", "qk_scale_log2", "kv_scale") else "i32")
               for name in fn.arg_names if name not in const}
        ptx = compile_(fn, sig, const, const["WARPS"]).asm["ptx"]
        # the whole kernel's global accesses (outside the loop: the queries' loads, the partials' stores)
        io = {name: len(re.findall(rx, ptx)) for name, rx in (
            ("gld16", r"ld\\.global\\.b16"), ("gldv4", r"ld\\.global\\.v4\\.b32"),
            ("gst32", r"st\\.global\\.b32"), ("gstv4", r"st\\.global\\.v4\\.b32"))}
        text = key_loop(ptx)
        counts = {name: len(re.findall(rx, text)) for name, rx in (
            ("v4", r"ld\\.shared\\.v4\\.b32"), ("byte", r"ld\\.shared\\.(?:u8|b8|s8)"),
            ("mma", r"mma\\.sync\\.aligned\\.m16n8k16"), ("e4m3", r"cvt\\.rn\\.f16x2\\.e4m3x2"),
            ("wgmma", r"wgmma\\.mma_async\\.sync\\.aligned\\.m64n16k32\\.f32\\.e4m3\\.e4m3"),
            ("local", r"\\b(?:ld|st)\\.local"), ("barriers", r"\\bbar\\.sync"), ("copies", r"cp\\.async\\.cg"),
            ("prmt_zero", r"prmt\\.b32 \\S+, \\S+, \\S+, 0x[13]4[0-9a-fA-F]4;"))}
        print("kernel", block_n, page_size, "wgmma" if wgmma else "mma", f"alu_qk={alu[0]}", f"alu_pv={alu[1]}",
              f"e5m2={int(e5m2)}", f"ahead={int(ahead)}", f"coalesced={int(coalesced)}", f"groups={groups}",
              " ".join(f"{k}={v}" for k, v in {**counts, **io}.items()))

    # the tiles' physical layout is Triton's NVMMASharedLayout (Triton 3.6's binding cannot print it)
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7):
        from triton._C.libtriton import ir
        from triton._C.libtriton.gluon_ir import GluonOpBuilder
        context = ir.context()
        ir.load_dialects(context)
        builder = GluonOpBuilder(context)
        for block_n in (32, 64):
            c = mma.constexprs(block_n, 2)
            for name, width in (("C_NAT", 512), ("PE_NAT", 64)):
                nvmma = builder.to_linear_layout(c[name]._to_ir(builder), [block_n, width]).offset_bases
                print("nvmma", name, block_n, nvmma == mma.physical_layouts(block_n)[name].offset_bases)

    @gluon.jit
    def conflicts(X, C_COPY: gl.constexpr, C_NAT: gl.constexpr, C_QK: gl.constexpr, PV_LOAD: gl.constexpr,
                  PV_16: gl.constexpr, PE_COPY: gl.constexpr, PE_NAT: gl.constexpr, PE_QK: gl.constexpr,
                  MMA: gl.constexpr, BLOCK_N: gl.constexpr):
        B: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
        gl.static_print("conflicts copy", gl.bank_conflicts(gl.distributed_type(gl.float8e4nv, [BLOCK_N, 512], C_COPY),
                        gl.shared_memory_descriptor_type(gl.float8e4nv, [BLOCK_N, 512], C_NAT, [BLOCK_N, 512])))
        gl.static_print("conflicts scores", gl.bank_conflicts(gl.distributed_type(gl.float8e4nv, [512, BLOCK_N], B),
                        gl.shared_memory_descriptor_type(gl.float8e4nv, [512, BLOCK_N], C_QK, [512, BLOCK_N])))
        gl.static_print("conflicts values", gl.bank_conflicts(gl.distributed_type(gl.float8e4nv, [16, 512], PV_LOAD),
                        gl.shared_memory_descriptor_type(gl.float8e4nv, [16, 512], PV_16, [16, 512])))
        gl.static_print("conflicts rope copy",
                        gl.bank_conflicts(gl.distributed_type(gl.float8e4nv, [BLOCK_N, 64], PE_COPY),
                        gl.shared_memory_descriptor_type(gl.float8e4nv, [BLOCK_N, 64], PE_NAT, [BLOCK_N, 64])))
        gl.static_print("conflicts rope scores", gl.bank_conflicts(gl.distributed_type(gl.float8e4nv, [64, BLOCK_N], B),
                        gl.shared_memory_descriptor_type(gl.float8e4nv, [64, BLOCK_N], PE_QK, [64, BLOCK_N])))

    # as a launch binds them: the runtime's binder and packing over real (CPU) tensors, then the compile
    from kernels.mla_checks import compile_as_launched
    grid, kv, q_scale, shared = compile_as_launched(mma, 5, mma.mla_decode_fp8_mma_kernel)
    print("launched", *grid, kv, q_scale, shared, flush=True)

    for block_n in (32, 64):
        const = {**mma.constexprs(block_n, 2), "PV_16": mma.shared_views(16)["C_PV"]}
        const = {name: const[name] for name in conflicts.arg_names if name != "X"}
        print("block", block_n, flush=True)
        compile_(conflicts, {"X": "*i32"}, const)
    """
)


def test_the_kernel_compiles_for_hopper_with_16_byte_loads_and_no_bank_conflicts(tmp_path):
    lines = run_compile_child(tmp_path, CHILD, "compile_mla_fp8_mma", timeout=300)
    kernels = [line.split() for line in lines if line.startswith("kernel ")]
    assert len(kernels) == 19
    for _, block_n, page_size, scores, *fields in kernels:
        counts = {k: int(v) for k, v in (field.split("=") for field in fields)}
        keys = int(block_n)
        # bytes unpacked by integer instructions (a chunk of 128 latent dims: 32 pairs a lane and 64 keys; the
        # rope's 16; a 16-key value step's 32): two prmt with zeros a word of four, instead of two cvt
        alu = (sum((32, 32, 32, 32, 16)[c] for c in range(5) if counts["alu_qk"] >> c & 1) * keys // 64
               + 32 * bin(counts["alu_pv"]).count("1"))  # fmt: skip
        if counts["e5m2"]:  # every pair by a prmt, none by cvt
            alu = 272 * keys // 64
        assert counts["prmt_zero"] == alu, (block_n, counts)
        # A warp's share of a 64-key step (for 32 keys, half): MMAs 4 x 8 x 2 (scores) + 4 x 2 (rope) + 4 x 16
        # (values); 16-byte loads 4 x 2 x 2 (scores: 2 keys, 32 bytes each per 128 labels) + 2 (rope) + 4 x 4
        # (values: 4 keys of 16 bytes per 16 keys), and 2 of the four warps' row maxima; conversions of byte
        # pairs 256 / 2 + 32 / 2 + 256 / 2. With the scores by the warpgroup MMA: its 2 x (16 + 2) e4m3 steps
        # (the queries' two parts), and the values' loads, MMAs and conversions alone. Barriers: the step's, the
        # row maximum's, the probabilities' and (Triton 3.6, which does not tell the buffers apart) one between
        # the next tile's copy and this tile's reads.
        if scores == "wgmma":
            expected = {"v4": 16, "mma": 64, "e4m3": 128, "wgmma": 36}
        elif counts["groups"] < 0:  # two groups on four warps: each fragment converted once for both groups' MMAs
            expected = {"v4": 34 * keys // 64 + 4, "mma": 272 * keys // 64, "e4m3": 272 * keys // 64 - alu, "wgmma": 0}
        else:
            expected = {"v4": 34 * keys // 64 + 2, "mma": 136 * keys // 64, "e4m3": 272 * keys // 64 - alu, "wgmma": 0}
        expected |= {"byte": 0, "local": 0}
        assert {k: counts[k] for k in expected} == expected, (block_n, page_size, scores, counts)
        # Two or four head groups (32 heads on eight warps, 64 on sixteen): each warp's share as with one, the
        # tile's copy split over the warps (64 keys: 16 latent and 2 rope copies of 16 bytes a lane; 8 and 1 with
        # eight warps; 4 and 1 with sixteen, the rope's 4 KB being less than one copy of 16 bytes a lane)
        if keys == 64 and scores != "wgmma":
            warp_groups = max(counts["groups"], 1)
            assert counts["copies"] == 16 // warp_groups + -(-2 // warp_groups), (block_n, page_size, counts)
        # (with the warpgroup MMA, Triton 3.6 puts one more after the copies' proxy fence)
        assert counts["barriers"] <= (5 if scores == "wgmma" else 4), (block_n, page_size, scores, counts)
        # Outside the loop: by default every warp loads all 16 x 576 queries two bytes a lane (288 loads a
        # lane) and each lane stores its 64 output floats one at a time (with the 2 LSE stores); with
        # COALESCED_IO, 16 bytes a lane: 9 loads (8 x 16 bytes of 128 dims for 8 heads, twice, four chunks;
        # one of the rope) and 16 stores (64 floats), besides the 3 loads and 2 stores of scalars
        if scores == "wgmma":
            continue
        if counts["coalesced"]:  # (two groups on four warps: each lane loads and stores twice as much)
            per_lane = 2 if counts["groups"] < 0 else 1
            assert {k: counts[k] for k in ("gld16", "gldv4", "gst32", "gstv4")} == {
                "gld16": 0, "gldv4": 9 * per_lane, "gst32": 2 * per_lane, "gstv4": 16 * per_lane}, counts  # fmt: skip
        else:
            assert (counts["gld16"], counts["gst32"], counts["gstv4"]) == (288, 66, 0), counts
    nvmma = [line.split() for line in lines if line.startswith("nvmma ")]
    assert all(line[-1] == "True" for line in nvmma), nvmma  # (absent under Triton 3.6)
    launched = [line.split() for line in lines if line.startswith("launched ")]
    assert launched and launched[0][-3:-1] == ["*fp8e4nv", "fp32"], lines
    text = "\n".join(lines)
    assert text.count("conflicts") == 10
    assert all(line.endswith(" 0") for line in lines if line.startswith("conflicts")), text


def _runs_here() -> bool:
    return torch.cuda.is_available() and not is_triton_interpreter() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _runs_here(), reason="needs an NVIDIA GPU of compute capability 8.9+ (no Gluon interpreter)")
@pytest.mark.parametrize("page_size", [64, 16, 7, 1])  # whole tiles in a page; several pages a tile
@pytest.mark.parametrize("block_n", [64, 32])
@pytest.mark.parametrize("num_heads", [16, 5, 40])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_against_the_reference_and_the_portable_kernel(page_size, block_n, num_heads, kv_dtype):
    """Both forms (e4m3 by ``cvt``; e5m2 by ``prmt`` alone), bf16 and fp16 queries."""
    lens = [1, max(page_size - 1, 1), page_size, page_size + 1, 63, 64, 65, 300, 0]
    case = make_mla_case(lens, page_size=page_size, num_heads=num_heads, rank=512, rope_dim=64, device="cuda",
                         seed=page_size + block_n)  # fmt: skip
    scale, kv_scale = 0.07, 0.0625
    kv_cache = quantize_kv(case.kv_cache, kv_dtype, kv_scale)
    tiles = MLATileConfig(block_h=16, block_n=block_n, num_warps=4, num_stages=2, fp8_mma=True)
    for dtype in (torch.bfloat16, torch.float16):
        queries = {"q_nope": case.q_nope.to(dtype), "q_rope": case.q_rope.to(dtype)}
        inputs = {**case.inputs(), "kv_cache": kv_cache, **queries}
        dequantised = {**inputs, "kv_cache": dequantize_kv(kv_cache, kv_scale, torch.float64)}
        ref, ref_lse = mla_decode_ref(**dequantised, scale=scale, return_lse=True)
        lowp = mla_decode_ref(**dequantised, scale=scale, upcast=False)
        check_against_reference_and_portable(inputs, tiles, scale=scale, kv_scale=kv_scale, ref=ref, ref_lse=ref_lse,
                                             tol=tolerance(ref, lowp, dtype), lse_rel_tol=1e-4)  # fmt: skip


def test_two_or_four_head_groups_share_the_columns_and_split_the_heads():
    """``head_groups=2`` (32 heads on eight warps): the MMA's third warp bit picks the heads 16-31, the values'
    fragments are the same for both groups (a zero warp basis), and the row maxima and the output's store
    layouts cover 32 heads; four groups take the fourth warp bit for heads 32-63; the warpgroup-MMA scores take one
    group only."""
    one, two = mma.constexprs(64, 2), mma.constexprs(64, 2, head_groups=2)
    assert (one["BLOCK_H"], one["WARPS"], two["BLOCK_H"], two["WARPS"]) == (16, 4, 32, 8) and mma.warps(2) == 8
    assert two["PV_LOAD"].warp_bases == [*one["PV_LOAD"].warp_bases, [0, 0]]
    for name, shape in (("ROWS_4", [32, 4]), ("OUT_IO", [32, 512])):
        assert two[name].warp_bases == [*one[name].warp_bases, [16, 0]] and list(two[name].shape) == shape
        assert two[name].reg_bases == one[name].reg_bases and two[name].lane_bases == one[name].lane_bases
    with pytest.raises(ValueError, match="expected one head group with wgmma, got 2"):
        mma.constexprs(64, 2, True, 2)
    four = mma.constexprs(64, 2, head_groups=4)
    assert (four["BLOCK_H"], four["WARPS"], mma.warps(4)) == (64, 16, 16)
    assert four["PV_LOAD"].warp_bases == [*one["PV_LOAD"].warp_bases, [0, 0], [0, 0]]
    for name, shape in (("ROWS_4", [64, 4]), ("OUT_IO", [64, 512])):
        assert four[name].warp_bases == [*one[name].warp_bases, [16, 0], [32, 0]] and list(four[name].shape) == shape
    with pytest.raises(ValueError, match="1, 2 or 4 head groups, got 64, 2 and 3"):
        mma.constexprs(64, 2, False, 3)
    # two groups on four warps (group_regs): the heads 16-31 a register bit, the warps' bits as with one group
    regs = mma.constexprs(64, 2, head_groups=2, group_regs=True)
    assert (regs["BLOCK_H"], regs["WARPS"], mma.warps(2, True)) == (32, 4, 4)
    assert regs["PV_LOAD"].warp_bases == one["PV_LOAD"].warp_bases
    for name in ("ROWS_4", "OUT_IO"):
        assert regs[name].warp_bases == one[name].warp_bases and regs[name].reg_bases == [*one[name].reg_bases, [16, 0]]
    with pytest.raises(ValueError, match="expected two head groups with group_regs, got 4"):
        mma.constexprs(64, 2, False, 4, True)


@pytest.mark.skipif(not _runs_here(), reason="needs an NVIDIA GPU of compute capability 8.9+ (no Gluon interpreter)")
@pytest.mark.parametrize("page_size", [64, 7, 1])
@pytest.mark.parametrize("block_h, warps, block_n, num_heads", [
    (32, 8, 64, 32), (32, 8, 64, 17), (32, 8, 32, 40), (64, 16, 64, 64), (64, 16, 32, 40), (64, 16, 64, 128),
    (32, 4, 64, 32), (32, 4, 32, 17), (32, 4, 32, 40)])  # fmt: skip
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_32_and_64_head_blocks_against_the_reference_and_the_portable_kernel(page_size, block_h, warps, block_n,
                                                                           num_heads, kv_dtype):  # fmt: skip
    """Two or four 16-head groups a program over one copy of each tile (eight or sixteen warps; two groups on four
    warps: ``group_regs``): one full block, a partial one (17, 40 in 64), a full and a partial one (40 in 32), two
    full ones (128), bf16 and fp16 queries, the same checks as 16-head blocks."""
    lens = [1, max(page_size - 1, 1), page_size, page_size + 1, 63, 64, 65, 300, 0]
    case = make_mla_case(lens, page_size=page_size, num_heads=num_heads, rank=512, rope_dim=64, device="cuda",
                         seed=page_size + num_heads)  # fmt: skip
    scale, kv_scale = 0.07, 0.0625
    kv_cache = quantize_kv(case.kv_cache, kv_dtype, kv_scale)
    dequantised = dequantize_kv(kv_cache, kv_scale, torch.float64)
    tiles = MLATileConfig(block_h, block_n, warps, 2, fp8_mma=True, coalesced_io=True)
    for dtype in (torch.bfloat16, torch.float16):
        inputs = {
            **case.inputs(),
            "kv_cache": kv_cache,
            "q_nope": case.q_nope.to(dtype),
            "q_rope": case.q_rope.to(dtype),
        }
        ref, ref_lse = mla_decode_ref(**{**inputs, "kv_cache": dequantised}, scale=scale, return_lse=True)
        lowp = mla_decode_ref(**{**inputs, "kv_cache": dequantised}, scale=scale, upcast=False)
        check_against_reference_and_portable(inputs, tiles, scale=scale, kv_scale=kv_scale, ref=ref, ref_lse=ref_lse,
                                             tol=tolerance(ref, lowp, dtype), lse_rel_tol=1e-4)  # fmt: skip


def test_one_program_an_sm_by_split_count():
    # B=64 sequences of 16 heads on 132 SMs: 2 splits, not the plan's 4 (measured on an H100); never more than given
    assert [fp8_mma_splits(4, 64, 132), fp8_mma_splits(3, 64, 132), fp8_mma_splits(4, 256, 132)] == [2, 2, 1]
    assert [fp8_mma_splits(64, 1, 132), fp8_mma_splits(64, 4, 132), fp8_mma_splits(1, 64, 132)] == [64, 33, 1]


@pytest.mark.parametrize("tiles, splits", [(FP8_MMA_TILES, 1), (FP8_MMA_32_HEAD_TILES, 4)], ids=["16_head", "32_head"])
def test_32_head_blocks_on_four_warps_are_cut_to_two_programs_an_sm(tiles, splits, monkeypatch):
    """Through ``mla_decode_forward`` (the Gluon kernel and the merge replaced: no GPU here): 2 sequences of 32 heads
    on 4 SMs at the plan's 8 splits run 16-head blocks (4 programs a split) at 1 split, one program an SM, and
    32-head blocks on four warps (2 a split, 254 registers a thread) at 4, two programs an SM."""
    from portattn.mla import plan_mla_decode

    assert [programs_an_sm(FP8_MMA_TILES), programs_an_sm(FP8_MMA_32_HEAD_TILES)] == [1, 2]
    assert programs_an_sm(replace(FP8_MMA_32_HEAD_TILES, num_warps=8)) == 1  # each warp one group's work
    launched, merged = record_launches(monkeypatch, mma, compute_units=4)
    case = make_mla_case([300, 500], page_size=64, num_heads=32, rank=512, rope_dim=64, device="cpu")
    kv = quantize_kv(case.kv_cache, torch.float8_e4m3fn, 0.5)
    inputs = case.inputs()
    plan = plan_mla_decode(inputs["page_table"], inputs["seq_lens"], 64, num_heads=32, kv_lora_rank=512,
                           max_seqlen_k=500)  # fmt: skip
    assert plan.num_kv_splits == 8 and plan.splits_chosen
    mla_decode_forward(inputs["q_nope"], inputs["q_rope"], kv, inputs["page_table"], inputs["seq_lens"],
                       torch.empty_like(case.q_nope), scale=0.1, num_kv_splits=plan.num_kv_splits,
                       partials=plan.partials, tiles=tiles, kv_scale=0.5, min_split_keys=plan.min_split_keys,
                       fewer_splits=True)  # fmt: skip
    ((grid, args, _),) = launched
    assert grid[1] == splits and args[13] == splits
    assert [m[6] for m in merged] == ([] if splits == 1 else [splits])  # no merge of one split
    assert grid[0] == 32 // tiles.block_h


@pytest.mark.parametrize("batch, head_blocks", [(15, 2), (16, 1)])
def test_by_default_32_heads_of_enough_sequences_take_one_32_head_block(batch, head_blocks, monkeypatch):
    """Through ``mla_decode_forward`` with its own tiles (the Gluon kernel replaced: no GPU here; the wide kernel's
    fp8 forms, the default from ``WIDE_FP8_MIN_BATCH`` sequences, declined): 32 heads of fewer than
    ``FP8_MMA_32_HEAD_MIN_BATCH`` sequences run in two 16-head blocks, of more in one 32-head block; both on four
    warps."""
    from portattn.kernels.triton import mla_decode_launch

    monkeypatch.setattr(mla_decode_launch, "WIDE_FP8_SCORES", False)
    launched, _ = record_launches(monkeypatch, mma, compute_units=132)
    monkeypatch.setattr(mla_decode_launch, "is_triton_interpreter", lambda: False)
    case = make_mla_case([5] * batch, page_size=16, num_heads=32, rank=512, rope_dim=64, device="cpu")
    kv = quantize_kv(case.kv_cache, torch.float8_e4m3fn, 0.5)
    inputs = case.inputs()
    mla_decode_forward(inputs["q_nope"].to(torch.bfloat16), inputs["q_rope"].to(torch.bfloat16), kv,
                       inputs["page_table"], inputs["seq_lens"], torch.empty_like(case.q_nope, dtype=torch.bfloat16),
                       scale=0.1, num_kv_splits=1, kv_scale=0.5)  # fmt: skip
    ((grid, _, kwargs),) = launched
    assert (grid[0], grid[2], kwargs["num_warps"], kwargs["BLOCK_H"]) == (head_blocks, batch, 4, 32 // head_blocks)


def test_where_the_wide_kernel_cannot_run_17_to_32_heads_fall_back_to_this_kernel(monkeypatch):
    """24 heads of 16 sequences over e4m3 (the rules' choice: the wide kernel's fp8-scores form) on a GPU without
    the warpgroup MMA (compute capability 8.9, where this kernel runs): the launcher takes this kernel's 32-head
    tiles, not the portable kernel's."""
    from portattn.kernels.triton import mla_decode_launch

    launched, _ = record_launches(monkeypatch, mma, compute_units=132)
    hopper = ("compute capability 9.x (the warpgroup MMA)", (8, 9))
    monkeypatch.setattr(mla_decode_launch, "gluon_lacks", lambda tiles, *args: hopper if tiles.wide else None)
    monkeypatch.setattr(mla_decode_launch, "is_triton_interpreter", lambda: False)
    chosen, real_choose = [], mla_decode_launch.choose_tiles

    def choose(*args, **kwargs):
        chosen.append(real_choose(*args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(mla_decode_launch, "choose_tiles", choose)
    case = make_mla_case([5] * 16, page_size=16, num_heads=24, rank=512, rope_dim=64, device="cpu")
    kv = quantize_kv(case.kv_cache, torch.float8_e4m3fn, 0.5)
    inputs = case.inputs()
    mla_decode_forward(inputs["q_nope"].to(torch.bfloat16), inputs["q_rope"].to(torch.bfloat16), kv,
                       inputs["page_table"], inputs["seq_lens"], torch.empty_like(case.q_nope, dtype=torch.bfloat16),
                       scale=0.1, num_kv_splits=1, kv_scale=0.5)  # fmt: skip
    assert chosen == [mla_decode_launch.WIDE_FP8_SCORES_TILES, FP8_MMA_32_HEAD_TILES]
    ((grid, _, kwargs),) = launched
    assert (grid[0], grid[2], kwargs["BLOCK_H"]) == (1, 16, 32)  # one 32-head block a sequence


@pytest.mark.skipif(not _runs_here(), reason="needs an NVIDIA GPU of compute capability 8.9+ (no Gluon interpreter)")
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_the_default_tiles_of_24_heads_over_40_sequences_give_the_reference(kv_dtype, monkeypatch):
    """The launcher's own tiles (one 32-head block: 40 sequences) at the plan's split count, cut to fill each SM
    once, against the float64 reference; the kernel's launch is watched, so a fallback to other tiles fails. (The
    wide kernel's fp8 forms, the default from ``WIDE_FP8_MIN_BATCH`` sequences, declined.)"""
    from portattn.kernels.triton import mla_decode_launch
    from portattn.mla import plan_mla_decode

    monkeypatch.setattr(mla_decode_launch, "WIDE_FP8_SCORES", False)

    launched, real_launch = [], mma.launch
    monkeypatch.setattr(mma, "launch", lambda *a, **k: (launched.append(k), real_launch(*a, **k)))

    lens = [1, 63, 64, 65, 300, 1000, 7, 0] * 5
    case = make_mla_case(lens, page_size=16, num_heads=24, rank=512, rope_dim=64, device="cuda", seed=24)
    kv_cache = quantize_kv(case.kv_cache, kv_dtype, 0.0625)
    inputs = {**case.inputs(), "kv_cache": kv_cache}
    inputs |= {"q_nope": case.q_nope.to(torch.bfloat16), "q_rope": case.q_rope.to(torch.bfloat16)}
    dequantised = {**inputs, "kv_cache": dequantize_kv(kv_cache, 0.0625, torch.float64)}
    ref = mla_decode_ref(**dequantised, scale=0.07)
    tol = tolerance(ref, mla_decode_ref(**dequantised, scale=0.07, upcast=False), torch.bfloat16)
    plan = plan_mla_decode(inputs["page_table"], inputs["seq_lens"], 16, num_heads=24, kv_lora_rank=512,
                           max_seqlen_k=1000)  # fmt: skip
    assert choose_tiles(24, torch.bfloat16, interpret=False, kv_dtype=kv_dtype, batch=40) == FP8_MMA_32_HEAD_TILES
    out = torch.full_like(inputs["q_nope"], float("nan"))
    mla_decode_forward(*(inputs[k] for k in ("q_nope", "q_rope", "kv_cache", "page_table", "seq_lens")), out,
                       scale=0.07, num_kv_splits=plan.num_kv_splits, partials=plan.partials, kv_scale=0.0625,
                       min_split_keys=plan.min_split_keys, fewer_splits=plan.splits_chosen)  # fmt: skip
    assert [(k["head_groups"], k["group_regs"]) for k in launched] == [(2, True)]
    err = max_error(out, ref)
    assert err <= tol, f"max error {err:.3e} > tolerance {tol:.3e}"


@pytest.mark.parametrize("given, strided", [(False, False), (True, False), (False, True)],
                         ids=["plan_chosen", "given", "strided_partials"])  # fmt: skip
def test_the_plans_split_count_is_cut_to_one_program_an_sm_and_a_given_one_is_kept(given, strided, monkeypatch):
    """Through ``mla_decode_forward`` (the Gluon kernel and the merge replaced: no GPU here): a split count the plan
    chose runs at ``fp8_mma_splits`` of it, in the same workspace (the partials' first rows, the merge told the
    same count); a count given to the plan runs as given; strided partials (which the kernels would index as
    contiguous) are refused."""
    from portattn.mla import plan_mla_decode

    launched, merged = record_launches(monkeypatch, mma, compute_units=8)
    case = make_mla_case([300, 500], page_size=64, num_heads=16, rank=512, rope_dim=64, device="cpu")
    kv = quantize_kv(case.kv_cache, torch.float8_e4m3fn, 0.5)
    inputs = case.inputs()
    plan = plan_mla_decode(inputs["page_table"], inputs["seq_lens"], 64, num_heads=16, kv_lora_rank=512,
                           max_seqlen_k=500, num_kv_splits=8 if given else None)  # fmt: skip
    assert plan.num_kv_splits == 8 and plan.splits_chosen is not given  # (256 programs wanted; 500 keys: 8)
    partials = plan.partials
    if strided:
        partials = (torch.empty(2, 16, 16, 512)[:, :, ::2], torch.empty(2, 16, 16)[:, :, ::2])
    out = torch.empty_like(case.q_nope)

    def decode():
        mla_decode_forward(inputs["q_nope"], inputs["q_rope"], kv, inputs["page_table"], inputs["seq_lens"], out,
                           scale=0.1, num_kv_splits=plan.num_kv_splits, partials=partials, tiles=FP8_MMA_TILES,
                           kv_scale=0.5, min_split_keys=plan.min_split_keys,
                           fewer_splits=plan.splits_chosen)  # fmt: skip

    if strided:
        with pytest.raises(ValueError, match=r"expected contiguous partials .* got strides \(131072, 8192, 1024, 1\)"):
            decode()
        assert launched == []
        return
    decode()
    ((grid, args, _),) = launched
    splits = 8 if given else 4  # 8 SMs over 2 sequences of one 16-head block
    assert grid[1] == splits and args[13] == splits and merged[0][6] == splits
    part_out, part_lse = args[7], args[8]
    assert part_out.shape == (2, 16, splits, 512) and part_lse.shape == (2, 16, splits)
    assert part_out.data_ptr() == partials[0].data_ptr() and part_lse.data_ptr() == partials[1].data_ptr()
    assert merged[0][0] is part_out and merged[0][1] is part_lse


@pytest.mark.skipif(not _runs_here(), reason="needs an NVIDIA GPU of compute capability 8.9+ (no Gluon interpreter)")
@pytest.mark.parametrize("coalesced_io", [False, True], ids=["two_byte_io", "coalesced_io"])
def test_the_plans_split_count_cut_to_one_program_an_sm_against_the_reference(coalesced_io, monkeypatch):
    """The cut split count on the GPU (the device's SMs taken as 6, so that 3 sequences' plan of several splits
    is cut to 2): the kernel writes the fewer splits' partials in the front of the plan's workspace and the merge
    reads them there; the output against the float64 reference over the dequantised cache."""
    from portattn.kernels.triton import mla_decode_launch
    from portattn.mla import plan_mla_decode

    monkeypatch.setattr(mla_decode_launch, "compute_units", lambda device: 6)
    case = make_mla_case([700, 64, 1500], page_size=64, num_heads=16, rank=512, rope_dim=64, device="cuda", seed=9)
    scale, kv_scale = 0.07, 0.0625
    kv = quantize_kv(case.kv_cache, torch.float8_e4m3fn, kv_scale)
    inputs = {**case.inputs(), "kv_cache": kv, "q_nope": case.q_nope.bfloat16(), "q_rope": case.q_rope.bfloat16()}
    plan = plan_mla_decode(inputs["page_table"], inputs["seq_lens"], 64, num_heads=16, kv_lora_rank=512,
                           max_seqlen_k=1500)  # fmt: skip
    assert plan.splits_chosen and plan.num_kv_splits > 2, plan.num_kv_splits
    launched = []
    real_launch = mma.launch
    monkeypatch.setattr(mma, "launch", lambda *a, **k: (launched.append(k["num_kv_splits"]), real_launch(*a, **k)))
    out = torch.full_like(inputs["q_nope"], float("nan"))
    tiles = MLATileConfig(16, 64, 4, 2, fp8_mma=True, coalesced_io=coalesced_io)
    mla_decode_forward(inputs["q_nope"], inputs["q_rope"], kv, inputs["page_table"], inputs["seq_lens"], out,
                       scale=scale, num_kv_splits=plan.num_kv_splits, partials=plan.partials, tiles=tiles,
                       kv_scale=kv_scale, min_split_keys=plan.min_split_keys, fewer_splits=True)  # fmt: skip
    assert launched == [2]
    dequantised = {**inputs, "kv_cache": dequantize_kv(kv, kv_scale, torch.float64)}
    ref = mla_decode_ref(**dequantised, scale=scale)
    lowp = mla_decode_ref(**dequantised, scale=scale, upcast=False)
    err = float((out.double() - ref).abs().max())
    assert err <= tolerance(ref, lowp, torch.bfloat16), err


@pytest.mark.parametrize("given", [None, 3])
def test_the_triton_backend_passes_whether_the_plan_chose_the_split_count(given, monkeypatch):
    from portattn.backends import triton as triton_backend
    from portattn.mla import plan_mla_decode

    seen = {}
    monkeypatch.setattr(triton_backend, "mla_decode_forward", lambda *args, **kwargs: seen.update(kwargs))
    case = make_mla_case([300], page_size=64, num_heads=16, rank=512, rope_dim=64, device="cpu")
    inputs = case.inputs()
    plan = plan_mla_decode(inputs["page_table"], inputs["seq_lens"], 64, num_heads=16, kv_lora_rank=512,
                           max_seqlen_k=300, num_kv_splits=given)  # fmt: skip
    out = torch.empty_like(case.q_nope)
    triton_backend.TritonBackend().mla_decode(inputs["q_nope"], inputs["q_rope"], inputs["kv_cache"], plan, 0.1, out)
    assert seen["fewer_splits"] is (given is None) and seen["num_kv_splits"] == plan.num_kv_splits


@pytest.mark.skipif(not _runs_here(), reason="needs an NVIDIA GPU of compute capability 8.9+ (no Gluon interpreter)")
@pytest.mark.parametrize(
    "block_n, fields",
    [(64, {"alu_values": 0b1111}), (64, {"alu_scores": 0b01010, "alu_values": 0b1010}),
     (64, {"alu_scores": 0b11111, "alu_values": 0b1111}), (32, {"alu_scores": 0b10101, "alu_values": 0b01}),
     (64, {"pages_ahead": True}), (32, {"pages_ahead": True, "num_stages": 3}), (64, {"coalesced_io": False}),
     (32, {"coalesced_io": True, "pages_ahead": True})],
    ids=["alu_values", "alu_half", "alu_all", "alu_32", "pages_ahead", "pages_ahead_32x3", "two_byte_io",
         "coalesced_io_32_ahead"],
)  # fmt: skip
@pytest.mark.parametrize("page_size", [64, 7, 1])
def test_tile_variants_against_the_reference_and_the_portable_kernel(block_n, fields, page_size):
    """Some or all of the tile's bytes unpacked by integer instructions (the scores' chunks summed apart and
    scaled back, the probabilities of those keys scaled up), or each copy's page ids loaded an iteration ahead
    (the last loads past the sequence, masked): the same checks as the default form."""
    lens = [1, page_size, page_size + 1, 65, 300, 0]
    case = make_mla_case(lens, page_size=page_size, num_heads=40, rank=512, rope_dim=64, device="cuda",
                         seed=len(fields) + page_size)  # fmt: skip
    scale, kv_scale = 0.07, 0.0625
    kv_cache = quantize_kv(case.kv_cache, torch.float8_e4m3fn, kv_scale)
    tiles = MLATileConfig(**{"block_h": 16, "block_n": block_n, "num_warps": 4, "num_stages": 2, "fp8_mma": True,
                             **fields})  # fmt: skip
    queries = {"q_nope": case.q_nope.to(torch.bfloat16), "q_rope": case.q_rope.to(torch.bfloat16)}
    inputs = {**case.inputs(), "kv_cache": kv_cache, **queries}
    dequantised = {**inputs, "kv_cache": dequantize_kv(kv_cache, kv_scale, torch.float64)}
    ref, ref_lse = mla_decode_ref(**dequantised, scale=scale, return_lse=True)
    lowp = mla_decode_ref(**dequantised, scale=scale, upcast=False)
    check_against_reference_and_portable(inputs, tiles, scale=scale, kv_scale=kv_scale, ref=ref, ref_lse=ref_lse,
                                         tol=tolerance(ref, lowp, torch.bfloat16), lse_rel_tol=1e-4)  # fmt: skip


def test_explicit_mma_tiles_name_what_they_need_here():
    """Asked for where it cannot run (this machine: no GPU, or an interpreter), the launcher says what it needs."""
    if _runs_here():
        pytest.skip("the kernel runs here")
    case = make_mla_case([3], page_size=4, num_heads=2, rank=512, rope_dim=64, device="cpu")
    kv = quantize_kv(case.kv_cache, torch.float8_e4m3fn, 0.5)
    inputs = case.inputs()
    out = torch.empty_like(case.q_nope)
    args = (inputs["q_nope"], inputs["q_rope"], kv, inputs["page_table"], inputs["seq_lens"], out)
    with pytest.raises(ValueError, match=r"expected (a GPU without TRITON_INTERPRET|an NVIDIA GPU) .*fp8_mma=True"):
        mla_decode_forward(*args, scale=0.1, num_kv_splits=1, tiles=FP8_MMA_TILES)
    # the rules pick these tiles for fp8 caches of up to 16 heads and 16-bit queries, 32-head tiles for 17-32 heads,
    # never under the interpreter (the launcher's fallback from them runs on a GPU:
    # benchmarks/results/round32_h200/scripts/r32c1.sh, FP8_MMA on, small latents)
    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for heads in (2, 16):
            assert choose_tiles(heads, torch.bfloat16, interpret=False, kv_dtype=kv_dtype) == FP8_MMA_TILES
        for heads in (17, 32):
            tiles = choose_tiles(heads, torch.float16, interpret=False, kv_dtype=kv_dtype, fp8_mma=True)
            assert tiles == FP8_MMA_32_HEAD_TILES == MLATileConfig(32, 64, 4, 2, fp8_mma=True, coalesced_io=True)
            # fewer sequences than FP8_MMA_32_HEAD_MIN_BATCH keep 16-head blocks; 16 heads keep them at any batch
            for batch, expected in ((15, FP8_MMA_TILES), (16, FP8_MMA_32_HEAD_TILES), (1024, FP8_MMA_32_HEAD_TILES)):
                got = choose_tiles(heads, torch.float16, interpret=False, kv_dtype=kv_dtype, batch=batch, fp8_mma=True)
                assert got == expected
            # by default fewer sequences than WIDE_FP8_MIN_BATCH (more take the wide kernel's fp8 forms:
            # test_mla_fp8_scores_default.py)
            assert choose_tiles(heads, torch.float16, interpret=False, kv_dtype=kv_dtype, batch=7) == FP8_MMA_TILES
            assert choose_tiles(16, torch.float16, interpret=False, kv_dtype=kv_dtype, batch=64) == FP8_MMA_TILES
    assert not choose_tiles(2, torch.bfloat16, interpret=False, kv_dtype=torch.bfloat16, fp8_mma=True).fp8_mma
    assert not choose_tiles(33, torch.bfloat16, interpret=False, kv_dtype=torch.float8_e5m2, fp8_mma=True).fp8_mma
    assert not choose_tiles(2, torch.float32, interpret=False, kv_dtype=torch.float8_e5m2, fp8_mma=True).fp8_mma
    assert not choose_tiles(2, torch.bfloat16, interpret=True, kv_dtype=torch.float8_e4m3fn, fp8_mma=True).fp8_mma


@pytest.mark.parametrize(
    "fields",
    [
        {"block_h": 64},
        {"num_warps": 8},
        {"block_h": 32, "num_warps": 16},
        {"block_n": 128},
        {"num_stages": 1},
        {"separate_values": True},
    ],
)
def test_mma_tiles_outside_the_kernels_shape_are_refused(fields):
    """The kernel's shapes are fixed (16 heads on four warps, 32 on four or eight, 64 on sixteen, 32 or 64 keys):
    other tiles would be ignored."""
    base = {"block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 2, "fp8_mma": True}
    with pytest.raises(ValueError, match="expected fp8_mma tiles of 16 heads on 4 warps, 32 on 4 or 8, 64 on 16"):
        MLATileConfig(**{**base, **fields})
    MLATileConfig(**{**base, "block_h": 32, "num_warps": 8})
    MLATileConfig(**{**base, "block_h": 64, "num_warps": 16})
    MLATileConfig(**{**base, "block_h": 32})
    with pytest.raises(ValueError, match=r"expected wgmma_scores=False .*wrong outputs on an H200"):
        MLATileConfig(**{**base, "wgmma_scores": True})


@pytest.mark.parametrize(
    "fields",
    [{"alu_scores": 32}, {"alu_values": 16}, {"block_n": 32, "alu_values": 4}, {"alu_scores": -1},
     {"fp8_mma": False, "alu_values": 1}, {"fp8_mma": False, "pages_ahead": True},
     {"fp8_mma": False, "coalesced_io": True}],
)  # fmt: skip
def test_integer_unpacking_masks_and_pages_ahead_outside_the_kernel_are_refused(fields):
    base = {"block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 2, "fp8_mma": True}
    MLATileConfig(**{**base, "alu_scores": 31, "alu_values": 15})  # every chunk and step
    with pytest.raises(
        ValueError, match=r"expected (alu_scores and alu_values|pages_ahead|coalesced_io) only with fp8_mma"
    ):
        MLATileConfig(**{**base, **fields})


def test_a_register_limit_reaches_the_launch_and_only_the_mma_tiles_take_one():
    """``maxnreg`` (ptxas' limit a thread: at 32 keys, 128 registers fit four programs an SM against three,
    40 bytes spilled; benchmarks/results/round37/NOTES.md) goes into the launch's options; other tiles, or a
    limit ptxas does not take, are refused."""
    tiles = MLATileConfig(16, 32, 4, 2, fp8_mma=True, maxnreg=128)
    case = make_mla_case([3], page_size=64, num_heads=16, rank=512, rope_dim=64, device="cpu")
    kv = quantize_kv(case.kv_cache, torch.float8_e4m3fn, 0.5)
    inputs = case.inputs()
    out = torch.empty_like(case.q_nope)
    options = dict(q_scale=0.0625, qk_scale_log2=1.0, kv_scale=0.5, num_kv_splits=1, write_partial=False,
                   write_lse=False, min_split=32, block_n=tiles.block_n, stages=tiles.num_stages)  # fmt: skip
    args = (inputs["q_nope"], inputs["q_rope"], kv, inputs["page_table"], inputs["seq_lens"], out, out[:, :, 0],
            out, out[:, :, 0])  # fmt: skip
    assert mma.launch_arguments(*args, **options, maxnreg=tiles.maxnreg)[2]["maxnreg"] == 128
    assert "maxnreg" not in mma.launch_arguments(*args, **options)[2]
    for fields in ({"fp8_mma": False, "num_stages": 3}, {"maxnreg": 100}, {"maxnreg": 16}):
        with pytest.raises(ValueError, match="expected maxnreg only with fp8_mma, a multiple of 8 in"):
            MLATileConfig(**{"block_h": 16, "block_n": 32, "num_warps": 4, "fp8_mma": True, "maxnreg": 128, **fields})


def test_the_launch_tells_the_cache_format_and_refuses_masks_it_cannot_use():
    """An e5m2 cache launches the kernel's e5m2 form (``E5M2``); the integer unpacking's masks are for e4m3 bytes
    by ``mma.sync`` only (e5m2's unpacking is already two ``prmt``)."""
    case = make_mla_case([3], page_size=64, num_heads=16, rank=512, rope_dim=64, device="cpu")
    inputs = case.inputs()
    out = torch.empty_like(case.q_nope)
    options = dict(q_scale=0.0625, qk_scale_log2=1.0, kv_scale=0.5, num_kv_splits=1, write_partial=False,
                   write_lse=False, min_split=64, block_n=64, stages=2)  # fmt: skip
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        kv = quantize_kv(case.kv_cache, dtype, 0.5)
        args = (inputs["q_nope"], inputs["q_rope"], kv, inputs["page_table"], inputs["seq_lens"], out,
                out[:, :, 0], out, out[:, :, 0])  # fmt: skip
        kwargs = mma.launch_arguments(*args, **options)[2]
        assert (kwargs["E5M2"], kwargs["ALU_QK"], kwargs["ALU_PV"]) == (dtype == torch.float8_e5m2, 0, 0)
        if dtype == torch.float8_e5m2:
            with pytest.raises(ValueError, match="expected integer unpacking masks only for e4m3 without wgmma"):
                mma.launch_arguments(*args, **options, alu_values=1)
        else:
            assert mma.launch_arguments(*args, **options, alu_scores=3)[2]["ALU_QK"] == 3
            with pytest.raises(ValueError, match="expected integer unpacking masks only for e4m3 without wgmma"):
                mma.launch_arguments(*args, **options, alu_scores=3, wgmma=True)


@pytest.mark.parametrize(
    "tiles",
    [
        MLATileConfig(16, 32, 4, 2, fp8_mma=True, maxnreg=128),
        FP8_MMA_TILES,
        MLATileConfig(64, 64, 8, 2, wide=True),
        MLATileConfig(16, 64, 4, 2, fp8_mma=True, alu_scores=0b01010, alu_values=0b1010, pages_ahead=True),
        MLATileConfig(16, 64, 4, 2, fp8_mma=True),
        MLATileConfig(32, 64, 8, 2, fp8_mma=True, coalesced_io=True),
        MLATileConfig(64, 32, 16, 3, fp8_mma=True, coalesced_io=True),
        MLATileConfig(32, 32, 4, 3, fp8_mma=True, coalesced_io=True),
        FP8_MMA_32_HEAD_TILES,
    ],
    ids=[
        "fp8_mma_maxnreg",
        "fp8_mma",
        "wide",
        "fp8_mma_alu",
        "fp8_mma_two_byte_io",
        "fp8_mma_32_heads",
        "fp8_mma_64_heads",
        "fp8_mma_32_heads_4_warps",
        "fp8_mma_32_head_default",
    ],
)
def test_the_launcher_passes_each_gluon_kernel_only_what_it_takes(tiles, monkeypatch):
    """``mla_decode_forward`` down to each Gluon kernel's ``launch_arguments`` on any machine (the kernel itself
    replaced: Gluon is not interpreted): its keywords are those the kernel's launcher takes, and a register limit
    reaches the launch's options."""
    from portattn.kernels.triton import mla_decode_launch, mla_decode_wide

    launched = []
    for module in (mma, mla_decode_wide):
        monkeypatch.setattr(module, "launch", lambda *a, m=module, **k: launched.append(m.launch_arguments(*a, **k)))
    monkeypatch.setattr(mla_decode_launch, "gluon_lacks", lambda *args: None)
    heads = 64 if tiles.wide else 40
    case = make_mla_case([5, 70], page_size=64, num_heads=heads, rank=512, rope_dim=64, device="cpu")
    kv = quantize_kv(case.kv_cache, torch.float8_e4m3fn, 0.5)
    inputs = case.inputs()
    out = torch.empty_like(case.q_nope)
    mla_decode_forward(inputs["q_nope"], inputs["q_rope"], kv, inputs["page_table"], inputs["seq_lens"], out,
                       scale=0.1, num_kv_splits=1, tiles=tiles, kv_scale=0.5)  # fmt: skip
    ((grid, _, kwargs),) = launched
    assert grid[2] == 2 and kwargs.get("maxnreg") == tiles.maxnreg
    assert grid[0] == -(-heads // tiles.block_h) and kwargs["num_warps"] == tiles.num_warps
    if tiles.fp8_mma:
        assert (kwargs["ALU_QK"], kwargs["ALU_PV"]) == (tiles.alu_scores, tiles.alu_values)
        assert kwargs["PAGES_AHEAD"] == tiles.pages_ahead
        assert kwargs["COALESCED_IO"] == tiles.coalesced_io
        assert kwargs["BLOCK_H"] == tiles.block_h and kwargs["WARPS"] == tiles.num_warps
