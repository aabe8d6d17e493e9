#!/usr/bin/env bash
# Round 47's device calls, issued one after another on a warm machine.
#   OUT=... bash benchmarks/results/round47/scripts/r47.sh regs64  # no carry: group_regs at 64 keys a step, timed by
#                                                                   # batch and heads, then its GPU tests
#   OUT=... bash benchmarks/results/round47/scripts/r47.sh default # no carry: the new default path timed and tested
#   OUT=... bash benchmarks/results/round47/scripts/r47.sh splits  # no carry: the default tiles at 1-2 programs an SM
#   OUT=... bash benchmarks/results/round47/scripts/r47.sh serve   # carry .whl: issue 23 target 3 (burst, Poisson 16)
#   OUT=... bash benchmarks/results/round47/scripts/r47.sh auto    # carry .whl: serve first where an H200 came, then
#                                                                   # STEPS (default splits), one a call
set -f
R=benchmarks/results
case "${1:-}" in
  auto)
    # the next step not yet run on this warm machine: serve first where an H200 came, then STEPS
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
    steps=${STEPS:-"splits"}; case "$gpu" in *H200*) steps="serve $steps" ;; esac
    for step in $steps; do
      [ -e /tmp/r47_done_$step ] && continue
      echo "$gpu: $step" | tee $OUT/step.txt; touch /tmp/r47_done_$step
      OUT=$OUT bash $0 $step; exit $?
    done
    echo "$gpu: every step has run" ;;
  regs64)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src timeout $(( ${T1:-150} + 15 )) python3 $R/round46/scripts/mla_many.py \
      $R/round47/scripts/mla_cases_regs64.txt ${T1:-150} 2>&1 | grep -v Warning | tee $OUT/mla_regs64_times.txt
    PYTHONPATH=src:tests timeout ${T2:-200} python3 -m pytest -q -p no:cacheprovider -rf $(cat ${TESTS:-$R/round47/scripts/tests.txt}) \
      2>&1 | tail -n 8 | tee $OUT/tests.txt ;;
  default)
    # the default path with group_regs as the 17-32-head default from 16 sequences, then its tests
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src timeout 150 python3 $R/round46/scripts/mla_many.py $R/round46/scripts/mla_cases_default.txt 120 \
      2>&1 | grep -v Warning | tee $OUT/mla_default_times.txt
    PYTHONPATH=src:tests timeout ${T2:-200} python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_mla_fp8_mma.py \
      tests/ops/test_mla.py -k "default or launcher or fp8_cache or head_blocks" 2>&1 | tail -n 8 | tee $OUT/tests.txt ;;
  splits)
    # the default tiles at one and two programs an SM
    PYTHONPATH=src timeout ${T1:-150} python3 $R/round46/scripts/mla_many.py $R/round47/scripts/mla_cases_splits.txt \
      $(( ${T1:-150} - 20 )) 2>&1 | grep -v Warning | tee $OUT/mla_splits_times.txt ;;
  serve)
    OUT=$OUT bash $R/round45/scripts/r45.sh serve ;;
  *) echo "expected one of auto, regs64, default, splits, serve, got '${1:-}'"; exit 2 ;;
esac
