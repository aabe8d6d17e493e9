#!/usr/bin/env bash
# Round 56's device call (about 7 minutes): OUT=... bash benchmarks/results/round56/scripts/r56.sh
#   1. cases.txt timed (the fp8-scores form without serialized products, the bf16 cache beside it);
#   2. the fp8-scores GPU tests, every error printed (the scores promoted every 256 dims);
#   2b. the fp8-values GPU tests at page 64 and 16 (the seesaw kernel among them);
#   3. promote256.patch reversed (the tree before), old_cases.txt timed, the patch applied again.
set -f
S4=benchmarks/results/round54/scripts
S=benchmarks/results/round56/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
many() {  # CASES SECONDS
  PYTHONPATH=src timeout $2 python3 $S4/many.py $1 $(( $2 - 8 )) 2>&1 | grep -v Warning
}
many $S/cases.txt ${T1:-170} | tee $OUT/times.txt
PYTHONPATH=src:tests timeout ${T2:-200} python3 -m pytest -q -s -p no:cacheprovider -rf \
  -k "fp8_scores_against" tests/kernels/test_mla_wide_fp8.py 2>&1 | grep -v Warning |
  grep -E "splits|passed|failed|Error|error" > $OUT/tests.txt
tail -n 3 $OUT/tests.txt
PYTHONPATH=src:tests timeout ${T4:-80} python3 -m pytest -q -s -p no:cacheprovider -rf \
  -k "fp8_values and (64-64-64 or 16-64-100)" tests/kernels/test_mla_wide_fp8.py 2>&1 | grep -v Warning |
  grep -E "splits|passed|failed|Error|error" > $OUT/tests_values.txt
tail -n 3 $OUT/tests_values.txt
patch -R -p1 < $S/promote256.patch > /dev/null && many $S/old_cases.txt ${T3:-60} | tee $OUT/old_times.txt
patch -p1 < $S/promote256.patch > /dev/null
