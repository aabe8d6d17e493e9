#!/usr/bin/env bash
# Round 65's first call (under 10 minutes): OUT=... bash benchmarks/results/round65/scripts/call1.sh
#   1. quick_check.py: the seesaw kernel's default, MERGE_IN_KERNEL and SCORES_AHEAD with it, against float64 and
#      the default;
#   2. cases.txt timed (graph replays, alternated, the bf16 cache beside).
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round65/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 160 python3 $S/quick_check.py default MERGE_IN_KERNEL=True \
  SCORES_AHEAD=True,MERGE_IN_KERNEL=True 2>&1 | grep -v Warning | tee $OUT/check.txt
PYTHONPATH=src timeout 220 python3 scripts/mla_times.py $S/cases.txt 190 2>&1 | grep -v Warning | tee $OUT/times.txt
