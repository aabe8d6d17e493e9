#!/usr/bin/env bash
# Round 65's first call (under 10 minutes): OUT=... bash benchmarks/results/round65/scripts/call1.sh
#   1. quick_check.py (its first case): the seesaw kernel's default and SCORES_AHEAD with MERGE_IN_KERNEL, against
#      float64 and each other;
#   2. cases.txt timed (graph replays, alternated, the bf16 cache beside).
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round65/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 110 python3 $S/quick_check.py default SCORES_AHEAD=True,MERGE_IN_KERNEL=True \
  short 2>&1 | grep -v Warning | tee $OUT/check.txt
PYTHONPATH=src timeout 120 python3 scripts/mla_times.py $S/cases.txt 95 2>&1 | grep -v Warning | tee $OUT/times.txt
