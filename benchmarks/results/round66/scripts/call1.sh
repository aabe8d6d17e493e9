#!/usr/bin/env bash
# Round 66's first call (under 10 minutes; the most wanted first): OUT=... bash benchmarks/results/round66/scripts/call1.sh
#   1. cases.txt timed (graph replays, alternated, the bf16 cache beside);
#   2. python -m portattn.bench.mla --fp8 (17, 64, 128 heads), the defaults, alone on the GPU;
#   3. the seesaw compile tests and the fp8-values GPU test (four processes).
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round66/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout 125 python3 scripts/mla_times.py $S/cases.txt 105 2>&1 | grep -v Warning | tee $OUT/times.txt
PYTHONPATH=src timeout 90 python3 -m portattn.bench.mla --fp8 --no-torch --page-sizes 64 --batches 64 \
  --heads 17,64,128 --lengths 4096 --label "$(cat $OUT/gpu.txt), round 66 defaults" --out $OUT/bench.json 2>&1 \
  | grep -v Warning | tee $OUT/bench.txt
PYTHONPATH=src:tests timeout 290 python3 -m pytest -q -p no:cacheprovider -n 4 -rP tests/kernels/test_mla_seesaw_fp8.py \
  tests/kernels/test_mla_wide_fp8.py -k "seesaw or fp8_values" 2>&1 | grep -v Warning > $OUT/tests_full.txt
grep -E "merged|splits, TMA, seesaw|passed|failed|Error" $OUT/tests_full.txt | tail -60 | tee $OUT/tests.txt
