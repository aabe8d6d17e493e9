#!/usr/bin/env bash
# Round 43, one call (no carry, about 4 minutes): the 128-head MLA decode with both products in e4m3, unpipelined
# and pipelined (MLATileConfig(wide=True, fp8_products=True, pipelined=...)): graph replays at B=64 over 4096 keys
# against the bf16 cache and the e4m3 cache converted to float16 (the default), each output's error against
# float64 over the cache as stored; then the GPU tests of both forms (tests/kernels/test_mla_wide.py -k e4m3_products).
# Needs ../fp8_products_pipelined.patch applied first (git apply benchmarks/results/round43/fp8_products_pipelined.patch;
# it holds round 42's patch): the probe's --wide, --fp8-products, --pipelined and --error and the tests are in it.
#   OUT=... bash benchmarks/results/round43/scripts/r43c1.sh
export PYTHONPATH=src
set -f
START=$SECONDS
O=$OUT
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $O/gpu.txt 2>&1
T() { [ $((SECONDS - START)) -lt ${TLIMIT:-150} ] && timeout 60 python3 scripts/ncu_mla.py "$@" --time --error >> $O/times.txt 2>&1; }
T bf16 --heads 128
T e4m3 --heads 128
T e4m3 --heads 128 --wide --fp8-products --tiles 64,64,8,2
T e4m3 --heads 128 --wide --fp8-products --pipelined --tiles 64,64,8,2
T e4m3 --heads 128 --wide --fp8-products --pipelined --tiles 64,64,8,3
T e4m3 --heads 128 --wide --fp8-products --pipelined --tiles 64,32,8,3
T bf16 --heads 128
grep " ms " $O/times.txt
echo "timings done at $((SECONDS - START)) s"
PYTHONPATH=src:tests timeout ${TESTLIMIT:-150} python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_mla_wide.py -k "e4m3_products or pipelined" > $O/tests.txt 2>&1
tail -n 15 $O/tests.txt
echo "call took $((SECONDS - START)) s"
