#!/usr/bin/env bash
# Round 62's first call (under 10 minutes): OUT=... bash benchmarks/results/round62/scripts/call1.sh
#   1. quick_check.py short: the twin kernel (pipelined, not, probabilities in registers) against the float64
#      reference (page 64, e4m3, 64 heads, bf16 queries);
#   2. cases.txt timed (graph replays; whatever the check found);
#   3. python -m portattn.bench.mla --fp8 with the twin kernel (17, 64, 128 heads).
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round62/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 100 python3 $S/quick_check.py short 2>&1 | grep -v Warning | tee $OUT/check.txt
PYTHONPATH=src timeout 220 python3 $S/times.py $S/cases.txt 200 2>&1 | grep -v Warning | tee $OUT/times.txt
A="--fp8 --no-torch --page-sizes 64 --batches 64 --heads 17,64,128 --lengths 4096"
for form in on; do
  PYTHONPATH=src timeout 80 python3 $S/bench_twin.py $form $A --label "$(cat $OUT/gpu.txt), twin $form" \
    --out $OUT/bench_twin_$form.json 2>&1 | grep -v Warning | tee $OUT/bench_twin_$form.txt
done
