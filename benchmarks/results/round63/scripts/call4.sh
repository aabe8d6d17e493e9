#!/usr/bin/env bash
# Round 63's fourth call (under 10 minutes): OUT=... bash benchmarks/results/round63/scripts/call4.sh
#   1. quick_check.py: the seesaw kernel's four forms (PAIR_MAX, PAGE_AHEAD, both, neither) against float64;
#   2. cases4.txt timed (graph replays, alternated, the bf16 cache beside).
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round63/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 150 python3 $S/quick_check.py 2>&1 | grep -v Warning | tee $OUT/check.txt
PYTHONPATH=src timeout 260 python3 scripts/mla_times.py $S/cases4.txt 250 2>&1 | grep -v Warning | tee $OUT/times.txt
