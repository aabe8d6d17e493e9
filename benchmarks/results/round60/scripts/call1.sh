#!/usr/bin/env bash
# Round 60, call 2 (the first that ran of this script): the seesaw kernel with its value products read from registers (mla_decode_seesaw_vregs):
# the fp8-values GPU test's seesaw forms, then cases1.txt timed.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round60/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 170 python3 $S/check_vregs.py "fp8_values and (64-64-64 or 8-64-40)" 2>&1 \
  | grep -v Warning | grep "seesaw\|passed\|failed\|Error\|error" | tail -n 60 | tee $OUT/tests.txt
PYTHONPATH=src timeout 180 python3 $S/many.py $S/cases1.txt 170 2>&1 | grep -v Warning | tee $OUT/times.txt
