#!/usr/bin/env bash
# Round 57's second call (about 9 minutes): OUT=... bash benchmarks/results/round57/scripts/r57b.sh
#   1. cases2.txt timed;
#   2. the fp8-values GPU tests (as call 1) and the seesaw kernel's;
#   3. Nsight Compute of the seesaw kernel at 128 heads (round 55's sections and the SASS's counters).
set -f
S4=benchmarks/results/round54/scripts
S=benchmarks/results/round57/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout ${T1:-260} python3 $S4/many.py $S/cases2.txt $(( ${T1:-260} - 10 )) 2>&1 | grep -v Warning |
  tee $OUT/times.txt
PYTHONPATH=src:tests timeout ${T2:-150} python3 -m pytest -q -s -p no:cacheprovider -rf \
  -k "fp8_values and (64-64-64 or 16-64-100 or 8-64-40 or 16-32-100)" tests/kernels/test_mla_wide_fp8.py \
  tests/kernels/test_mla_seesaw_fp8.py 2>&1 | grep -v Warning | grep -E "splits|passed|failed|Error|error" \
  > $OUT/tests_values.txt
tail -n 3 $OUT/tests_values.txt
N="ncu --clock-control none --kernel-name regex:mla_decode_seesaw --launch-skip 3 --launch-count 1
   --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis
   --section MemoryWorkloadAnalysis_Tables --section SourceCounters --import-source no"
mkdir -p /tmp/ncu57
PYTHONPATH=src timeout ${T3:-100} $N -o /tmp/ncu57/seesaw -f python3 scripts/ncu_mla.py e4m3 --heads 128 \
  --fp8-scores --fp8-values --seesaw > $OUT/ncu_seesaw_run.txt 2>&1
ncu --import /tmp/ncu57/seesaw.ncu-rep > $OUT/ncu_seesaw.txt 2>&1
ncu --import /tmp/ncu57/seesaw.ncu-rep --page source --csv --print-source sass > $OUT/sass_seesaw.csv 2>&1
grep -E 'Duration|Mem Busy|Warp Cycles Per Issued|Bank Conflicts|Shared|Compute \(SM\)' $OUT/ncu_seesaw.txt | head -20
