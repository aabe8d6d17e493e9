"""``round54/scripts/many.py`` with more prefixes: ``late`` sets ``EARLY_TILES = False`` in ``mla_decode_seesaw_fp8``
and ``mla_decode_wide_fp8`` (the ring's first tiles issued by the producer after the queries load), ``nopdl`` sets
``launch.PDL = False`` (the split merge launched after the kernel has drained); call 1 (with
``l2_ahead_and_merge_in_kernel.patch`` applied) took ``l2=N`` (``mla_decode_seesaw_fp8.L2_AHEAD = N``, tiles past the
ring asked of the L2) and ``merge`` (its ``MERGE_IN_KERNEL``): ``python3 many.py CASES SECONDS``."""

import shlex
import sys
import time

import torch

sys.path.insert(0, "scripts")
import ncu_mla

from portattn.kernels.triton import launch, mla_decode_seesaw_fp8, mla_decode_wide_fp8

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
    ahead = 0
    while words[0] in ("cp.async", "pipe", "seesaw", "merge", "late", "nopdl") or words[0].startswith("l2="):
        if words[0].startswith("l2="):
            ahead = int(words[0][3:])
        prefixes.add(words.pop(0))
    if hasattr(mla_decode_seesaw_fp8, "L2_AHEAD"):
        mla_decode_seesaw_fp8.L2_AHEAD = ahead
        mla_decode_seesaw_fp8.MERGE_IN_KERNEL = "merge" in prefixes
    mla_decode_seesaw_fp8.EARLY_TILES = mla_decode_wide_fp8.EARLY_TILES = "late" not in prefixes
    launch.PDL = "nopdl" not in prefixes
    mla_decode_wide_fp8.TMA = "cp.async" not in prefixes
    mla_decode_wide_fp8.PIPELINED = "pipe" in prefixes
    mla_decode_wide_fp8.SEESAW = "seesaw" in prefixes
    print("".join(f"{p}: " for p in sorted(prefixes)), end="")
    sys.argv = ["ncu_mla.py", *words, "--time"]
    try:
        ncu_mla.main()
    except Exception as exc:  # one case's failure is reported and the rest run
        print(f"{line}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    sys.stdout.flush()
    torch.cuda.empty_cache()
