#!/usr/bin/env bash
# Round 63's fifth call (under 10 minutes): OUT=... bash benchmarks/results/round63/scripts/call5.sh
#   1. the fp8 MLA GPU tests with the new defaults (PAIR_MAX, PAGE_AHEAD), the seesaw kernel's first form beside;
#   2. python -m portattn.bench.mla --fp8 (17, 64, 128 heads), the defaults.
set -f
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 330 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_seesaw_fp8.py \
  tests/kernels/test_mla_fp8_scores_default.py tests/kernels/test_mla_wide_fp8.py 2>&1 | grep -v Warning | tail -30 \
  | tee $OUT/tests.txt
PYTHONPATH=src timeout 90 python3 -m portattn.bench.mla --fp8 --no-torch --page-sizes 64 --batches 64 \
  --heads 17,64,128 --lengths 4096 --label "$(cat $OUT/gpu.txt), round 63 defaults" --out $OUT/bench.json 2>&1 \
  | grep -v Warning | tee $OUT/bench.txt
