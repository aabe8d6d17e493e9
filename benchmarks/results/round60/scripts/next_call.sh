#!/usr/bin/env bash
# For the next session's first call (about 7 minutes): OUT=... bash benchmarks/results/round60/scripts/next_call.sh
#   1. quick_check.py: the seesaw kernel and its value products from registers (mla_decode_seesaw_vregs) against the
#      float64 reference within the fp8-values test's bound, at 1 and 3 splits;
#   2. the fp8-values GPU test (both seesaw forms among the others) at pages of 64, 16 and 8;
#   3. cases1.txt timed; the register form's cases are left out if step 1 did not finish (a hang).
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round60/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 90 python3 $S/quick_check.py 2>&1 | grep -v Warning | tee $OUT/check.txt
CASES=$S/cases1.txt
if ! grep -q "failures" $OUT/check.txt; then
  grep -v "^vregs" $S/cases1.txt > /tmp/cases.txt; CASES=/tmp/cases.txt
else
  PYTHONPATH=src:tests timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/kernels/test_mla_wide_fp8.py \
    -k "fp8_values and (64-64-64 or 16-64-100 or 8-64-40)" 2>&1 | grep -v Warning \
    | grep "seesaw\|passed\|failed\|Error" | tail -n 60 | tee $OUT/tests.txt
fi
PYTHONPATH=src timeout 190 python3 $S/many.py $CASES 180 2>&1 | grep -v Warning | tee $OUT/times.txt
