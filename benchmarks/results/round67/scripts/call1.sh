#!/usr/bin/env bash
# Round 67's first call, on the landed tree of round 66:
#   OUT=... bash benchmarks/results/round67/scripts/call1.sh
#   1. python -m portattn.bench.mla --fp8 (17, 64, 128 heads), alone on the GPU;
#   2. the seesaw tests (the bf16-partials merge on the GPU), the fp8-values GPU test and the launcher's default fp8
#      MLA tests (four processes).
set -f
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout 90 python3 -m portattn.bench.mla --fp8 --no-torch --page-sizes 64 --batches 64 \
  --heads 17,64,128 --lengths 4096 --label "$(cat $OUT/gpu.txt), round 67" --out $OUT/bench.json 2>&1 \
  | grep -v Warning | tee $OUT/bench.txt
PYTHONPATH=src:tests timeout 250 python3 -m pytest -q -p no:cacheprovider -n 4 -rP tests/kernels/test_mla_seesaw_fp8.py \
  tests/kernels/test_mla_wide_fp8.py tests/kernels/test_mla_fp8_scores_default.py \
  2>&1 | grep -v Warning > $OUT/tests_full.txt
grep -E "merged|splits, TMA, seesaw|passed|failed|Error|FAILED" $OUT/tests_full.txt | tail -60 | tee $OUT/tests.txt
