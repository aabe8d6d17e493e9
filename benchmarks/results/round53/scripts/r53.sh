#!/usr/bin/env bash
# Round 53's device calls.
#   OUT=... bash benchmarks/results/round53/scripts/r53.sh tma [CASES]  # the fp8-scores form's GPU tests (TMA and
#       cp.async copies, errors printed), then CASES (default tma_cases.txt) timed twice
set -f
R=benchmarks/results
case "${1:-}" in
  tma)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src:tests timeout ${T2:-240} python3 -m pytest -q -s -x -p no:cacheprovider -rf \
      tests/kernels/test_mla_wide_fp8.py 2>&1 | grep -v Warning | grep -E "splits|passed|failed|Error|error" |
      tail -n 80 | tee $OUT/tests.txt
    for round in 1 2; do
      echo "== round $round" | tee -a $OUT/tma_times.txt
      PYTHONPATH=src timeout ${T3:-90} python3 $R/round53/scripts/tma_many.py $R/round53/scripts/${2:-tma_cases.txt} \
        $(( ${T3:-90} - 10 )) 2>&1 | grep -v Warning | tee -a $OUT/tma_times.txt
    done ;;
  *) echo "expected tma, got '${1:-}'"; exit 2 ;;
esac
