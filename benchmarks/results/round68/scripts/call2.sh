#!/usr/bin/env bash
# Round 68's second call: OUT=... bash benchmarks/results/round68/scripts/call2.sh
#   1. forms.py: round 67's step, the chunked merge, EARLY_COPIES 1 and 2, PDL, all (17 and 64 heads over 4096 keys),
#      the bf16 cache beside, two rounds;
#   2. python -m portattn.bench.mla --fp8 at 17, 64 and 128 heads over 4096 keys (the tree's defaults), alone;
#   3. the GPU tests of this round's changes: PDL and EARLY_COPIES forms, the merge, the fp8-values test's seesaw cases
#      at 17 heads;
#   4. stamps.py with stamps2.patch at 4096 keys (EARLY_COPIES 2, PDL), if time is left.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round68/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout 110 python3 $S/forms.py --cases 17:4096,64:4096 --rounds 2 2>&1 | grep -v Warning \
  | tee $OUT/forms.txt
PYTHONPATH=src timeout 80 python3 -m portattn.bench.mla --fp8 --no-torch --page-sizes 64 --batches 64 \
  --heads 17,64,128 --lengths 4096 --label "$(cat $OUT/gpu.txt), round 68" --out $OUT/bench.json 2>&1 \
  | grep -v Warning | tee $OUT/bench.txt
PYTHONPATH=src:tests timeout 100 python3 -m pytest -q -p no:cacheprovider -n 3 -rA tests/kernels/test_mla_seesaw_fp8.py \
  tests/kernels/test_mla_wide_fp8.py -k "pdl_and_early or merge or (fp8_values and 64-64-17)" 2>&1 \
  | grep -v Warning > $OUT/tests_full.txt
grep -E "PASSED|passed|failed|Error|FAILED" $OUT/tests_full.txt | tail -30 | tee $OUT/tests.txt
git apply $S/stamps2.patch && {
  PYTHONPATH=src timeout 35 python3 $S/stamps.py --lengths 4096 2>&1 | grep -v Warning | tee $OUT/stamps.txt
  git apply -R $S/stamps2.patch; }
