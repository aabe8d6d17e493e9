"""The fp8 values' transposition (``mla_decode_wide_fp8._convert_values``: a ``[64 keys, 128 dims]`` chunk of the
swizzled tile loaded, transposed, stored into ``[dims, keys]``) compiled for sm_90 on the CPU with two load layouts:
Triton's ``gl.bank_conflicts`` for the load and the store, and the SASS's shared-memory and shuffle instructions.
``python3 transpose_probe.py`` from the repository root (``tests`` importable; ``OUT_DIR`` a writable folder)."""

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


@gluon.jit
def probe(X, L: gl.constexpr, S: gl.constexpr, T: gl.constexpr, VS: gl.constexpr):
    tile = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], S)
    vt = gl.allocate_shared_memory(gl.float8e4nv, [128, 64], VS)
    x = tile.load(L)
    gl.static_print("load conflicts", gl.bank_conflicts(x.type, tile.type))
    y = gl.convert_layout(gl.permute(x, (1, 0)), T)
    gl.static_print("store conflicts", gl.bank_conflicts(y.type, vt.type))
    vt.store(y)


w = 4
layouts = {
    # TLOAD: a lane's four keys consecutive (a quarter warp's ldmatrix rows four keys apart: two bank groups)
    "TLOAD": gl.BlockedLayout([4, 4], [8, 4], [1, w], [1, 0]),
    # a lane's four keys eight apart, the lanes' rows consecutive keys
    "keys 8 apart": gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0], [16, 0], [32, 0], [0, 64]],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[0, 16], [0, 32]],
        block_bases=[],
        shape=[64, 128],
    ),
}
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for name, layout in layouts.items():
    print(name, flush=True)
    const = {"L": layout, "S": nvmma(128, 8), "T": gl.BlockedLayout([4, 4], [4, 8], [w, 1], [1, 0]), "VS": nvmma(64, 8)}
    kernel = compile_for_hopper(probe, {"X": "*fp8e4nv"}, const, {"num_warps": 4})
    path = os.path.join(os.environ.get("OUT_DIR", "/tmp"), "transpose_probe.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True).stdout
    ops = Counter(
        m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?P\d\s+)?([A-Z0-9]+(?:\.[A-Z0-9]+)*)", sass)
    )
    print({o: c for o, c in ops.items() if re.match(r"LD|ST|SHFL|PRMT|BAR", o)}, flush=True)
