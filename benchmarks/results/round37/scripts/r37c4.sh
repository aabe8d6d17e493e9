#!/usr/bin/env bash
# Round 37, call 4 (no carry, about 8 minutes): where the 16-head MLA decode's time goes (issue 24 item 1: the e4m3
# cache 0.90x the bf16 one, 37% of copy in fp8 bytes; both kernels process a 64-key tile every ~3 us an SM).
# Nsight Compute over one launch of each: the bf16 cache's default (portable) kernel, and the fp8_mma kernel at
# 64 keys (2 programs an SM by shared memory; the plan's 4 splits) and at 32 keys (3 an SM by registers; 6 and 8
# splits; and held to 128 registers, 4 an SM, 8 splits); then each variant timed by graph replays.
# Then the split sweep of every 16- and 128-head variant (scripts/kernels_probe.py mla-fp8) and the warpgroup-MMA
# form's diagnosis (both moved here from round 36's call 2).
#   OUT=... bash benchmarks/results/round37/scripts/r37c4.sh
export PYTHONPATH=src
N="ncu --clock-control none --kernel-name regex:mla_decode_(split|fp8_mma) --launch-skip 3 --launch-count 1
   --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats
   --section MemoryWorkloadAnalysis"
which ncu > $OUT/ncu_path.txt 2>&1 || echo "no ncu on PATH" >> $OUT/ncu_path.txt
run() {  # name, ncu extra, script arguments
  timeout 90 $N $2 python3 scripts/ncu_mla.py $3 > $OUT/ncu_$1.txt 2>&1
  echo "== $1: $(grep -E 'Duration|Achieved Occupancy|Warp Cycles Per Issued|Issued Warp Per Scheduler' $OUT/ncu_$1.txt | tr -s ' ' | tr '\n' ';')"
}
run bf16 "" "bf16"
run fp8_64x2_s4 "--section SourceCounters" "e4m3 --tiles 16,64,4,2 --splits 4"
run fp8_32x2_s6 "" "e4m3 --tiles 16,32,4,2 --splits 6"
run fp8_32x3_s8 "" "e4m3 --tiles 16,32,4,3 --splits 8"
run fp8_32x2_r128_s8 "" "e4m3 --tiles 16,32,4,2 --maxnreg 128 --splits 8"
for v in "bf16" "e4m3 --tiles 16,64,4,2 --splits 4" "e4m3 --tiles 16,32,4,2 --splits 6" \
         "e4m3 --tiles 16,32,4,2 --splits 8" "e4m3 --tiles 16,32,4,3 --splits 8" \
         "e4m3 --tiles 16,32,4,2 --maxnreg 128 --splits 8" "e4m3 --tiles 16,32,4,2 --maxnreg 128 --splits 12"; do
  timeout 60 python3 scripts/ncu_mla.py $v --time >> $OUT/times.txt 2>&1
done
cat $OUT/times.txt
mkdir -p $OUT/probe && PYTHONPATH=src:tests timeout 200 python3 scripts/kernels_probe.py mla-fp8 --out $OUT/probe \
  > $OUT/probe_log.txt 2>&1
tail -n 60 $OUT/probe_log.txt
PYTHONPATH=src:tests timeout 90 python3 benchmarks/results/round34_h200/scripts/fp8_mma_diag.py > $OUT/fp8_mma_diag.txt 2>&1
tail -n 30 $OUT/fp8_mma_diag.txt
