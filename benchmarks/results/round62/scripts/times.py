"""Graph-replay timings of ``scripts/ncu_mla.py`` cases, one a line: ``python3 times.py CASES SECONDS``. Prefixes:
``seesaw`` (the seesaw kernel), ``twin`` (``mla_decode_wide_fp8.TWIN``: ``mla_decode_twin_fp8``, pipelined),
``twinplain`` (the twin kernel not pipelined), ``twinregs`` (not pipelined, its probabilities in registers), each
after ``merge1`` or not (the split merge a split at a time: ``mla_decode_launch.MERGE_SPLIT_CHUNK = 1``)."""

import shlex
import sys
import time

import torch

sys.path.insert(0, "scripts")
import ncu_mla

from portattn.kernels.triton import mla_decode_launch, mla_decode_twin_fp8, mla_decode_wide_fp8

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
    mla_decode_launch.MERGE_SPLIT_CHUNK = 8
    if words[0] == "merge1":  # the split merge a split at a time, as before round 62
        mla_decode_launch.MERGE_SPLIT_CHUNK = 1
        print(words.pop(0), end=" ")
    form = words.pop(0) if words[0] in ("seesaw", "twin", "twinplain", "twinregs") else ""
    mla_decode_wide_fp8.SEESAW = bool(form)
    mla_decode_wide_fp8.TWIN = form.startswith("twin")
    mla_decode_twin_fp8.PIPELINED = form == "twin"
    mla_decode_twin_fp8.P_REGS = form == "twinregs"
    print(f"{form}: " if form else "", end="")
    sys.argv = ["ncu_mla.py", *words, "--time"]
    try:
        ncu_mla.main()
    except Exception as exc:  # one case's failure is reported and the rest run
        print(f"{line}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    sys.stdout.flush()
    torch.cuda.empty_cache()
