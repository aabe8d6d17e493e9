#!/usr/bin/env bash
# Round 67, where the 17-head step's time goes:
#   OUT=... bash benchmarks/results/round67/scripts/call4.sh
#   1. cases4.txt timed (graph replays);
#   2. Nsight Compute of the narrow kernel and its merge at 17 heads (SpeedOfLight, MemoryWorkloadAnalysis,
#      WarpStateStats, SchedulerStats), and of the seesaw kernel.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round67/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout 70 python3 scripts/mla_times.py $S/cases4.txt 60 2>&1 | grep -v Warning | tee $OUT/times.txt
for form in "--narrow" ""; do
  PYTHONPATH=src timeout 60 ncu --clock-control none --kernel-name regex:mla_decode --launch-skip 6 --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    python3 scripts/ncu_mla.py e4m3 --heads 17 --fp8-scores --fp8-values --seesaw $form 2>&1 | grep -v Warning \
    > $OUT/ncu${form:+_narrow}.txt
  grep -E "mla_decode|Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Compute \(SM\)|Stall|Issued Warp" \
    $OUT/ncu${form:+_narrow}.txt | head -40
done
