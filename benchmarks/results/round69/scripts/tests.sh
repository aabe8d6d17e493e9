#!/usr/bin/env bash
# Round 69's GPU tests: OUT=... bash benchmarks/results/round69/scripts/tests.sh
#   each form of the seesaw kernel against the plain one (PDL, EARLY_COPIES, KEEP_QUERIES, ONE_PASS; PAGES_AT_ONCE in call 2),
#   the fp8-values test's cases that reach the seesaw kernel, the engine's PDL steps.
set -f
export PYTHONUNBUFFERED=1
PYTHONPATH=src:tests timeout ${T:-420} python3 -m pytest -q -p no:cacheprovider -n 4 -rA \
  tests/kernels/test_mla_wide_fp8.py tests/engine/test_pdl_gpu.py \
  -k "pdl_and_early or (fp8_values and (64-64-17 or 16-64-32 or 64-64-64)) or pdl_steps or launches_take_pdl" 2>&1 \
  | grep -v Warning > $OUT/tests_full.txt
grep -E "PASSED|passed|failed|Error|FAILED|SKIPPED" $OUT/tests_full.txt | tail -40 | tee $OUT/tests.txt
