#!/usr/bin/env bash
# Round 68's first call: OUT=... bash benchmarks/results/round68/scripts/call1.sh
#   1. forms.py: the MLA step with and without PDL and EARLY_COPIES, alternately, 17/64/128 heads over 4096 keys and
#      17 over 8192, with the bf16 cache beside;
#   2. the seesaw kernel's GPU tests and the launcher's default fp8 MLA tests (the merge with PDL among them);
#   3. stamps.py with stamps.patch applied (then removed): each program's stretches, both forms;
#   4. round 67's fixed_parts.py, if time is left.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round68/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout 200 python3 $S/forms.py 2>&1 | grep -v Warning | tee $OUT/forms.txt
PYTHONPATH=src:tests timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 -rP tests/kernels/test_mla_seesaw_fp8.py \
  tests/kernels/test_mla_fp8_scores_default.py tests/kernels/test_mla_wide_fp8.py \
  -k "not compiles and (not fp8_values or 64-64-64 or 64-64-17 or 16-64-32)" 2>&1 | grep -v Warning > $OUT/tests_full.txt
grep -E "passed|failed|Error|FAILED" $OUT/tests_full.txt | tail -30 | tee $OUT/tests.txt
git apply $S/stamps.patch && {
  PYTHONPATH=src timeout 60 python3 $S/stamps.py 2>&1 | grep -v Warning | tee $OUT/stamps.txt
  PYTHONPATH=src timeout 60 python3 $S/stamps.py --neither 2>&1 | grep -v Warning | tee $OUT/stamps_neither.txt
  git apply -R $S/stamps.patch; }
PYTHONPATH=src timeout 100 python3 benchmarks/results/round67/scripts/fixed_parts.py 2>&1 | grep -v Warning \
  | tee $OUT/fixed_parts.txt
