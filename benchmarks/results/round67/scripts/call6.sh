#!/usr/bin/env bash
# The next session's first call (an H200 if one comes; about 6 minutes):
#   OUT=... bash benchmarks/results/round67/scripts/call6.sh
#   1. call5.sh: python -m portattn.bench.mla --fp8 at 17, 64 and 128 heads over 4096 keys and 17 heads over 8192,
#      and the seesaw kernel's GPU tests;
#   2. fixed_parts.py: the call and the kernel alone (the merge left out) over 64 to 8192 keys, bf16 and e4m3 caches,
#      17 heads, each fitted to a part that does not grow with the keys and a slope.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round67/scripts
bash $S/call5.sh
PYTHONPATH=src timeout 150 python3 $S/fixed_parts.py 2>&1 | grep -v Warning | tee $OUT/fixed_parts.txt
