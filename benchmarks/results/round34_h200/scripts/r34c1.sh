#!/usr/bin/env bash
# Round 34, kernels call (about 7 minutes): the 64-head Gluon MLA kernel's GPU
# tests with the queries' float16 scale a power of two, beside the fp8 ops' tests and the 16-head kernel's mma.sync
# form; the ops' and DeepSeek-V3's MLA tests with the defaults (mla_decode_launch.WIDE on: the kernel for more than
# 32 heads over 16-bit caches; WIDE_FP8 and FP8_MMA off); the 16-head fp8 kernel's diagnosis; the captured pieces.
# Run from the repository root:
#   OUT=... bash benchmarks/results/round34_h200/scripts/r34c1.sh
W=$OUT
S=benchmarks/results/round34_h200/scripts
START=$SECONDS
PYTHONPATH=src:tests timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 tests/kernels/test_mla_wide.py \
  tests/kernels/test_mla_fp8_mma.py tests/ops/test_fp8_ops.py -k "not True" > $W/tests_mla_wide_gpu_log.txt 2>&1
echo "kernel tests rc $? at $((SECONDS-START))" >> $W/times.txt
PYTHONPATH=src:tests PORTATTN_TEST_ENGINE_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 \
  tests/ops/test_mla.py tests/models/test_deepseek_v3.py > $W/tests_ops_mla_wide_on_log.txt 2>&1
echo "ops tests rc $? at $((SECONDS-START))" >> $W/times.txt
PYTHONPATH=src:tests timeout 90 python3 $S/fp8_mma_diag.py > $W/fp8_mma_diag_log.txt 2>&1
echo "fp8_mma diag rc $? at $((SECONDS-START))" >> $W/times.txt
# issue 23: captured pieces of 1024 and 2048 tokens against plain steps (round 31's r31c2.sh runs it first too)
LEFT=$(( 560 - (SECONDS-START) ))
[ $LEFT -gt 60 ] && PYTHONPATH=src:tests PORTATTN_TEST_ENGINE_DEVICE=cuda timeout $LEFT python3 -m pytest -q \
  -p no:cacheprovider tests/engine/test_piecewise_gpu.py -k thousand > $W/tests_piecewise_2048_gpu_log.txt 2>&1
echo "pieces test rc $? at $((SECONDS-START))" >> $W/times.txt
