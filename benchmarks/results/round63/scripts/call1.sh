#!/usr/bin/env bash
# Round 63's first call (under 10 minutes): OUT=... bash benchmarks/results/round63/scripts/call1.sh
#   1. quick_check.py: the seesaw kernel with one row maximum a pair and without, against the float64 reference;
#   2. cases.txt timed (graph replays, bf16 cache in the same run);
#   3. python -m portattn.bench.mla --fp8 with PAIR_MAX on, then off (17, 64, 128 heads).
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round63/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 150 python3 $S/quick_check.py 2>&1 | grep -v Warning | tee $OUT/check.txt
PYTHONPATH=src timeout 200 python3 scripts/mla_times.py $S/cases.txt 180 2>&1 | grep -v Warning | tee $OUT/times.txt
A="--fp8 --no-torch --page-sizes 64 --batches 64 --heads 17,64,128 --lengths 4096"
for form in on off; do
  PYTHONPATH=src timeout 90 python3 $S/bench_pair.py $form $A --label "$(cat $OUT/gpu.txt), pair max $form" \
    --out $OUT/bench_pair_$form.json 2>&1 | grep -v Warning | tee $OUT/bench_pair_$form.txt
done
