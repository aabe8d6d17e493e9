#!/usr/bin/env bash
# Round 34, kernels call (about 8 minutes): the 64-head Gluon MLA kernel's fp8 LSE diagnosed (wide_diag.py), its GPU
# tests, then the ops' and DeepSeek-V3's MLA tests with it switched on (mla_decode_launch.WIDE; FP8_MMA stays off:
# round 33's call found that kernel's outputs wrong). Run from the repository root:
#   OUT=... bash benchmarks/results/round34_h200/scripts/r34c1.sh
W=$OUT
S=benchmarks/results/round34_h200/scripts
START=$SECONDS
PYTHONPATH=src:tests timeout 90 python3 $S/wide_diag.py > $W/wide_diag_log.txt 2>&1
echo "diag rc $? at $((SECONDS-START))" >> $W/times.txt
PYTHONPATH=src:tests timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 tests/kernels/test_mla_wide.py \
  > $W/tests_mla_wide_gpu_log.txt 2>&1
echo "kernel tests rc $? at $((SECONDS-START))" >> $W/times.txt
PYTHONPATH=src:tests:$S timeout 200 python3 -m pytest -q -p no:cacheprovider -p wide_on -n 4 tests/ops/test_mla.py \
  tests/ops/test_fp8_ops.py tests/models/test_deepseek_v3.py -k "mla or deepseek or fp8" > $W/tests_ops_mla_wide_on_log.txt 2>&1
echo "ops tests rc $? at $((SECONDS-START))" >> $W/times.txt
PYTHONPATH=src:tests timeout 90 python3 $S/fp8_mma_diag.py > $W/fp8_mma_diag_log.txt 2>&1
echo "fp8_mma diag rc $? at $((SECONDS-START))" >> $W/times.txt
# issue 23: captured pieces of 1024 and 2048 tokens against plain steps (round 31's r31c2.sh runs it first too)
LEFT=$(( 560 - (SECONDS-START) ))
[ $LEFT -gt 60 ] && PYTHONPATH=src:tests PORTATTN_TEST_ENGINE_DEVICE=cuda timeout $LEFT python3 -m pytest -q \
  -p no:cacheprovider tests/engine/test_piecewise_gpu.py -k thousand > $W/tests_piecewise_2048_gpu_log.txt 2>&1
echo "pieces test rc $? at $((SECONDS-START))" >> $W/times.txt
