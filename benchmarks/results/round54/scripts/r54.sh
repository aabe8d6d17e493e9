#!/usr/bin/env bash
# Round 54's device calls.
#   OUT=... bash benchmarks/results/round54/scripts/r54.sh first  # cases.txt timed once, the fp8-scores form's
#       GPU tests (errors printed), then (alone.patch applied to the tree) alone_cases.txt once for each side in
#       SIDES (';' between them: the producer alone, the consumers alone, the step without the values' conversion)
#   OUT=... bash benchmarks/results/round54/scripts/r54.sh time [CASES] [ROUNDS]  # CASES (default cases.txt) timed
#   OUT=... bash benchmarks/results/round54/scripts/r54.sh last  # the fp8-values tests of the cases new this round
#       (the seesaw kernel at page 16 and 8), the producer's copies alone timed (alone.patch, PA_NOCONSUME=1 and
#       PA_NOCONVERT=1), then Nsight Compute of the producer alone (PA_NOCONSUME=1), 64 heads over e4m3
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
  last)
    PYTHONPATH=src:tests timeout ${T2:-100} python3 -m pytest -q -s -p no:cacheprovider -rf \
      -k "fp8_values and (16-64-100 or 8-64-40)" tests/kernels/test_mla_wide_fp8.py 2>&1 | grep -v Warning |
      grep -E "splits|passed|failed|Error|error" | tee $OUT/tests_last.txt | tail -n 3
    patch -p1 < $S/alone.patch > /dev/null
    echo "== PA_NOCONSUME=1 PA_NOCONVERT=1" | tee $OUT/copy_times.txt
    env PA_NOCONSUME=1 PA_NOCONVERT=1 bash -c "$(declare -f many); R=$R S=$S; many copy_cases.txt 40" |
      tee -a $OUT/copy_times.txt
    [ "${NCU:-1}" = 1 ] || exit 0  # NCU=0: no profile
    N="ncu --clock-control none --kernel-name regex:mla_decode_wide --launch-skip 3 --launch-count 1
       --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters
       --import-source no"
    mkdir -p /tmp/ncu54
    PA_NOCONSUME=1 PYTHONPATH=src timeout ${T:-150} $N -o /tmp/ncu54/producer -f python3 scripts/ncu_mla.py e4m3 \
      --heads 64 --fp8-scores > /dev/null 2>&1
    ncu --import /tmp/ncu54/producer.ncu-rep > $OUT/ncu_producer.txt 2>&1
    ncu --import /tmp/ncu54/producer.ncu-rep --page source --csv --print-source sass > $OUT/sass_producer.csv 2>&1
    grep -E 'Duration|DRAM Throughput|Mem Busy|Max Bandwidth|Warp Cycles Per Issued' $OUT/ncu_producer.txt ;;
  *) echo "expected first, time or last, got '${1:-}'"; exit 2 ;;
esac
