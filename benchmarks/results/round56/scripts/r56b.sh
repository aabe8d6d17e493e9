#!/usr/bin/env bash
# Round 56's second call (about 5 minutes): OUT=... bash benchmarks/results/round56/scripts/r56b.sh
#   1. seesaw_cases.txt timed (the seesaw kernel unserialized, the default form and the bf16 cache beside it);
#   2. the fp8-values GPU tests of the seesaw kernel's cases (page 64, 16 and 8), every error printed.
set -f
S4=benchmarks/results/round54/scripts
S=benchmarks/results/round56/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout ${T1:-120} python3 $S4/many.py $S/seesaw_cases.txt $(( ${T1:-120} - 8 )) 2>&1 | grep -v Warning |
  tee $OUT/times.txt
PYTHONPATH=src:tests timeout ${T2:-150} python3 -m pytest -q -s -p no:cacheprovider -rf \
  -k "fp8_values and (64-64-64 or 16-64-100 or 8-64-40)" tests/kernels/test_mla_wide_fp8.py 2>&1 |
  grep -v Warning | grep -E "splits|passed|failed|Error|error" > $OUT/tests_values.txt
tail -n 3 $OUT/tests_values.txt
# 3. cvt.patch reversed (the conversion's sixteen values a lane, two stores to a bank group a phase), the default
#    form timed again at 64 and 128 heads, the patch applied again
patch -R -p1 < $S/cvt.patch > /dev/null && PYTHONPATH=src timeout ${T3:-50} python3 $S4/many.py $S/cvt_cases.txt 42 2>&1 |
  grep -v Warning | tee $OUT/times_cvt_before.txt
patch -p1 < $S/cvt.patch > /dev/null
