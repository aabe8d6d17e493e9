#!/usr/bin/env bash
# Round 57's third call (about 8 minutes): OUT=... bash benchmarks/results/round57/scripts/r57c.sh
#   1. cases3.txt timed;
#   2. GPU tests with the new defaults: the fp8-values case call 2 did not finish, the default-choice tests, the MLA
#      ops' fp8 tests.
set -f
S4=benchmarks/results/round54/scripts
S=benchmarks/results/round57/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout ${T1:-260} python3 $S4/many.py $S/cases3.txt $(( ${T1:-260} - 10 )) 2>&1 | grep -v Warning |
  tee $OUT/times.txt
PYTHONPATH=src:tests timeout ${T2:-200} python3 -m pytest -q -s -p no:cacheprovider -rf \
  "tests/kernels/test_mla_wide_fp8.py::test_fp8_values_within_the_bound_of_their_probabilities_rounding[8-64-40-cache6-2]" \
  tests/kernels/test_mla_fp8_scores_default.py tests/ops/test_mla.py 2>&1 | grep -v Warning |
  grep -E "splits|passed|failed|Error|error|FAIL" > $OUT/tests.txt
tail -n 5 $OUT/tests.txt
