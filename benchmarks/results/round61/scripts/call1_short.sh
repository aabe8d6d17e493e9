#!/usr/bin/env bash
# call1.sh's first two steps only (about 5 minutes), for a session with little device time left.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round61/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 90 python3 benchmarks/results/round60/scripts/quick_check.py 2>&1 | grep -v Warning \
  | tee $OUT/check.txt
grep -q "^0 failures" $OUT/check.txt || exit 1
A="--fp8 --no-torch --page-sizes 64 --batches 64 --heads 17,64,128 --lengths 4096"
for form in on off; do
  PYTHONPATH=src timeout 110 python3 $S/bench_vregs.py $form $A --label "$(cat $OUT/gpu.txt), vregs $form" \
    --out $OUT/bench_vregs_$form.json 2>&1 | grep -v Warning | tee $OUT/bench_vregs_$form.txt
done
