"""The key loops of the MLA decode kernels compiled for sm_90, without a GPU: the figures of
``benchmarks/results/round33_h200/NOTES.md`` (and round 32's), reproducible.

``PYTHONPATH=src python scripts/mla_sass.py [--out FILE.json]`` from the repository root (no ``TRITON_INTERPRET``;
needs Triton's NVIDIA backend with its ``ptxas`` and ``cuobjdump``; Gluon's Hopper operations for the Gluon
kernels). Each kernel is compiled as a launch compiles it (unit strides and 16-byte divisible pointers and row
strides specialised: without them Triton's loads are scalar and the 64-head tiles seem to spill), then the
SASS of its longest loop (the key loop) is counted a warp: instructions, tensor-core MMAs (HGMMA for the
warpgroup MMA, QGMMA for its e4m3 form, HMMA for ``mma.sync``), fp8 conversions (F2FP unpacks), 16-byte
shared loads and stores, barriers; with the kernel's registers, stack (spills) and shared memory. Rows:

* the portable kernel (``mla_decode.py``) at its default tiles: 16 heads (bf16 cache; e4m3 with the rows
  loaded twice) and 64-head blocks (bf16: 32-key steps in 3 stages; e4m3: 64 keys in 2);
* ``mla_decode_fp8_mma`` (16 heads over e4m3: the default, ``coalesced_io``, then without it: 64 and 32 keys;
  the warpgroup-MMA scores; integer unpacking of the values' bytes, of half of each product's, of all; over e5m2,
  64 and 32 keys);
* ``mla_decode_wide`` (64-head blocks over bf16, e4m3 and e5m2; 64 and 32 keys);
* one ``mma.sync`` of e4m3 operands (``m16n8k32``, Gluon's ``mma_v2``), which sm_90 has no tensor-core instruction
  for: ptxas converts both operands to float16 (F2FP unpacks) and runs ``HMMA``, so on Hopper only the warpgroup
  MMA (``QGMMA``) multiplies e4m3 without conversions.

A row's ``per_64_keys`` is its loop's instructions scaled to 64 keys (a 32-key step's twice).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTRS = {"QNope": "*bf16", "QRope": "*bf16", "PageTable": "*i32", "SeqLensK": "*i32", "Out": "*bf16",
        "Lse": "*fp32", "PartOut": "*fp32", "PartLse": "*fp32"}  # fmt: skip
FLOATS = ("q_scale", "qk_scale_log2", "kv_scale")
ALIGNED = ("stride_kv_page", "stride_kv_slot", "stride_qn_b", "stride_qn_h", "stride_qr_b", "stride_qr_h")
COUNTED = {
    "HGMMA": r"^HGMMA",
    "HMMA": r"^HMMA",
    "QGMMA": r"^QGMMA",
    "F2FP unpack": r"^F2FP\.F16\.E[45]M[23]\.UNPACK",
    "LDS.128": r"^LDS\.128",
    "STS.128": r"^STS\.128",
    "LDS.U8": r"^LDS\.U8",
    "BAR": r"^BAR\.SYNC",
    "PRMT": r"^PRMT",
    "LOP3": r"^LOP3",
}


def signature(fn, kv: str, const: dict) -> tuple[dict, dict]:
    """A launch's signature and divisibility attributes for ``fn`` over a ``kv`` cache."""
    sig = {n: {**PTRS, "KV": kv}.get(n) or ("fp32" if n in FLOATS else "i32") for n in fn.arg_names if n not in const}
    sig |= {n: "constexpr" for n in const}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n in ALIGNED}  # fmt: skip
    return sig, attrs


