#!/usr/bin/env bash
# Round 61's first call (under 10 minutes): OUT=... bash benchmarks/results/round61/scripts/call1.sh
#   1. round 60's quick_check.py: both seesaw forms against the float64 reference (1 and 3 splits);
#   2. if it passed: python -m portattn.bench.mla --fp8 with the register form, then without (17, 64, 128 heads);
#   3. cases.txt timed (graph replays; the cache from DRAM and resident in the L2);
#   4. the fp8-values GPU test (both seesaw forms among the others) at pages of 64, 16 and 8.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round61/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 90 python3 benchmarks/results/round60/scripts/quick_check.py 2>&1 | grep -v Warning \
  | tee $OUT/check.txt
grep -q "^0 failures" $OUT/check.txt || exit 1
A="--fp8 --no-torch --page-sizes 64 --batches 64 --heads 17,64,128 --lengths 4096"
for form in on off; do
  PYTHONPATH=src timeout 120 python3 $S/bench_vregs.py $form $A --label "$(cat $OUT/gpu.txt), vregs $form" \
    --out $OUT/bench_vregs_$form.json 2>&1 | grep -v Warning | tee $OUT/bench_vregs_$form.txt
done
PYTHONPATH=src timeout 120 python3 benchmarks/results/round60/scripts/many.py $S/cases.txt 110 2>&1 \
  | grep -v Warning | tee $OUT/times.txt
PYTHONPATH=src:tests timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/kernels/test_mla_wide_fp8.py \
  -k "fp8_values and (64-64-64 or 16-64-100 or 8-64-40)" 2>&1 | grep -v Warning \
  | grep "seesaw\|passed\|failed\|Error" | tail -n 60 | tee $OUT/tests.txt
