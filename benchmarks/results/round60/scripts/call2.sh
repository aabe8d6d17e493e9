#!/usr/bin/env bash
# Round 60 (did not run: too little device time was left to start a machine): quick_check.py (the two seesaw forms against the float64
# reference, the fp8-values test's bound), then cases2.txt timed.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round60/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 70 python3 $S/quick_check.py 2>&1 | grep -v Warning | tee $OUT/check.txt
CASES=$S/cases2.txt
grep -q "failures" $OUT/check.txt || { grep -v "^vregs" $S/cases2.txt > /tmp/cases.txt; CASES=/tmp/cases.txt; }
PYTHONPATH=src timeout 90 python3 $S/many.py $CASES 80 2>&1 | grep -v Warning | tee $OUT/times.txt
