#!/usr/bin/env bash
# Round 42, call 5 (no carry, about 4 minutes): the 128-head MLA decode with both products in e4m3
# (MLATileConfig(wide=True, fp8_products=True)): graph replays at B=64 over 4096 keys against the bf16 cache and the
# e4m3 cache converted to float16 (the default), each output's error against float64 over the cache as stored;
# then its GPU tests (tests/kernels/test_mla_wide.py -k e4m3_products).
# Needs ../fp8_products.patch applied (git apply benchmarks/results/round42/fp8_products.patch): the probe's --wide,
# --fp8-products and --error and the tests are in it.
#   OUT=... bash benchmarks/results/round42/scripts/r42c5.sh
# PIPELINED=1 (round 43; needs round43/fp8_products_pipelined.patch instead, which holds this one): the pipelined
# step timed too (2 and 3 buffers of 64 keys, 3 of 32), then the bf16 cache again, and its
# tests with the others, past a failure (timings started until 210 s, tests up to 240 s: at most 9 minutes).
export PYTHONPATH=src
set -f
START=$SECONDS
O=$OUT
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $O/gpu.txt 2>&1
K="e4m3_products or hopper" X=-x LIMIT=150 TL=150
if [ "${PIPELINED:-0}" = 1 ]; then K="$K or pipelined" X= LIMIT=210 TL=240; fi
T() { [ $((SECONDS - START)) -lt ${TLIMIT:-$LIMIT} ] && timeout 60 python3 scripts/ncu_mla.py "$@" --time --error >> $O/times.txt 2>&1; }
T bf16 --heads 128
T e4m3 --heads 128
T e4m3 --heads 128 --wide --fp8-products --tiles 64,64,8,2
T e4m3 --heads 128 --wide --fp8-products --tiles 64,64,8,3
T e4m3 --heads 128 --wide --fp8-products --tiles 64,64,8,4
T e4m3 --heads 128 --wide --fp8-products --tiles 64,32,8,3
if [ "${PIPELINED:-0}" = 1 ]; then
  T e4m3 --heads 128 --wide --fp8-products --pipelined --tiles 64,64,8,2
  T e4m3 --heads 128 --wide --fp8-products --pipelined --tiles 64,64,8,3
  T e4m3 --heads 128 --wide --fp8-products --pipelined --tiles 64,32,8,3
  T bf16 --heads 128
fi
grep " ms " $O/times.txt
tail -n 5 $O/times.txt | grep -i error | grep -v " ms "
echo "timings done at $((SECONDS - START)) s"
PYTHONPATH=src:tests timeout ${TESTLIMIT:-$TL} python3 -m pytest -q -p no:cacheprovider $X \
  tests/kernels/test_mla_wide.py -k "$K" > $O/tests.txt 2>&1
tail -n 15 $O/tests.txt
echo "call took $((SECONDS - START)) s"
