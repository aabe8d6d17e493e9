#!/usr/bin/env bash
# Round 65's probe call: OUT=... bash benchmarks/results/round65/scripts/call3.sh
#   merge_probe.patch applied here only; cases_probe.txt timed: where the in-kernel merge's 20-27 us go.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round65/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
git apply $S/merge_probe.patch || patch -p1 < $S/merge_probe.patch
PYTHONPATH=src timeout 150 python3 scripts/mla_times.py $S/cases_probe.txt 130 2>&1 | grep -v Warning | tee $OUT/times.txt
