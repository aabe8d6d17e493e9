#!/usr/bin/env bash
# Round 58's first call: OUT=... bash benchmarks/results/round58/scripts/r58a.sh
#   0. the new options against the plain form (check.py);
#   1. the seesaw kernel asking the L2 for tiles past its ring (cases1.txt);
#   2. the kernel and the split merge timed apart (the merge's share of the step), 17-128 heads;
#   3. the MLA benchmark with fp8 caches beside bf16 over 17-128 heads (B=8 and 64, L=4096, page 64);
#   4. GPU tests touched by round 57's defaults.
set -f
S=benchmarks/results/round58/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout ${TC:-100} python3 $S/check.py 2>&1 | grep -v Warning | tail -n 25 | tee $OUT/check.txt
PYTHONPATH=src timeout ${T0:-150} python3 $S/many.py ${CASES:-$S/cases1.txt} $(( ${T0:-150} - 10 )) 2>&1 \
  | grep -v Warning | tee $OUT/times.txt
PYTHONPATH=src timeout ${T1:-100} python3 $S/parts.py 2>&1 | grep -v Warning | tee $OUT/parts.txt
[ "${T2:-150}" != 0 ] && PYTHONPATH=src timeout ${T2:-150} python3 -m portattn.bench.mla --fp8 --no-torch --out $OUT/mla_fp8_heads.json \
  --page-sizes 64 --batches 8,64 --heads 17,32,48,64,128 --lengths 4096 \
  --label "$(cat $OUT/gpu.txt), round 58" 2>&1 | grep -v Warning | tee $OUT/mla_fp8_heads.txt
if [ "${T3:-100}" != 0 ]; then
  PYTHONPATH=src:tests timeout ${T3:-100} python3 -m pytest -q -p no:cacheprovider -rf \
    tests/kernels/test_mla_fp8_scores_default.py \
    tests/kernels/test_mla_fp8_mma.py::test_the_default_tiles_of_24_heads_over_40_sequences_give_the_reference \
    tests/ops/test_mla.py 2>&1 | grep -v Warning | tail -n 15 > $OUT/tests.txt
  tail -n 3 $OUT/tests.txt
fi
