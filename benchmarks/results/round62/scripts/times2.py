"""Graph-replay timings of ``scripts/ncu_mla.py`` cases, one a line: ``python3 times2.py CASES SECONDS``. Prefixes:
``seesaw`` (the seesaw kernel, merging its splits itself: ``mla_decode_launch.SEESAW_MERGE``), ``mergekernel`` (the
seesaw kernel and the merge kernel)."""

import shlex
import sys
import time

import torch

sys.path.insert(0, "scripts")
import ncu_mla

from portattn.kernels.triton import mla_decode_launch, mla_decode_wide_fp8

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
    form = words.pop(0) if words[0] in ("seesaw", "mergekernel") else ""
    mla_decode_wide_fp8.SEESAW = bool(form)
    mla_decode_launch.SEESAW_MERGE = form == "seesaw"
    print(f"{form}: " if form else "", end="")
    sys.argv = ["ncu_mla.py", *words, "--time"]
    try:
        ncu_mla.main()
    except Exception as exc:  # one case's failure is reported and the rest run
        print(f"{line}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    sys.stdout.flush()
    torch.cuda.empty_cache()
