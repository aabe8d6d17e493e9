#!/usr/bin/env bash
# Round 52's device calls (the tree as the call's notes say: a patch of scripts/ applied or not).
#   OUT=... bash benchmarks/results/round52/scripts/r52.sh alone CASES  # scripts/alone_regs.patch applied: the cases
#       once for each environment in SIDES (';' between them, ',' inside one: PA_NOCONSUME=1 the producers alone,
#       PA_NOLOAD=1 the consumers alone, PA_ALTREGS=208 the alternating consumers' registers)
#   OUT=... bash benchmarks/results/round52/scripts/r52.sh fp8s  # the fp8-scores form: smoke run, errors, GPU tests,
#       timed twice
#   OUT=... bash benchmarks/results/round52/scripts/r52.sh errors  # fp8_scores_errors.py for each of SIDES
#   OUT=... bash benchmarks/results/round52/scripts/r52.sh ncu  # Nsight Compute of the fp8-scores form, 64 heads
#   OUT=... bash benchmarks/results/round52/scripts/r52.sh final  # GPU tests, then final_cases.txt timed twice
#   OUT=... bash benchmarks/results/round52/scripts/r52.sh final2  # the fp8-scores tests (errors printed), timed
#   OUT=... bash benchmarks/results/round52/scripts/r52.sh next  # prepared, not run: the fp8-values form's tests, timed
set -f
R=benchmarks/results
case "${1:-}" in
  alone)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    IFS=';' read -ra sides <<< "${SIDES:-PA_NOCONSUME=1;PA_NOLOAD=1;PA_NOLOAD=0}"
    for side in "${sides[@]}"; do
      echo "== $side" | tee -a $OUT/alone_times.txt
      env ${side//,/ } PYTHONPATH=src timeout ${T:-75} python3 $R/round46/scripts/mla_many.py $R/round52/scripts/$2 \
        $(( ${T:-75} - 10 )) 2>&1 | grep -v Warning | tee -a $OUT/alone_times.txt
    done ;;
  fp8s)  # the fp8-scores form: a smoke run, its errors, its GPU tests, then timed (fp8_scores_cases.txt) twice
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src timeout 90 python3 scripts/ncu_mla.py e4m3 --heads 64 --fp8-scores --time 2>&1 | grep -v Warning |
      tee $OUT/smoke.txt
    [ ${PIPESTATUS[0]} = 0 ] || { echo "smoke run failed or hung"; exit 1; }
    PYTHONPATH=src:tests timeout 120 python3 $R/round52/scripts/fp8_scores_errors.py 2>&1 | grep -v Warning |
      tee $OUT/errors.txt
    PYTHONPATH=src:tests timeout ${T2:-150} python3 -m pytest -q -p no:cacheprovider -rf -x -k fp8_scores \
      tests/kernels/test_mla_wide_fp8.py 2>&1 | tail -n 15 | tee $OUT/tests.txt
    for round in 1 2; do
      echo "== round $round" | tee -a $OUT/fp8s_times.txt
      PYTHONPATH=src timeout ${T3:-100} python3 $R/round46/scripts/mla_many.py $R/round52/scripts/${CASES:-fp8_scores_cases.txt} \
        $(( ${T3:-100} - 10 )) 2>&1 | grep -v Warning | tee -a $OUT/fp8s_times.txt
    done ;;
  errors)  # the errors script once for each environment in SIDES (as alone's)
    IFS=';' read -ra sides <<< "${SIDES:-PA_IMPRECISE=0}"
    for side in "${sides[@]}"; do
      echo "== $side" | tee -a $OUT/errors.txt
      env ${side//,/ } PYTHONPATH=src:tests timeout 100 python3 $R/round52/scripts/fp8_scores_errors.py 2>&1 |
        grep -v Warning | tee -a $OUT/errors.txt
    done ;;
  ncu)  # Nsight Compute of the fp8-scores form's e4m3 64-head step: sections and stall summaries
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    N="ncu --clock-control none --kernel-name regex:mla_decode_wide --launch-skip 3 --launch-count 1
       --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats
       --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section SourceCounters
       --import-source no"
    mkdir -p /tmp/ncu52
    PYTHONPATH=src timeout 150 $N -o /tmp/ncu52/fp8s -f python3 scripts/ncu_mla.py e4m3 --heads 64 --fp8-scores > /dev/null 2>&1
    ncu --import /tmp/ncu52/fp8s.ncu-rep > /tmp/ncu52/ncu_fp8s.txt 2>&1
    ncu --import /tmp/ncu52/fp8s.ncu-rep --page source --csv --print-source sass > /tmp/ncu52/sass_fp8s.csv 2>&1
    grep -E 'Duration|DRAM Throughput|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Warp Cycles Per Issued' \
      /tmp/ncu52/ncu_fp8s.txt | tee $OUT/ncu_summary.txt
    python3 $R/round50/scripts/stalls.py /tmp/ncu52 > $OUT/stalls.txt 2>&1
    (cd /tmp/ncu52 && tar czf $OUT/ncu_text.tgz ncu_fp8s.txt) ;;  # by name: set -f keeps globs from expanding
  final)  # the committed tree: the fp8-scores form's GPU tests, the MLA op's, then final_cases.txt timed twice
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src:tests timeout ${T2:-200} python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_mla_wide_fp8.py \
      tests/ops/test_mla.py 2>&1 | tail -n 12 | tee $OUT/tests.txt
    for round in 1 2; do
      echo "== round $round" | tee -a $OUT/final_times.txt
      PYTHONPATH=src timeout ${T3:-100} python3 $R/round46/scripts/mla_many.py $R/round52/scripts/final_cases.txt \
        $(( ${T3:-100} - 10 )) 2>&1 | grep -v Warning | tee -a $OUT/final_times.txt
    done ;;
  final2|next)  # the fp8-scores form's tests (errors printed), then the mode's cases timed twice. final2 (call 10):
                # final2_cases.txt; next (prepared for the next session, not run): fp8_scores_form,
                # power_of_two_scale and fp8_values patches applied, next_cases.txt
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src:tests timeout 200 python3 -m pytest -q -s -p no:cacheprovider -rf tests/kernels/test_mla_wide_fp8.py \
      2>&1 | grep -v Warning | grep -E "splits:|passed|failed|Error" | tee $OUT/tests.txt
    L=$([ $1 = next ] && echo 90 || echo 60)  # seconds a round (call 10 ran final2 at 60)
    for round in 1 2; do
      echo "== round $round" | tee -a $OUT/$1_times.txt
      PYTHONPATH=src timeout $L python3 $R/round46/scripts/mla_many.py $R/round52/scripts/$1_cases.txt $(( L - 10 )) \
        2>&1 | grep -v Warning | tee -a $OUT/$1_times.txt
    done ;;
  *) echo "expected one of alone, fp8s, errors, ncu, final, final2, next, got '${1:-}'"; exit 2 ;;
esac
