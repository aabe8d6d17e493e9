#!/usr/bin/env bash
# Round 70's last call, with 258 s of device time left: OUT=... bash benchmarks/results/round70/scripts/call3.sh
#   On an H200 only (it exits at once on another card): python -m portattn.bench.mla --fp8 at 17, 64 and 128 heads over
#   4096 keys.
set -f
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
grep -q H200 $OUT/gpu.txt || { echo "not an H200: nothing timed"; exit 0; }
PYTHONPATH=src timeout 100 python3 -m portattn.bench.mla --fp8 --no-torch --page-sizes 64 --batches 64 \
  --heads 17,64,128 --lengths 4096 --label "$(cat $OUT/gpu.txt), round 70" --out $OUT/bench.json 2>&1 \
  | grep -v Warning | tee $OUT/bench.txt
