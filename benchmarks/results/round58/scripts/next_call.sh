#!/usr/bin/env bash
# For the next session's first call (about 6 minutes): OUT=... bash benchmarks/results/round58/scripts/next_call.sh
#   1. cases_next.txt timed at HEAD;
#   2. half_early_scores.patch applied (each warpgroup's next tile's first 256 dims of scores issued behind its value
#      products), its GPU tests (the seesaw kernel's fp8-values cases), the same cases timed, the patch reverted;
#   3. the MLA benchmark over 17-128 heads (its graph-replay timing not yet run on a GPU).
set -f
S=benchmarks/results/round58/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout ${T0:-80} python3 $S/many.py $S/cases_next.txt $(( ${T0:-80} - 10 )) 2>&1 | grep -v Warning \
  | tee $OUT/times_head.txt
patch -p1 < $S/half_early_scores.patch > /dev/null
PYTHONPATH=src:tests timeout ${T1:-120} python3 -m pytest -q -p no:cacheprovider -rf \
  -k "fp8_values and (64-64-64 or 16-64-100 or 8-64-40)" tests/kernels/test_mla_wide_fp8.py 2>&1 \
  | grep -v Warning | tail -n 5 | tee $OUT/tests_half_early.txt
PYTHONPATH=src timeout ${T0:-80} python3 $S/many.py $S/cases_next.txt $(( ${T0:-80} - 10 )) 2>&1 | grep -v Warning \
  | tee $OUT/times_half_early.txt
patch -R -p1 < $S/half_early_scores.patch > /dev/null
PYTHONPATH=src timeout ${T2:-120} python3 -m portattn.bench.mla --fp8 --no-torch --out $OUT/mla_fp8_heads.json \
  --page-sizes 64 --batches 64,8 --heads 17,64,128 --lengths 4096 \
  --label "$(cat $OUT/gpu.txt), round 58" 2>&1 | grep -v Warning | tee $OUT/mla_fp8_heads.txt
