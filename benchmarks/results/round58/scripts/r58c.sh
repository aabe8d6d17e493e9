#!/usr/bin/env bash
# Round 58's third call (about 5 minutes): OUT=... bash benchmarks/results/round58/scripts/r58c.sh
#   1. python -m portattn.bench.mla --fp8 over 17-128 heads (B=8 and 64, 4096 keys, page 64): where the defaults
#      stand against the bf16 cache on this machine;
#   2. Nsight Compute of the seesaw kernel at 64 heads (B=64 over 4096 keys, page 64).
set -f
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout ${T1:-200} python3 -m portattn.bench.mla --fp8 --no-torch --out $OUT/mla_fp8_heads.json \
  --page-sizes 64 --batches ${BATCHES:-64,8} --heads ${HEADS:-17,32,64,128} --lengths 4096 \
  --label "$(cat $OUT/gpu.txt), round 58" 2>&1 | grep -v Warning | tee $OUT/mla_fp8_heads.txt
[ "${T2:-120}" = 0 ] && exit 0
N="ncu --clock-control none --kernel-name regex:mla_decode_seesaw --launch-skip 3 --launch-count 1
   --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis
   --section ComputeWorkloadAnalysis --section Occupancy"
mkdir -p /tmp/ncu58
PYTHONPATH=src timeout ${T2:-120} $N -o /tmp/ncu58/seesaw64 -f python3 scripts/ncu_mla.py e4m3 --heads 64 \
  --fp8-scores --fp8-values --seesaw > $OUT/ncu_seesaw64_run.txt 2>&1
ncu --import /tmp/ncu58/seesaw64.ncu-rep > $OUT/ncu_seesaw64.txt 2>&1
grep -E 'Duration|Throughput|Busy|Warp Cycles Per Issued|Eligible|Issued Warp|No Eligible' $OUT/ncu_seesaw64.txt | head -30
