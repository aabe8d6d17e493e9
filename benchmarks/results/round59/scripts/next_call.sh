#!/usr/bin/env bash
# For the next session's first call (about 7 minutes): OUT=... bash benchmarks/results/round59/scripts/next_call.sh
#   1. merge_in_kernel.patch applied (the seesaw kernel merging its splits itself, second form: every split's loads of
#      a chunk issued together, at most 4 splits; SKIP_TRANSPOSE and SKIP_MERGE_WORK for measurement only);
#   2. cases2.txt timed (the merge against HEAD's merge kernel, the two measurements leaving work out, the cache
#      resident in the L2);
#   3. the patch's GPU tests (its own-merge test and the fp8-values test's seesaw forms) and check_merge.py;
#   4. the patch reverted.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round59/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
patch -p1 < $S/merge_in_kernel.patch > /dev/null || exit 1
PYTHONPATH=src timeout 170 python3 $S/many.py $S/cases2.txt 160 2>&1 | grep -v Warning | tee $OUT/times.txt
PYTHONPATH=src:tests timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_mla_seesaw_fp8.py \
  tests/kernels/test_mla_wide_fp8.py -k "own_split_merge or (fp8_values and (64-64-64 or 16-64-100))" 2>&1 \
  | grep -v Warning | tail -n 8 | tee $OUT/tests.txt
PYTHONPATH=src timeout 100 python3 $S/check_merge.py 2>&1 | grep -v Warning | tee $OUT/check_merge.txt
patch -R -p1 < $S/merge_in_kernel.patch > /dev/null
