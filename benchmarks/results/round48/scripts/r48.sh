#!/usr/bin/env bash
# Round 48's device calls, issued one after another on a warm machine.
#   OUT=... bash benchmarks/results/round48/scripts/r48.sh ws      # the wide kernel's warp-specialized form: its GPU
#                                                                   # tests, then timed beside the plain form
#   OUT=... bash benchmarks/results/round48/scripts/r48.sh splits  # round 47's split-count timing
#   OUT=... bash benchmarks/results/round48/scripts/r48.sh serve   # carry .whl: issue 23 target 3 (burst, Poisson 16)
#   OUT=... bash benchmarks/results/round48/scripts/r48.sh all     # carry .whl: serve where an H200 came; else the
#                                                                   # wide kernel's GPU tests, the default path timed,
#                                                                   # both forms by heads and batch, the split counts
set -f
R=benchmarks/results
case "${1:-}" in
  ws)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src:tests timeout ${T2:-200} python3 -m pytest -q -p no:cacheprovider -x -rf tests/kernels/test_mla_wide.py \
      -k "${K:-producer}" 2>&1 | tail -n 15 | tee $OUT/tests.txt
    PYTHONPATH=src timeout ${T1:-150} python3 $R/round46/scripts/mla_many.py $R/round48/scripts/${CASES:-ws_cases.txt} \
      $(( ${T1:-150} - 20 )) 2>&1 | grep -v Warning | tee $OUT/ws_times.txt ;;
  splits) OUT=$OUT bash $R/round47/scripts/r47.sh splits ;;
  serve) OUT=$OUT bash $R/round45/scripts/r45.sh serve ;;
  all)
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1); echo "$gpu" | tee $OUT/gpu.txt
    case "$gpu" in *H200*) OUT=$OUT bash $0 serve; exit $? ;; esac
    PYTHONPATH=src:tests timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_mla_wide.py \
      2>&1 | tail -n 8 | tee $OUT/tests.txt
    PYTHONPATH=src timeout 100 python3 $R/round46/scripts/mla_many.py $R/round48/scripts/default_cases.txt 90 2>&1 |
      grep -v Warning | tee $OUT/default_times.txt
    PYTHONPATH=src timeout 100 python3 $R/round46/scripts/mla_many.py $R/round48/scripts/ws_cases2.txt 90 2>&1 |
      grep -v Warning | tee $OUT/ws_times2.txt
    T1=50 OUT=$OUT bash $R/round47/scripts/r47.sh splits ;;
  *) echo "expected one of ws, splits, serve, all, got '${1:-}'"; exit 2 ;;
esac
