#!/usr/bin/env bash
# Round 55's device calls, issue 24 item 1.
#   OUT=... bash benchmarks/results/round55/scripts/r55.sh all  # about 8 minutes:
#     1. round54's next_cases.txt timed once (more fp8 bytes in flight: 32-key tiles in six or eight slots, fp8
#        values beside four 64-key slots), with the default and the bf16 cache;
#     2. round54's `last`: the seesaw kernel's GPU tests at pages 16 and 8, the producer's copies alone, Nsight
#        Compute of the producer alone at 64 heads (NCU=0 skips it);
#     3. the consumers alone (round54's alone.patch, applied by 2, and seesaw_alone.patch; PA_NOLOAD=1):
#        alone_cases.txt.
#   OUT=... bash benchmarks/results/round55/scripts/r55.sh ncu  # about 3 minutes: Nsight Compute of the whole
#     kernel at 128 heads (where the consumers are the bound), the default form and the seesaw kernel: warp stalls
#     a source line, shared memory's bank conflicts
set -f
S4=benchmarks/results/round54/scripts
S5=benchmarks/results/round55/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
case "${1:-}" in
  all)
    OUT=$OUT T3=${T3:-150} bash $S4/r54.sh time next_cases.txt 1
    OUT=$OUT NCU=${NCU:-1} T2=${T2:-85} T=${T:-120} bash $S4/r54.sh last
    patch -N -p1 < $S5/seesaw_alone.patch > /dev/null  # -N: already applied on a warm machine, left
    echo "== PA_NOLOAD=1" | tee $OUT/alone_times.txt
    PA_NOLOAD=1 PYTHONPATH=src timeout ${T4:-70} python3 $S4/many.py $S5/alone_cases.txt $(( ${T4:-70} - 8 )) 2>&1 |
      grep -v Warning | tee -a $OUT/alone_times.txt ;;
  ncu)
    N="ncu --clock-control none --kernel-name regex:mla_decode_(wide|seesaw) --launch-skip 3 --launch-count 1
       --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis
       --section MemoryWorkloadAnalysis_Tables --section SourceCounters --import-source no"
    mkdir -p /tmp/ncu55
    for form in default seesaw; do
      extra=""
      [ $form = seesaw ] && extra="--fp8-values --seesaw"
      PYTHONPATH=src timeout ${T:-80} $N -o /tmp/ncu55/$form -f python3 scripts/ncu_mla.py e4m3 --heads 128 \
        --fp8-scores $extra > $OUT/ncu_${form}_run.txt 2>&1
      ncu --import /tmp/ncu55/$form.ncu-rep > $OUT/ncu_$form.txt 2>&1
      ncu --import /tmp/ncu55/$form.ncu-rep --page source --csv --print-source sass > $OUT/sass_$form.csv 2>&1
      echo "== $form"
      grep -E 'Duration|Mem Busy|Warp Cycles Per Issued|Bank Conflicts|Shared' $OUT/ncu_$form.txt | head -20
    done ;;
  *) echo "expected all or ncu, got '${1:-}'"; exit 2 ;;
esac
