"""Time ``scripts/ncu_mla.py --time`` cases under environment settings of the warp-specialized wide kernel's
experimental knobs (``WS_WHOLE``, ``WS_PROBE``, ``WS_PREGS``), one process: ``python3 ws_probe.py CASES SECONDS``.
A line is ``ENV=VALUE ... -- ncu_mla arguments``."""

import os
import shlex
import sys
import time

import torch

sys.path.insert(0, "scripts")
import ncu_mla

limit = float(sys.argv[2])
start = time.monotonic()
with open(sys.argv[1]) as f:
    cases = f.read().splitlines()
for line in cases:
    if not line.strip() or line.startswith("#"):
        continue
    if time.monotonic() - start > limit:
        print(f"{line}: not run (past {limit:.0f} s)", flush=True)
        continue
    env, _, rest = line.partition("--")
    for key in ("WS_WHOLE", "WS_PROBE", "WS_PREGS", "WS_OVERLAP"):
        os.environ.pop(key, None)
    os.environ.update(dict(item.split("=") for item in env.split()))
    print(f"[{env.strip() or 'default'}]", end=" ", flush=True)
    sys.argv = ["ncu_mla.py", *shlex.split(rest), "--time"]
    try:
        ncu_mla.main()
    except Exception as exc:
        print(f"{line}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    sys.stdout.flush()
    torch.cuda.empty_cache()
