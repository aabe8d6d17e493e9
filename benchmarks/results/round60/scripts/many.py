"""Graph-replay timings of ``scripts/ncu_mla.py`` cases, one a line: ``python3 many.py CASES SECONDS``. Prefixes:
``seesaw`` (``mla_decode_wide_fp8.SEESAW``, else False), ``vregs`` (``mla_decode_wide_fp8.SEESAW_VREGS``: the seesaw
kernel's value products read from registers, ``mla_decode_seesaw_vregs``)."""

import shlex
import sys
import time

import torch

sys.path.insert(0, "scripts")
import ncu_mla

from portattn.kernels.triton import mla_decode_wide_fp8

with open(sys.argv[1]) as f:
    cases = f.read().splitlines()
limit = float(sys.argv[2])
start = time.monotonic()
for line in cases:
    if not line.strip() or line.startswith("#"):
        continue
    if time.monotonic() - start > limit:
        print(f"{line}: not run (past {limit:.0f} s)", flush=True)
        continue
    words = shlex.split(line)
    prefixes = set()
    while words[0] in ("seesaw", "vregs"):
        prefixes.add(words.pop(0))
    mla_decode_wide_fp8.SEESAW = "seesaw" in prefixes or "vregs" in prefixes
    mla_decode_wide_fp8.SEESAW_VREGS = "vregs" in prefixes
    print("".join(f"{p}: " for p in sorted(prefixes)), end="")
    sys.argv = ["ncu_mla.py", *words, "--time"]
    try:
        ncu_mla.main()
    except Exception as exc:  # one case's failure is reported and the rest run
        print(f"{line}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    sys.stdout.flush()
    torch.cuda.empty_cache()
