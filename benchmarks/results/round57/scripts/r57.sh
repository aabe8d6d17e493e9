#!/usr/bin/env bash
# Round 57's first call (about 8 minutes): OUT=... bash benchmarks/results/round57/scripts/r57.sh
#   1. cases.txt timed (graph replays, medians);
#   2. the fp8-values GPU tests (pages 64, 16 and 8 at 64 keys, page 16 at 32 keys; the seesaw kernel among the
#      forms), every error printed;
#   3. rows.patch reversed (the round-56 transposition), before_cases.txt timed, the patch applied again.
set -f
S4=benchmarks/results/round54/scripts
S=benchmarks/results/round57/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout ${T1:-200} python3 $S4/many.py $S/cases.txt $(( ${T1:-200} - 10 )) 2>&1 | grep -v Warning |
  tee $OUT/times.txt
PYTHONPATH=src:tests timeout ${T2:-200} python3 -m pytest -q -s -p no:cacheprovider -rf \
  -k "fp8_values and (64-64-64 or 16-64-100 or 8-64-40 or 16-32-100)" tests/kernels/test_mla_wide_fp8.py 2>&1 |
  grep -v Warning | grep -E "splits|passed|failed|Error|error" > $OUT/tests_values.txt
tail -n 3 $OUT/tests_values.txt
patch -R -p1 < $S/rows.patch > /dev/null && PYTHONPATH=src timeout ${T3:-70} python3 $S4/many.py $S/before_cases.txt \
  $(( ${T3:-70} - 8 )) 2>&1 | grep -v Warning | tee $OUT/times_before.txt
patch -p1 < $S/rows.patch > /dev/null
