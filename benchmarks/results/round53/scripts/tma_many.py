"""``round46/scripts/mla_many.py`` with one more kind of line: a case after ``cp.async`` runs with
``mla_decode_wide_fp8.TMA = False`` (the fp8-scores form's tiles copied by cp.async, not TMA):
``python3 tma_many.py CASES SECONDS``."""

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
    mla_decode_wide_fp8.TMA = words[0] != "cp.async"
    if not mla_decode_wide_fp8.TMA:
        words = words[1:]
    print("cp.async copies: " if not mla_decode_wide_fp8.TMA else "", end="")
    sys.argv = ["ncu_mla.py", *words, "--time"]
    try:
        ncu_mla.main()
    except Exception as exc:  # one case's failure is reported and the rest run
        print(f"{line}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    sys.stdout.flush()
    torch.cuda.empty_cache()
