"""The MLA Gluon kernels compiled for sm_90 on the CPU, their PTX compiled again by ``ptxas -v``: its notes on
serialized warpgroup MMAs (C7512, C7514, C7517) and how many products the SASS waits for right after issuing.
``python3 serial.py [fp8] [seesaw] [bf16]`` from the repository root (``tests`` importable); writes /tmp/r56."""

import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, "tests")
import triton
from triton.backends.nvidia.compiler import get_ptxas

from kernels.mla_checks import cache_descriptors, compile_for_hopper
from portattn.kernels.triton import mla_decode_seesaw_fp8 as seesaw
from portattn.kernels.triton import mla_decode_wide as wide
from portattn.kernels.triton import mla_decode_wide_fp8 as wide_fp8

PTXAS = get_ptxas(90).path  # the one Triton compiles sm_90 with (3.9: ptxas-blackwell)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
ptrs = {
    "QNope": "*bf16",
    "QRope": "*bf16",
    "PageTable": "*i32",
    "SeqLensK": "*i32",
    "Out": "*bf16",
    "Lse": "*fp32",
    "PartOut": "*fp32",
    "PartLse": "*fp32",
}


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def report(name, kernel):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", f.name + ".cubin"], capture_output=True, text=True)
    notes = [l for l in (out.stdout + out.stderr).splitlines() if re.search(r"C75\d\d", l)]
    _write(f"/tmp/r56/{name}.ptx", kernel.asm["ptx"])
    sass = subprocess.run([CUOBJDUMP, "-sass", f.name + ".cubin"], capture_output=True, text=True).stdout
    _write(f"/tmp/r56/{name}.sass", sass)
    lines = [l.split(";")[0].split("*/")[-1].strip() for l in sass.splitlines() if "/*" in l and ";" in l]
    mma = [i for i, l in enumerate(lines) if "GMMA" in l]
    waited = sum(1 for i in mma if any("DEPBAR" in x for x in lines[i + 1 : i + 4]))
    print(
        f"   gmma {len(mma)}, followed by a wait within 3: {waited}; usage:",
        " ".join(l.strip() for l in (out.stdout + out.stderr).splitlines() if "Used" in l)[:200],
    )
    print(f"== {name}: {len(notes)} notes", flush=True)
    for l in notes:
        print("  ", l[:220])


which = sys.argv[1:] or ["fp8", "seesaw", "bf16"]
os.makedirs("/tmp/r56", exist_ok=True)


def compile_fp8(fn, const, num_warps):
    """``fn`` over an e4m3 cache of 64-key pages, its tiles copied by TMA, 12 warps under the producer's limit."""
    return compile_for_hopper(fn, {**ptrs, "KV": "*fp8e4nv", "CDesc": "*fp8e4nv", "PeDesc": "*fp8e4nv"}, const,
                              {"num_warps": num_warps, "maxnreg": wide.PRODUCER_MAXNREG},
                              cache_descriptors("*fp8e4nv", 64, const))  # fmt: skip


if "fp8" in which:
    for tma, values, pipe in ((1, 0, 0), (1, 1, 1)):
        const = {
            **wide_fp8.fp8_scores_constexprs(64, bool(values), 3, 2 if values else 1),
            "PAGE_SIZE": 64,
            "WRITE_PARTIAL": True,
            "WRITE_LSE": True,
            "MIN_SPLIT": 256,
            "TMA": bool(tma),
            "TMA_ROWS": 64,
            "PIPE": bool(pipe),
        }
        report(f"fp8scores_v{values}_p{pipe}", compile_fp8(wide_fp8.mla_decode_wide_fp8_kernel, const, wide.NUM_WARPS))
if "seesaw" in which:
    const = {
        **seesaw.seesaw_constexprs(),
        "PAGE_SIZE": 64,
        "WRITE_PARTIAL": True,
        "WRITE_LSE": True,
        "MIN_SPLIT": 256,
        "TMA_ROWS": 64,
    }
    report("seesaw", compile_fp8(seesaw.mla_decode_seesaw_kernel, const, seesaw.NUM_WARPS))
if "bf16" in which:
    from triton.experimental.gluon import language as gl

    for ws in (0, 1):
        fn = wide.mla_decode_wide_ws_kernel if ws else wide.mla_decode_wide_kernel
        const = {
            **wide.constexprs(64, 2, False, **({"producer": True} if ws else {})),
            "PAGE_SIZE": 64,
            "WRITE_PARTIAL": True,
            "WRITE_LSE": True,
            "MIN_SPLIT": 256,
            "DOT": gl.bfloat16,
        }
        opts = {"num_warps": wide.NUM_WARPS, **({"maxnreg": wide.PRODUCER_MAXNREG} if ws else {})}
        report(f"wide_bf16_ws{ws}", compile_for_hopper(fn, {**ptrs, "KV": "*bf16"}, const, opts))
