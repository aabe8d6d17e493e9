#!/usr/bin/env bash
# Round 69's first call: OUT=... bash benchmarks/results/round69/scripts/call1.sh
#   1. python -m portattn.bench.mla --fp8 at 17, 64 and 128 heads over 4096 keys (the tree's defaults), alone;
#   2. forms.py: round 68's step, ONE_PASS, KEEP_QUERIES, both (17 and 64
#      heads over 4096 keys), the bf16 cache beside, three rounds.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round69/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout 100 python3 -m portattn.bench.mla --fp8 --no-torch --page-sizes 64 --batches 64 \
  --heads 17,64,128 --lengths 4096 --label "$(cat $OUT/gpu.txt), round 69" --out $OUT/bench.json 2>&1 \
  | grep -v Warning | tee $OUT/bench.txt
PYTHONPATH=src timeout 330 python3 $S/forms.py --cases 17:4096,64:4096 --rounds 3 2>&1 | grep -v Warning \
  | tee $OUT/forms.txt
