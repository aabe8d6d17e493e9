#!/usr/bin/env bash
# Round 50's device calls.
#   OUT=... bash benchmarks/results/round50/scripts/r50.sh serve     # carry .whl: issue 23 target 3 (round 49's)
#   OUT=... bash benchmarks/results/round50/scripts/r50.sh prefetch  # the L2 prefetch timed, then its GPU tests
#                                                                     # (scripts/l2_prefetch.patch applied to 63d9ee7)
#   OUT=... bash benchmarks/results/round50/scripts/r50.sh ncu       # Nsight Compute: where the 32- and 64-head
#                                                                     # fp8 steps and the bf16 ones wait
#   OUT=... bash benchmarks/results/round50/scripts/r50.sh conflict  # the fp8 producer's conflict-free stores timed,
#                                                                     # then the wide kernel's GPU tests
#   OUT=... bash benchmarks/results/round50/scripts/r50.sh ab        # the conflict-free stores and the earlier ones
#                                                                     # alternately, twice each, in one call
#   OUT=... bash benchmarks/results/round50/scripts/r50.sh ncu_import  # carry .ncu (ncu's reports): summarised
set -f
R=benchmarks/results
case "${1:-}" in
  serve) OUT=$OUT bash $R/round49/scripts/r49.sh serve ;;
  prefetch)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src timeout ${T1:-170} python3 $R/round46/scripts/mla_many.py $R/round50/scripts/${CASES:-prefetch_cases.txt} \
      $(( ${T1:-170} - 20 )) 2>&1 | grep -v Warning | tee $OUT/prefetch_times.txt
    PYTHONPATH=src:tests timeout ${T2:-240} python3 -m pytest -q -p no:cacheprovider -rf -k prefetch \
      tests/kernels/test_mla_wide.py tests/kernels/test_mla_fp8_mma.py 2>&1 | tail -n 8 | tee $OUT/tests.txt ;;
  conflict)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src timeout 150 python3 $R/round46/scripts/mla_many.py $R/round50/scripts/${CASES:-conflict_cases.txt} 130 2>&1 |
      grep -v Warning | tee $OUT/conflict_times.txt
    PYTHONPATH=src:tests timeout 240 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_mla_wide.py \
      tests/ops/test_mla.py 2>&1 | tail -n 8 | tee $OUT/tests.txt ;;
  ab)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    for round in 1 2; do
      for form in new old; do
        [ $form = old ] && { git apply -R $R/round50/scripts/conflict_free_stores.patch || exit 1; }
        echo "== $form ($round)" | tee -a $OUT/ab_times.txt
        PYTHONPATH=src timeout 60 python3 $R/round46/scripts/mla_many.py $R/round50/scripts/ab_cases.txt 50 2>&1 |
          grep -v Warning | tee -a $OUT/ab_times.txt
        [ $form = old ] && git apply $R/round50/scripts/conflict_free_stores.patch
      done
    done ;;
  ncu)  # (a call brings back at most 8 files: the reports, then `ncu_import` over them, carrying .ncu)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    N="ncu --clock-control none --kernel-name regex:mla_decode_(wide|fp8_mma) --launch-skip 3 --launch-count 1
       --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats
       --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats
       --section SourceCounters --import-source no
       --metrics regex:sm__(inst_executed_pipe_|pipe_).*avg\.pct_of_peak_sustained_active"
    export PYTHONPATH=src
    for run in "e4m3_64:e4m3 --heads 64" "bf16_64:bf16 --heads 64" "e4m3_32:e4m3 --heads 32" "e4m3_16:e4m3 --heads 16" \
               "e4m3_128:e4m3 --heads 128"; do
      timeout 100 $N -o $OUT/${run%%:*} -f python3 scripts/ncu_mla.py ${run#*:} > /dev/null 2>&1
    done ;;
  ncu_import)  # the reports of `ncu` (in .ncu): each one's sections and SASS page, summarised
    set +f
    mkdir -p /tmp/ncu_text
    for rep in .ncu/*.ncu-rep; do
      name=$(basename $rep .ncu-rep)
      ncu --import $rep > /tmp/ncu_text/ncu_$name.txt 2>&1
      ncu --import $rep --page source --csv --print-source sass > /tmp/ncu_text/sass_$name.csv 2>&1
      echo "== $name: $(grep -E 'Duration|Warp Cycles Per Issued|Issued Warp Per Scheduler|DRAM Throughput' \
        /tmp/ncu_text/ncu_$name.txt | tr -s ' ' | tr '\n' ';')"
    done
    python3 benchmarks/results/round50/scripts/stalls.py /tmp/ncu_text > $OUT/stalls.txt 2>&1
    (cd /tmp/ncu_text && tar czf $OUT/ncu_text.tgz ncu_*.txt && tar czf $OUT/sass.tgz sass_*.csv) ;;
  *) echo "expected one of serve, prefetch, conflict, ab, ncu, ncu_import, got '${1:-}'"; exit 2 ;;
esac
