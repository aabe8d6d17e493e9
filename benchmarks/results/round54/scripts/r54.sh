#!/usr/bin/env bash
# Round 54's device calls.
#   OUT=... bash benchmarks/results/round54/scripts/r54.sh first  # cases.txt timed once, the fp8-scores form's
#       GPU tests (errors printed), then (alone.patch applied to the tree) alone_cases.txt once for each side in
#       SIDES (';' between them: the producer alone, the consumers alone, the step without the values' conversion)
#   OUT=... bash benchmarks/results/round54/scripts/r54.sh time [CASES] [ROUNDS]  # CASES (default cases.txt) timed
set -f
R=benchmarks/results
S=$R/round54/scripts
many() {  # CASES SECONDS: the cases timed (many.py: the prefixes cp.async, pipe, seesaw)
  PYTHONPATH=src timeout $2 python3 $S/many.py $S/$1 $(( $2 - 8 )) 2>&1 | grep -v Warning
}
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
case "${1:-}" in
  first)
    many cases.txt ${T3:-90} | tee $OUT/times.txt
    PYTHONPATH=src:tests timeout ${T2:-200} python3 -m pytest -q -s -x -p no:cacheprovider -rf -k "not compiles" \
      tests/kernels/test_mla_wide_fp8.py 2>&1 | grep -v Warning | grep -E "splits|passed|failed|Error|error" |
      tail -n 150 > $OUT/tests.txt
    tail -n 3 $OUT/tests.txt
    patch -p1 < $S/alone.patch
    IFS=';' read -ra sides <<< "${SIDES:-PA_NOCONSUME=1;PA_NOLOAD=1;PA_NOCONVERT=1}"
    for side in "${sides[@]}"; do
      echo "== $side" | tee -a $OUT/alone_times.txt
      env ${side//,/ } bash -c "$(declare -f many); R=$R S=$S; many alone_cases.txt ${T:-60}" | tee -a $OUT/alone_times.txt
    done ;;
  time)
    for round in $(seq ${3:-2}); do
      echo "== round $round" | tee -a $OUT/times.txt
      many ${2:-cases.txt} ${T3:-90} | tee -a $OUT/times.txt
    done ;;
  *) echo "expected first or time, got '${1:-}'"; exit 2 ;;
esac
