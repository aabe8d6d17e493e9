#!/usr/bin/env bash
# Round 60 (did not run: no machine started): the seesaw kernel with its value products read from registers (mla_decode_seesaw_vregs):
# the fp8-values GPU test's seesaw forms, then cases1.txt timed.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round60/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 110 python3 $S/check_vregs.py "fp8_values and 64-64-64" 2>&1 \
  | grep -v Warning | grep "seesaw\|passed\|failed\|Error\|error" | tail -n 60 | tee $OUT/tests.txt
CASES=$S/cases1.txt
if ! grep -q "passed\|failed" $OUT/tests.txt; then  # the tests did not finish (a hang?): time the others only
  grep -v "^vregs" $S/cases1.txt > /tmp/cases.txt; CASES=/tmp/cases.txt
fi
PYTHONPATH=src timeout 125 python3 $S/many.py $CASES 110 2>&1 | grep -v Warning | tee $OUT/times.txt
