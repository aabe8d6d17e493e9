#!/usr/bin/env bash
# Round 51's device calls.
#   OUT=... bash benchmarks/results/round51/scripts/r51.sh alt   # the alternating form: a smoke run, its GPU tests,
#                                                               # then timed against the warp-specialized form twice
#   OUT=... bash benchmarks/results/round51/scripts/r51.sh packed  # the fp8 producer's packed loads: tests, then A/B
#   OUT=... bash benchmarks/results/round51/scripts/r51.sh cg      # both producers' loads with and without .cg
#   OUT=... bash benchmarks/results/round51/scripts/r51.sh ncu     # Nsight Compute: the packed and the earlier producer
#   OUT=... bash benchmarks/results/round51/scripts/r51.sh splits  # 17-32 heads over e4m3 at one and two programs an SM
#   OUT=... bash benchmarks/results/round51/scripts/r51.sh final   # the committed tree: GPU tests, the default path timed
#   OUT=... bash benchmarks/results/round51/scripts/r51.sh splits16  # 16 heads over fp8 at one and two programs an SM
#   OUT=... bash benchmarks/results/round51/scripts/r51.sh alone   # both forms' consumers alone (the patch applied);
#                                                               # SIDES=PA_NOCONSUME=1: their producers alone
set -f
R=benchmarks/results
case "${1:-}" in
  alt)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src timeout 90 python3 scripts/ncu_mla.py e4m3 --heads 64 --alternate --time 2>&1 | grep -v Warning |
      tee $OUT/smoke.txt
    [ ${PIPESTATUS[0]} = 0 ] || { echo "smoke run failed or hung"; exit 1; }
    PYTHONPATH=src:tests timeout ${T2:-200} python3 -m pytest -q -p no:cacheprovider -rf -x -k alternate \
      tests/kernels/test_mla_wide.py 2>&1 | tail -n 12 | tee $OUT/tests.txt
    for round in 1 2; do
      echo "== round $round" | tee -a $OUT/alt_times.txt
      PYTHONPATH=src timeout ${T3:-110} python3 $R/round46/scripts/mla_many.py $R/round51/scripts/${CASES:-alt_cases.txt} \
        $(( ${T3:-110} - 15 )) 2>&1 | grep -v Warning | tee -a $OUT/alt_times.txt
    done ;;
  packed)  # the fp8 producer's packed loads (scripts/packed_producer.patch, applied): its GPU tests, then timed
           # against the earlier producer (the patch reversed) alternately, twice each
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src timeout 90 python3 scripts/ncu_mla.py e4m3 --heads 64 --time 2>&1 | grep -v Warning | tee $OUT/smoke.txt
    [ ${PIPESTATUS[0]} = 0 ] || { echo "smoke run failed or hung"; exit 1; }
    PYTHONPATH=src:tests timeout ${T2:-270} python3 -m pytest -q -p no:cacheprovider -rf -x -k "not plain" \
      tests/kernels/test_mla_wide.py tests/ops/test_mla.py 2>&1 | tail -n 12 | tee $OUT/tests.txt
    for round in 1 2; do
      for form in packed earlier; do
        [ $form = earlier ] && { git apply -R $R/round51/scripts/packed_producer.patch || exit 1; }
        echo "== $form ($round)" | tee -a $OUT/packed_times.txt
        PYTHONPATH=src timeout 70 python3 $R/round46/scripts/mla_many.py $R/round51/scripts/packed_cases.txt 55 2>&1 |
          grep -v Warning | tee -a $OUT/packed_times.txt
        [ $form = earlier ] && git apply $R/round51/scripts/packed_producer.patch
      done
    done ;;
  cg)  # the producers' global loads cached in L1 (default) or not (.cg), the packed producer
       # (scripts/packed_producer_cache_modifier.patch, applied) and the earlier one (earlier_cache_modifier.patch)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    P=$R/round51/scripts
    for round in ${ROUNDS:-1 2}; do
      for form in packed earlier; do
        [ $form = earlier ] && { git apply -R $P/packed_producer_cache_modifier.patch && git apply $P/earlier_cache_modifier.patch || exit 1; }
        for cg in default .cg; do
          echo "== $form, loads $cg ($round)" | tee -a $OUT/cg_times.txt
          PA_CG=$([ $cg = .cg ] && echo .cg) PYTHONPATH=src timeout 60 python3 $R/round46/scripts/mla_many.py \
            $P/cg_cases.txt 45 2>&1 | grep -v Warning | tee -a $OUT/cg_times.txt
        done
        [ $form = earlier ] && { git apply -R $P/earlier_cache_modifier.patch && git apply $P/packed_producer_cache_modifier.patch || exit 1; }
      done
    done ;;
  ncu)  # Nsight Compute of the e4m3 64-head step, the packed producer (applied) and the earlier one: sections and
        # stall summaries (round50/scripts/stalls.py), the reports themselves left on the machine
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    P=$R/round51/scripts
    N="ncu --clock-control none --kernel-name regex:mla_decode_wide --launch-skip 3 --launch-count 1
       --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats
       --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section SourceCounters
       --import-source no"
    mkdir -p /tmp/ncu51
    for form in packed earlier; do
      [ $form = earlier ] && { git apply -R $P/packed_producer_cache_modifier.patch && git apply $P/earlier_cache_modifier.patch || exit 1; }
      PYTHONPATH=src timeout 120 $N -o /tmp/ncu51/$form -f python3 scripts/ncu_mla.py e4m3 --heads 64 > /dev/null 2>&1
      ncu --import /tmp/ncu51/$form.ncu-rep > /tmp/ncu51/ncu_$form.txt 2>&1
      ncu --import /tmp/ncu51/$form.ncu-rep --page source --csv --print-source sass > /tmp/ncu51/sass_$form.csv 2>&1
      echo "== $form: $(grep -E 'Duration|DRAM Throughput|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Warp Cycles Per Issued' \
        /tmp/ncu51/ncu_$form.txt | tr -s ' ' | tr '\n' ';')" | tee -a $OUT/ncu_summary.txt
      [ $form = earlier ] && { git apply -R $P/earlier_cache_modifier.patch && git apply $P/packed_producer_cache_modifier.patch || exit 1; }
    done
    python3 $R/round50/scripts/stalls.py /tmp/ncu51 > $OUT/stalls.txt 2>&1
    (cd /tmp/ncu51 && tar czf $OUT/ncu_text.tgz ncu_*.txt) ;;
  splits)  # the committed tree (the packed producer reversed): 17-32 heads over e4m3 at one and two programs an SM
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    git apply -R $R/round51/scripts/packed_producer_cache_modifier.patch || exit 1
    for round in 1 2; do
      echo "== round $round" | tee -a $OUT/splits_times.txt
      PYTHONPATH=src timeout 170 python3 $R/round46/scripts/mla_many.py $R/round51/scripts/splits_cases.txt 155 2>&1 |
        grep -v Warning | tee -a $OUT/splits_times.txt
    done
    git apply $R/round51/scripts/packed_producer_cache_modifier.patch ;;
  final)  # the committed tree: the fp8_mma kernel's GPU tests and the MLA op's, then the default path timed twice
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src:tests timeout ${T2:-200} python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_mla_fp8_mma.py \
      tests/ops/test_mla.py 2>&1 | tail -n 12 | tee $OUT/tests.txt
    for round in 1 2; do
      echo "== round $round" | tee -a $OUT/final_times.txt
      PYTHONPATH=src timeout 110 python3 $R/round46/scripts/mla_many.py $R/round51/scripts/final_cases.txt 100 2>&1 |
        grep -v Warning | tee -a $OUT/final_times.txt
    done ;;
  splits16)  # the committed tree: 16 heads over fp8 at one and two programs an SM
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    for round in 1 2; do
      echo "== round $round" | tee -a $OUT/splits16_times.txt
      PYTHONPATH=src timeout 75 python3 $R/round46/scripts/mla_many.py $R/round51/scripts/splits16_cases.txt 65 2>&1 |
        grep -v Warning | tee -a $OUT/splits16_times.txt
    done ;;
  alone)  # scripts/alternating_consumers_v2_noload.patch applied: each form's consumers alone, then with the loads
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    for side in ${SIDES:-PA_NOLOAD=1 PA_NOLOAD=0}; do  # PA_NOCONSUME=1 (alternating_consumers_v2_alone.patch): the producer
      echo "== $side" | tee -a $OUT/alone_times.txt
      env $side PYTHONPATH=src timeout 75 python3 $R/round46/scripts/mla_many.py $R/round51/scripts/alone_cases.txt \
        65 2>&1 | grep -v Warning | tee -a $OUT/alone_times.txt
    done ;;
  *) echo "expected one of alt, packed, cg, ncu, splits, final, splits16, alone, got '${1:-}'"; exit 2 ;;
esac
