#!/usr/bin/env bash
# Round 58's second call: OUT=... bash benchmarks/results/round58/scripts/r58b.sh
#   0. the ring's first tiles issued early and the merge by PDL against neither (check.py: the same outputs);
#   1. cases2.txt timed;
#   2. the MLA ops' GPU tests and the fp8 MLA kernels'.
set -f
S=benchmarks/results/round58/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout ${TC:-100} python3 $S/check.py 2>&1 | grep -v Warning | tail -n 25 | tee $OUT/check.txt
PYTHONPATH=src timeout ${T0:-150} python3 $S/many.py ${CASES:-$S/cases2.txt} $(( ${T0:-150} - 10 )) 2>&1 \
  | grep -v Warning | tee $OUT/times.txt
PYTHONPATH=src:tests timeout ${T3:-150} python3 -m pytest -q -p no:cacheprovider -rf -x \
  tests/ops/test_mla.py tests/kernels/test_mla_fp8_scores_default.py tests/kernels/test_mla_seesaw_fp8.py \
  tests/kernels/test_mla_wide_fp8.py \
  2>&1 | grep -v Warning | tail -n 15 > $OUT/tests.txt
tail -n 3 $OUT/tests.txt
