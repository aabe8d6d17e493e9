#!/usr/bin/env bash
# Round 70's H200 call: OUT=... bash benchmarks/results/round70/scripts/call2.sh
#   On an H200 only (it exits at once on another card): python -m portattn.bench.mla --fp8 at 17, 32, 64 and 128 heads
#   over 4096 keys, alone, then round 69's forms.py at 17 and 64 heads, two rounds.
set -f
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
grep -q H200 $OUT/gpu.txt || { echo "not an H200: nothing timed"; exit 0; }
PYTHONPATH=src timeout 120 python3 -m portattn.bench.mla --fp8 --no-torch --page-sizes 64 --batches 64 \
  --heads 17,32,64,128 --lengths 4096 --label "$(cat $OUT/gpu.txt), round 70" --out $OUT/bench.json 2>&1 \
  | grep -v Warning | tee $OUT/bench.txt
PYTHONPATH=src timeout 150 python3 benchmarks/results/round69/scripts/forms.py --cases 17:4096,64:4096 --rounds 2 2>&1 \
  | grep -v Warning | tee $OUT/forms.txt
