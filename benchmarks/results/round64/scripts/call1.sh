#!/usr/bin/env bash
# Round 64's first call (under 10 minutes): OUT=... bash benchmarks/results/round64/scripts/call1.sh
#   1. quick_check.py: the seesaw kernel with transposing loads and without, against float64 and each other;
#   2. cases.txt timed (graph replays, alternated, the bf16 cache beside);
#   3. python -m portattn.bench.mla --fp8 (17, 64, 128 heads), the defaults.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round64/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 150 python3 $S/quick_check.py 2>&1 | grep -v Warning | tee $OUT/check.txt
PYTHONPATH=src timeout 250 python3 scripts/mla_times.py $S/cases.txt 230 2>&1 | grep -v Warning | tee $OUT/times.txt
PYTHONPATH=src timeout 100 python3 -m portattn.bench.mla --fp8 --no-torch --page-sizes 64 --batches 64 \
  --heads 17,64,128 --lengths 4096 --label "$(cat $OUT/gpu.txt), round 64 defaults" --out $OUT/bench.json 2>&1 \
  | grep -v Warning | tee $OUT/bench.txt
