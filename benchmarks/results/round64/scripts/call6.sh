#!/usr/bin/env bash
# Round 64's sixth call (under 10 minutes): OUT=... bash benchmarks/results/round64/scripts/call6.sh
#   1. quick_check_fold.py: the seesaw kernel with its scales folded and without, against float64 and each other;
#   2. cases_fold.txt timed (graph replays, alternated, the bf16 cache beside);
#   3. python -m portattn.bench.mla --fp8 (17, 64, 128 heads), the defaults;
#   4. the seesaw kernel's GPU tests (compiles, fp8 values against float64).
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round64/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 150 python3 $S/quick_check_fold.py 2>&1 | grep -v Warning | tee $OUT/check.txt
PYTHONPATH=src timeout 250 python3 scripts/mla_times.py $S/cases_fold.txt 230 2>&1 | grep -v Warning | tee $OUT/times.txt
PYTHONPATH=src timeout 100 python3 -m portattn.bench.mla --fp8 --no-torch --page-sizes 64 --batches 64 \
  --heads 17,64,128 --lengths 4096 --label "$(cat $OUT/gpu.txt), round 64 defaults, scales folded" --out $OUT/bench.json 2>&1 \
  | grep -v Warning | tee $OUT/bench.txt
PYTHONPATH=src:tests timeout 330 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_seesaw_fp8.py \
  tests/kernels/test_mla_wide_fp8.py -k "seesaw or fp8_values" 2>&1 | grep -v Warning | tail -15 | tee $OUT/tests.txt
