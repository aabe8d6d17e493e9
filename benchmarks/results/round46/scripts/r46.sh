#!/usr/bin/env bash
# Round 46's device calls, issued one after another on a warm machine.
#   OUT=... bash benchmarks/results/round46/scripts/r46.sh first   # no carry: fp8 MLA tiles of 32 and 64 heads, timed, tested
#   OUT=... bash benchmarks/results/round46/scripts/r46.sh default32 # no carry: 32-head fp8_mma tiles as the default
#   OUT=... bash benchmarks/results/round46/scripts/r46.sh regs    # no carry: 32-head tiles on four warps, timed, tested
#   OUT=... bash benchmarks/results/round46/scripts/r46.sh serve   # carry .whl: issue 23 target 3 (burst, Poisson 16)
#   OUT=... bash benchmarks/results/round46/scripts/r46.sh auto    # carry .whl: the next of these not yet run on this
#                                                                   # warm machine (an H200 serves first), then stops
set -f
R=benchmarks/results
case "${1:-}" in
  auto)
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
    steps=${STEPS:-"first default32"}; case "$gpu" in *H200*) steps="serve $steps" ;; esac
    for step in $steps; do
      [ -e /tmp/r46_done_$step ] && continue
      echo "$gpu: $step" | tee $OUT/step.txt; touch /tmp/r46_done_$step
      OUT=$OUT bash $0 $step; exit $?
    done
    echo "$gpu: every step has run" ;;
  first)
    nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $OUT/gpu.txt
    # the timings alone on the GPU, then the tests: the 32- and 64-head fp8_mma tiles, the wide kernel's split cut
    PYTHONPATH=src timeout 340 python3 $R/round46/scripts/mla_many.py $R/round46/scripts/mla_cases.txt 300 2>&1 |
      grep -v Warning | tee $OUT/mla_times.txt
    PYTHONPATH=src:tests timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_fp8_mma.py \
      tests/kernels/test_mla_wide.py -k "head_blocks or launcher_passes or fewer_splits or wide" 2>&1 | tail -n 12 |
      tee $OUT/tests.txt ;;
  default32)
    # the 32-head tiles as the default for 17-32 heads of 32 sequences or more (FP8_MMA_32_HEAD_MIN_BATCH; the
    # tree as committed; round46/fp8_mma_32_default.patch was this call's first form, without the batch rule)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src timeout 150 python3 $R/round46/scripts/mla_many.py $R/round46/scripts/mla_cases_default.txt 120 \
      2>&1 | grep -v Warning | tee $OUT/mla_default_times.txt
    PYTHONPATH=src:tests timeout 280 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_fp8_mma.py \
      tests/ops/test_mla.py -k "test_mla or default or head_blocks" 2>&1 | tail -n 6 | tee $OUT/tests.txt ;;
  regs)
    # two 16-head groups on four warps (group_regs), timed, then their GPU tests and the default path's
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src timeout $(( ${T1:-100} + 15 )) python3 $R/round46/scripts/mla_many.py $R/round46/scripts/mla_cases_regs.txt \
      ${T1:-100} 2>&1 | grep -v Warning | tee $OUT/mla_regs_times.txt
    PYTHONPATH=src:tests timeout ${T2:-130} python3 -m pytest -q -p no:cacheprovider $(cat $R/round46/scripts/regs_tests.txt) \
      tests/kernels/test_mla_fp8_mma.py::test_the_default_tiles_of_24_heads_over_40_sequences_give_the_reference \
      2>&1 | tail -n 6 | tee $OUT/tests.txt ;;
  batch)
    PYTHONPATH=src timeout 150 python3 $R/round46/scripts/mla_many.py $R/round46/scripts/mla_cases_batch.txt 120 \
      2>&1 | grep -v Warning | tee $OUT/mla_batch_times.txt ;;
  serve)
    OUT=$OUT bash $R/round45/scripts/r45.sh serve ;;
  *) echo "expected one of auto, first, default32, regs, batch, serve, got '${1:-}'"; exit 2 ;;
esac
