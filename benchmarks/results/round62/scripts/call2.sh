#!/usr/bin/env bash
# Round 62's second call (under 10 minutes): OUT=... bash benchmarks/results/round62/scripts/call2.sh
#   1. merge_check.py: the in-kernel split merge against the float64 reference and the merge kernel;
#   2. cases2.txt timed (graph replays; whatever the check found);
#   3. python -m portattn.bench.mla --fp8 (17, 64, 128 heads; the defaults: the in-kernel merge).
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round62/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 130 python3 $S/merge_check.py 2>&1 | grep -v Warning | tee $OUT/check.txt
PYTHONPATH=src timeout 170 python3 $S/times2.py $S/cases2.txt 150 2>&1 | grep -v Warning | tee $OUT/times.txt
PYTHONPATH=src timeout 80 python3 -m portattn.bench.mla --fp8 --no-torch --page-sizes 64 --batches 64 \
  --heads 17,64,128 --lengths 4096 --label "$(cat $OUT/gpu.txt), in-kernel merge" --out $OUT/bench.json 2>&1 \
  | grep -v Warning | tee $OUT/bench.txt
