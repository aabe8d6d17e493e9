"""The fp8 values' transposition (a ``[keys, 128 dims]`` chunk of the swizzled tile loaded, transposed, stored into
``[dims, keys]``) compiled for sm_90 on the CPU: Triton's ``gl.bank_conflicts`` for the load and the store, and the
SASS's shared-memory, permute and shuffle instructions. Three cases: round 56's layouts (TLOAD / TSTORE), and row
reads (``transposing_load``, at 64 and 32 keys) with the values' rows permuted: a warp reads one key's 128 bytes, 4
bytes a lane, each thread's keys are transposed in its registers and stored 16 bytes a row, the row of dim ``4q +
s`` at ``32 s + q``. ``python3 transpose_probe.py`` from the repository root (``tests`` importable; ``OUT_DIR`` a
writable folder)."""

import os
import re
import subprocess
import sys
from collections import Counter

sys.path.insert(0, "tests")
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kernels.mla_checks import compile_for_hopper
from portattn.kernels.triton.mla_decode_wide import nvmma
from portattn.kernels.triton.mla_decode_wide_fp8 import transposing_load


@gluon.jit
def probe_old(X, L: gl.constexpr, S: gl.constexpr, T: gl.constexpr, VS: gl.constexpr):
    tile = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], S)
    vt = gl.allocate_shared_memory(gl.float8e4nv, [128, 64], VS)
    x = tile.load(L)
    gl.static_print("load conflicts", gl.bank_conflicts(x.type, tile.type))
    y = gl.convert_layout(gl.permute(x, (1, 0)), T)
    gl.static_print("store conflicts", gl.bank_conflicts(y.type, vt.type))
    vt.store(y)


@gluon.jit
def probe_rows(X, L: gl.constexpr, S: gl.constexpr, T: gl.constexpr, VS: gl.constexpr, N: gl.constexpr):
    tile = gl.allocate_shared_memory(gl.float8e4nv, [N, 128], S)
    vt = gl.allocate_shared_memory(gl.float8e4nv, [128, N], VS)
    x = tile.load(L)
    gl.static_print("load conflicts", gl.bank_conflicts(x.type, tile.type))
    y = gl.permute(x, (1, 0))  # [128 dims, N keys]
    y = gl.reshape(gl.permute(gl.reshape(y, [32, 4, N]), (1, 0, 2)), [128, N])  # row 32 s + q: dim 4 q + s
    gl.static_print("store layout", y.type.layout)
    gl.static_print("store conflicts", gl.bank_conflicts(y.type, vt.type))
    vt.store(y)


w = 4
cases = {
    "TLOAD": (probe_old, gl.BlockedLayout([4, 4], [8, 4], [1, w], [1, 0]), {}),
    "ROWS": (probe_rows, transposing_load(64), {"N": 64}),
    "ROWS32": (probe_rows, transposing_load(32), {"N": 32}),
}
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for name, (fn, layout, extra) in cases.items():
    print(name, flush=True)
    n = extra.get("N", 64)
    const = {
        "L": layout,
        "S": nvmma(128, 8),
        "T": gl.BlockedLayout([4, 4], [4, 8], [w, 1], [1, 0]),
        "VS": nvmma(n, 8),
        **extra,
    }
    kernel = compile_for_hopper(fn, {"X": "*fp8e4nv"}, const, {"num_warps": 4})
    path = os.path.join(os.environ.get("OUT_DIR", "/tmp"), f"transpose_probe_{name}.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True).stdout
    with open(path[:-6] + ".sass", "w") as f:
        f.write(sass)
    ops = Counter(
        m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?P\d\s+)?([A-Z0-9]+(?:\.[A-Z0-9]+)*)", sass)
    )
    print({o: c for o, c in ops.items() if re.match(r"LD|ST|SHFL|PRMT|BAR|BMOV|SHF|LOP", o)}, flush=True)
