#!/usr/bin/env bash
# Round 41, call 5 (no carry, about 6 minutes): coalesced_io now in FP8_MMA_TILES (the default over e4m3):
#   1. the fp8_mma GPU tests (all of tests/kernels/test_mla_fp8_mma.py), then tests/ops/test_mla.py's fp8 cases;
#   2. graph replays over an e5m2 cache (16 heads, 4096 keys): fp8_mma's e5m2 form with coalesced_io against the
#      portable kernel and the bf16 cache at B = 64, 8, 128 (e5m2 takes the portable kernel by default).
#   OUT=... bash benchmarks/results/round41/scripts/r41c4.sh
export PYTHONPATH=src
set -f
START=$SECONDS
O=$OUT
PYTHONPATH=src:tests timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_fp8_mma.py \
  > $O/tests_fp8_mma.txt 2>&1
echo "test_mla_fp8_mma.py: $(tail -n 1 $O/tests_fp8_mma.txt) at $((SECONDS - START)) s"
PYTHONPATH=src:tests timeout 120 python3 -m pytest -q -p no:cacheprovider -x tests/ops/test_mla.py -k "fp8 or e4m3 or e5m2" \
  > $O/tests_mla_ops.txt 2>&1
echo "tests/ops/test_mla.py -k fp8: $(tail -n 1 $O/tests_mla_ops.txt) at $((SECONDS - START)) s"
T() { [ $((SECONDS - START)) -lt 500 ] && timeout 40 python3 scripts/ncu_mla.py "$@" --time >> $O/times.txt 2>&1; }
for b in 64 8 128; do
  T bf16 --batch $b
  T e5m2 --batch $b
  T e5m2 --tiles 16,64,4,2 --batch $b --coalesced-io
  [ $b = 64 ] && T e4m3 --batch $b
done
grep " ms " $O/times.txt | grep -v "^ " | sed 's/ (the plan.s splits: fp8_mma may run fewer)//'
echo "call took $((SECONDS - START)) s"