def key_loop(cubin: bytes) -> tuple[collections.Counter, dict]:
    """The opcodes of the longest SASS loop and the kernel's resource usage."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
        usage = subprocess.run([f"{BIN}/cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True)
    code = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            code.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2))))
    loops = [(a - int(m.group(1), 16), int(m.group(1), 16), a) for a, text in code
             if (m := re.search(r"BRA\s+0x([0-9a-f]+)", text)) and int(m.group(1), 16) < a]  # fmt: skip
    _, start, end = max(loops)
    ops = collections.Counter(text.split()[0] for a, text in code if start <= a <= end)
    resources = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", usage.stdout)}
    return ops, resources


def row(name: str, keys: int, kernel) -> dict:
    ops, resources = key_loop(kernel.asm["cubin"])
    total = sum(ops.values())
    counts = {k: sum(c for op, c in ops.items() if re.match(rx, op)) for k, rx in COUNTED.items()}
    out = {"kernel": name, "keys_a_step": keys, "loop": total, "per_64_keys": total * 64 // keys, **counts}
    out |= {"registers": resources.get("REG"), "stack": resources.get("STACK"), "shared": kernel.metadata.shared}
    print(f"{name:<58} {total:>5} {out['per_64_keys']:>6}  " + "  ".join(f"{k} {v}" for k, v in counts.items() if v)
          + f"  regs {out['registers']} stack {out['stack']} shared {out['shared']}", flush=True)  # fmt: skip
    return out


def portable() -> list[dict]:
    from portattn.kernels.triton.mla_decode import mla_decode_split_kernel as fn

    rows = []
    for name, kv, (heads, keys, warps, stages), separate in (
        ("portable, 16 heads, bf16 cache", "*bf16", (16, 32, 4, 3), False),
        ("portable, 16 heads, e4m3 cache (rows loaded twice)", "*fp8e4nv", (16, 32, 4, 3), True),
        ("portable, 64-head blocks, bf16 cache", "*bf16", (64, 32, 8, 3), False),
        ("portable, 64-head blocks, e4m3 cache", "*fp8e4nv", (64, 64, 8, 2), False),
    ):
        const = {"KV_LORA_RANK": 512, "ROPE_DIM": 64, "PAGE_SIZE": 64, "BLOCK_H": heads, "BLOCK_N": keys,
                 "BLOCK_R": 512, "BLOCK_RP": 64, "WRITE_PARTIAL": True, "WRITE_LSE": False, "DOT_PRECISION": None,
                 "F16_DOTS": kv != "*bf16" and heads <= 32, "MIN_SPLIT": 64, "SEPARATE_VALUES": separate,
                 "DEQUANTIZE_ONCE": False}  # fmt: skip
        const |= {name: 1 for name in ("stride_qn_d", "stride_qr_d", "stride_kv_d", "stride_o_d")}  # unit strides
        sig, attrs = signature(fn, kv, const)
        src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
        kernel = triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages})
        rows.append(row(f"{name} ({heads}, {keys}, {warps}, {stages})", keys, kernel))
    return rows


def gluon() -> list[dict]:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from portattn.kernels.triton import mla_decode_fp8_mma as mma
    from portattn.kernels.triton import mla_decode_wide as wide

    rows = []
    common = {"PAGE_SIZE": 64, "WRITE_PARTIAL": True, "WRITE_LSE": False, "MIN_SPLIT": 64}
    for keys, wgmma, alu, e5m2, io in ((64, False, (0, 0), False, True), (64, False, (0, 0), False, False),
                                       (32, False, (0, 0), False, False), (64, True, (0, 0), False, False),
                                       (64, False, (0, 0b1111), False, False),
                                       (64, False, (0b01010, 0b1010), False, False),
                                       (64, False, (0b11111, 0b1111), False, False), (64, False, (0, 0), True, False),
                                       (32, False, (0, 0), True, False)):  # fmt: skip
        const = {**mma.constexprs(keys, 2, wgmma), **common, "ALU_QK": alu[0], "ALU_PV": alu[1], "E5M2": e5m2,
                 "PAGES_AHEAD": False, "COALESCED_IO": io}  # fmt: skip
        sig, attrs = signature(mma.mla_decode_fp8_mma_kernel, "*fp8e5" if e5m2 else "*fp8e4nv", const)
        src = GluonASTSource(fn=mma.mla_decode_fp8_mma_kernel, signature=sig, constexprs=const, attrs=attrs)
        kernel = triton.compile(src, target=TARGET, options={"num_warps": mma.NUM_WARPS})
        variant = ", wgmma scores" if wgmma else f", integer unpacking {alu[0]:#07b} {alu[1]:#06b}" if any(alu) else ""
        variant += ", coalesced_io (the default)" if io else ""
        rows.append(row(f"fp8_mma, 16 heads, {'e5m2' if e5m2 else 'e4m3'} ({keys} keys{variant})", keys, kernel))
    for kv, keys, stages in (("*bf16", 64, 2), ("*fp8e4nv", 64, 2), ("*fp8e5", 64, 2), ("*bf16", 32, 3),
                             ("*fp8e4nv", 32, 3)):  # fmt: skip
        fp8 = kv != "*bf16"
        const = {**wide.constexprs(keys, stages, fp8), **common, "DOT": gl.float16 if fp8 else gl.bfloat16}
        sig, attrs = signature(wide.mla_decode_wide_kernel, kv, const)
        src = GluonASTSource(fn=wide.mla_decode_wide_kernel, signature=sig, constexprs=const, attrs=attrs)
        kernel = triton.compile(src, target=TARGET, options={"num_warps": wide.NUM_WARPS})
        rows.append(row(f"wide, 64-head blocks, {kv[1:]} ({keys} keys, {stages} stages)", keys, kernel))
    return rows


def mma_sync_e4m3() -> dict:
    """One ``mma_v2`` of a 16 x 64 by 64 x 32 product of e4m3 operands, compiled for sm_90: its SASS opcodes."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    @gluon.jit
    def product(A, B, C, MMA: gl.constexpr):
        a_layout: gl.constexpr = gl.DotOperandLayout(0, MMA, 4)
        b_layout: gl.constexpr = gl.DotOperandLayout(1, MMA, 4)
        rows, k_a = gl.arange(0, 16, gl.SliceLayout(1, a_layout)), gl.arange(0, 64, gl.SliceLayout(0, a_layout))
        k_b, cols = gl.arange(0, 64, gl.SliceLayout(1, b_layout)), gl.arange(0, 32, gl.SliceLayout(0, b_layout))
        a = gl.load(A + rows[:, None] * 64 + k_a[None, :])
        b = gl.load(B + k_b[:, None] + cols[None, :] * 64)
        acc = mma_v2(a, b, gl.zeros([16, 32], gl.float32, MMA))
        out_rows, out_cols = gl.arange(0, 16, gl.SliceLayout(1, MMA)), gl.arange(0, 32, gl.SliceLayout(0, MMA))
        gl.store(C + out_rows[:, None] * 32 + out_cols[None, :], acc)

    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    sig = {"A": "*fp8e4nv", "B": "*fp8e4nv", "C": "*fp32", "MMA": "constexpr"}
    src = GluonASTSource(fn=product, signature=sig, constexprs={"MMA": mma}, attrs={(i,): [["tt.divisibility", 16]]
                                                                                     for i in range(3)})  # fmt: skip
    kernel = triton.compile(src, target=TARGET, options={"num_warps": 4})
    ptx = re.findall(r"mma\.sync\.aligned\.[\w.]+", kernel.asm["ptx"])
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    ops = collections.Counter(m.group(1) for m in re.finditer(r"\s+/\*[0-9a-f]{4,}\*/\s+([A-Z][\w.]*)", sass))
    counts = {k: sum(c for op, c in ops.items() if re.match(rx, op)) for k, rx in COUNTED.items()}
    print(f"mma.sync e4m3 16x64x32 ({', '.join(sorted(set(ptx)))}): "
          + "  ".join(f"{k} {v}" for k, v in counts.items() if v), flush=True)  # fmt: skip
    return {"kernel": "mma.sync e4m3 16x64x32", "ptx": sorted(set(ptx)), **counts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("expected TRITON_INTERPRET unset (the interpreter does not compile), got TRITON_INTERPRET=1")
    print(f"Triton {triton.__version__}, sm_90; the key loop a warp", flush=True)
    print(f"{'kernel':<58} {'loop':>5} {'per 64':>6}", flush=True)
    rows = portable()
    try:
        rows += gluon()
        rows.append(mma_sync_e4m3())
    except ImportError as exc:
        print(f"no Gluon kernels: {exc}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"triton": triton.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
