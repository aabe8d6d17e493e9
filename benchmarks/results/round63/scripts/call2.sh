#!/usr/bin/env bash
# Round 63's second call (under 10 minutes): OUT=... bash benchmarks/results/round63/scripts/call2.sh
#   1. cases2.txt timed: both forms alternated, with the cache in the L2 and from DRAM, the bf16 cache beside;
#   2. the fp8 MLA GPU tests with PAIR_MAX on (the seesaw kernel's fp8-values test and the default's choice);
#   3. trace.patch applied, trace.py: clock64 stamps of both forms' partitions.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round63/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout 200 python3 scripts/mla_times.py $S/cases2.txt 180 2>&1 | grep -v Warning | tee $OUT/times.txt
PYTHONPATH=src:tests timeout 200 python3 -c "
import sys, pytest
from portattn.kernels.triton import mla_decode_seesaw_fp8
mla_decode_seesaw_fp8.PAIR_MAX = True
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/kernels/test_mla_fp8_scores_default.py',
  'tests/kernels/test_mla_wide_fp8.py::test_fp8_values_within_the_bound_of_their_probabilities_rounding']))
" 2>&1 | grep -v Warning | tail -30 | tee $OUT/tests.txt
patch -p1 < $S/trace.patch && PYTHONPATH=src OUT=$OUT timeout 150 python3 $S/trace.py $OUT 2>&1 | grep -v Warning \
  | tee $OUT/trace.txt
