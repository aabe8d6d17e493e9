#!/usr/bin/env bash
# Round 67's last call: python -m portattn.bench.mla --fp8 (cold L2: a page table per input set), 17 heads over 2048,
# 4096 and 8192 keys (what of the step does not grow with the keys), then 64 and 128 heads over 4096:
#   OUT=... bash benchmarks/results/round67/scripts/call5.sh
set -f
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout 110 python3 -m portattn.bench.mla --fp8 --no-torch --page-sizes 64 --batches 64 \
  --heads 17 --lengths 2048,4096,8192 --label "$(cat $OUT/gpu.txt), round 67 lengths" --out $OUT/bench_lengths.json \
  2>&1 | grep -v Warning | tee $OUT/bench_lengths.txt
PYTHONPATH=src timeout 90 python3 -m portattn.bench.mla --fp8 --no-torch --page-sizes 64 --batches 64 \
  --heads 64,128 --lengths 4096 --label "$(cat $OUT/gpu.txt), round 67" --out $OUT/bench.json 2>&1 \
  | grep -v Warning | tee $OUT/bench.txt
