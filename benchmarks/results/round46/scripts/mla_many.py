"""Run ``scripts/ncu_mla.py --time`` for each line of a file of its arguments in one process (no import or
start-up a run), until a time limit: ``python3 mla_many.py CASES SECONDS``. A case that fails prints its error
and the next one runs."""

import shlex
import sys
import time

import torch

sys.path.insert(0, "scripts")
import ncu_mla

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
    sys.argv = ["ncu_mla.py", *shlex.split(line), "--time"]
    try:
        ncu_mla.main()
    except Exception as exc:  # one case's failure is reported and the rest run
        print(f"{line}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    sys.stdout.flush()
    torch.cuda.empty_cache()
