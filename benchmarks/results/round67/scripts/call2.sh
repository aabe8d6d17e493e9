#!/usr/bin/env bash
# Round 67's narrow kernel (mla_decode_narrow_fp8, SEESAW_NARROW) on the GPU:
#   OUT=... bash benchmarks/results/round67/scripts/call2.sh
#   1. quick_check.py: the default and the narrow kernel against float64 (17 heads page 64 e4m3, 32 heads page 16
#      e5m2; 1 and 3 splits);
#   2. cases.txt timed (graph replays), alone on the GPU;
#   3. the fp8-values GPU test's cases up to 32 heads (every form, the narrow kernel among them).
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round67/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 120 python3 $S/quick_check.py default mla_decode_wide_fp8.SEESAW_NARROW=True 2>&1 \
  | grep -v Warning | tee $OUT/check.txt
PYTHONPATH=src timeout 120 python3 scripts/mla_times.py $S/cases.txt 100 2>&1 | grep -v Warning | tee $OUT/times.txt
PYTHONPATH=src:tests timeout 200 python3 -m pytest -q -p no:cacheprovider -n 3 -rP tests/kernels/test_mla_wide_fp8.py \
  -k "fp8_values and (-17- or -32- or -24-)" 2>&1 | grep -v Warning > $OUT/tests_full.txt
grep -E "narrow|passed|failed|Error|FAILED" $OUT/tests_full.txt | tail -40 | tee $OUT/tests.txt
