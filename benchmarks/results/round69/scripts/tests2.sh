#!/usr/bin/env bash
# Round 69's GPU tests with ONE_PASS and KEEP_QUERIES on: OUT=... bash benchmarks/results/round69/scripts/tests2.sh
#   the MLA fp8 kernels' files whole, then the engine's fp8-cache and PDL tests on the GPU (DeepSeek's MLA among them).
set -f
export PYTHONUNBUFFERED=1
PYTHONPATH=src:tests timeout ${T1:-250} python3 -m pytest -q -p no:cacheprovider -n 4 -rA \
  tests/kernels/test_mla_wide_fp8.py tests/kernels/test_mla_seesaw_fp8.py 2>&1 | grep -v Warning > $OUT/kernels_full.txt
grep -E "passed|failed|FAILED|Error" $OUT/kernels_full.txt | tail -20 | tee $OUT/kernels.txt
PORTATTN_TEST_ENGINE_DEVICE=cuda PYTHONPATH=src:tests timeout ${T2:-200} python3 -m pytest -q -p no:cacheprovider -n 4 \
  -rA tests/engine/test_fp8_engine.py tests/engine/test_pdl_gpu.py 2>&1 | grep -v Warning > $OUT/engine_full.txt
grep -E "passed|failed|FAILED|Error" $OUT/engine_full.txt | tail -20 | tee $OUT/engine.txt
