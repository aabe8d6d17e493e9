"""Graph-replay timings of ``scripts/ncu_mla.py`` cases, one a line: ``python3 many.py CASES SECONDS``. Prefixes:
``seesaw`` (``mla_decode_wide_fp8.SEESAW``, else False), ``merge`` (``mla_decode_seesaw_fp8.MERGE_IN_KERNEL``: the
splits merged by the kernel's last split, else by the merge kernel); for measurement only (wrong outputs):
``notrans`` (``SKIP_TRANSPOSE``: no transposition of the values), ``nomergework`` (``SKIP_MERGE_WORK``: the last
split takes its ticket and merges nothing). ``merge`` and the last two need ``merge_in_kernel.patch`` applied (call 1
ran ``merge`` with the first form, which the notes describe)."""

import shlex
import sys
import time

import torch

sys.path.insert(0, "scripts")
import ncu_mla

from portattn.kernels.triton import mla_decode_seesaw_fp8, mla_decode_wide_fp8

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
    while words[0] in ("seesaw", "merge", "notrans", "nomergework"):
        prefixes.add(words.pop(0))
    mla_decode_wide_fp8.SEESAW = "seesaw" in prefixes
    mla_decode_seesaw_fp8.MERGE_IN_KERNEL = "merge" in prefixes
    mla_decode_seesaw_fp8.SKIP_TRANSPOSE = "notrans" in prefixes
    mla_decode_seesaw_fp8.SKIP_MERGE_WORK = "nomergework" in prefixes
    print("".join(f"{p}: " for p in sorted(prefixes)), end="")
    sys.argv = ["ncu_mla.py", *words, "--time"]
    try:
        ncu_mla.main()
    except Exception as exc:  # one case's failure is reported and the rest run
        print(f"{line}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    sys.stdout.flush()
    torch.cuda.empty_cache()
