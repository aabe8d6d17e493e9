#!/usr/bin/env bash
# Round 53's device calls.
#   OUT=... bash benchmarks/results/round53/scripts/r53.sh tma [CASES]  # the fp8-scores form's GPU tests (TMA and
#       cp.async copies, errors printed), then CASES (default tma_cases.txt) timed twice
#   OUT=... bash benchmarks/results/round53/scripts/r53.sh alone [CASES]  # scripts/alone.patch applied (prepared, not
#       run): CASES (default alone_cases.txt) once for each environment in SIDES (';' between them, ',' inside one:
#       PA_NOCONSUME=1 the producer alone, PA_NOLOAD=1 the consumers alone, PA_NOCONVERT=1 the copies and consumers
#       without the values' conversion or transposition, PA_NOLOAD=0 both)
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
  alone)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    IFS=';' read -ra sides <<< "${SIDES:-PA_NOCONSUME=1;PA_NOLOAD=1;PA_NOCONVERT=1;PA_NOLOAD=0}"
    for side in "${sides[@]}"; do
      echo "== $side" | tee -a $OUT/alone_times.txt
      env ${side//,/ } PYTHONPATH=src timeout ${T:-75} python3 $R/round53/scripts/tma_many.py \
        $R/round53/scripts/${2:-alone_cases.txt} $(( ${T:-75} - 10 )) 2>&1 | grep -v Warning | tee -a $OUT/alone_times.txt
    done ;;
  *) echo "expected tma or alone, got '${1:-}'"; exit 2 ;;
esac
