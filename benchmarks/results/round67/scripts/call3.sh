#!/usr/bin/env bash
# Round 67's second form of the narrow kernel (each consuming warpgroup scores both tiles of a pair; no exchange):
#   OUT=... bash benchmarks/results/round67/scripts/call3.sh
#   1. quick_check.py: the default and the narrow kernel against float64 (17 heads page 64 e4m3, 32 heads page 16
#      e5m2; 1 and 3 splits);
#   2. cases3.txt timed (graph replays), alone on the GPU.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round67/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 120 python3 $S/quick_check.py default mla_decode_wide_fp8.SEESAW_NARROW=True 2>&1 \
  | grep -v Warning | tee $OUT/check.txt
PYTHONPATH=src timeout 100 python3 scripts/mla_times.py $S/cases3.txt 90 2>&1 | grep -v Warning | tee $OUT/times.txt
