#!/usr/bin/env bash
# Round 38, call 1 (no carry, at most about 9.5 minutes; round 37's call 4 with the integer unpacking added):
# where the 16-head MLA decode's time goes (issue 24 item 1: the e4m3 cache 0.90x the bf16 one, 37% of copy in
# fp8 bytes), whether moving the fp8 kernel's conversions to the integer pipe pays, and the same kernel over an e5m2
# cache (its bytes unpacked by prmt alone: no conversion instructions at all).
#   1. the Gluon MLA kernels' GPU tests (round 38's integer unpacking and e5m2 form against the float64 reference
#      and the portable kernel; the launcher fix of round 37) - a failure there means the alu or e5m2 rows below are
#      not to be trusted;
#   2. each variant timed by graph replays (the alu masks: by phase, within each phase, all; e5m2; page ids ahead;
#      32-key tiles at 6 and 8 splits, held to 128 registers);
#   3. Nsight Compute over one launch each (SpeedOfLight, occupancy, warp states, schedulers, memory, and the
#      pipes: ComputeWorkloadAnalysis, InstructionStats): fp8_mma over e4m3 at 64 keys, 4 splits (with source
#      counters); over e5m2; the bf16 cache's kernel; half the conversions on the integer pipe; 32 keys held to
#      128 registers at 8 splits;
#   4. the probe's split sweep and tile rows (scripts/kernels_probe.py mla-fp8), then the warpgroup-MMA diagnosis.
# Each step runs only while the call has time left (guards of 420-530 s; the call stays under 600 s).
#   OUT=... bash benchmarks/results/round38/scripts/r38c1.sh
export PYTHONPATH=src
set -f  # the ncu metric regex below is not a file pattern
START=$SECONDS
left() { [ $((SECONDS - START)) -lt ${1:-540} ]; }
PYTHONPATH=src:tests timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_fp8_mma.py \
  tests/kernels/test_mla_wide.py -k "not True" > $OUT/tests_mla_gluon.txt 2>&1; tail -n 3 $OUT/tests_mla_gluon.txt
for v in "bf16" "e4m3 --tiles 16,64,4,2 --splits 4" \
         "e5m2 --tiles 16,64,4,2 --splits 4" "e5m2" \
         "e4m3 --tiles 16,64,4,2 --splits 4 --alu-values 0b1111" \
         "e4m3 --tiles 16,64,4,2 --splits 4 --alu-scores 0b01010 --alu-values 0b1010" \
         "e4m3 --tiles 16,64,4,2 --splits 4 --alu-scores 0b11111 --alu-values 0b1111" \
         "e4m3 --tiles 16,64,4,2 --splits 4 --pages-ahead" "e5m2 --tiles 16,64,4,2 --splits 4 --pages-ahead" \
         "e5m2 --tiles 16,32,4,2 --splits 6" "e4m3 --tiles 16,32,4,2 --splits 6" "e4m3 --tiles 16,32,4,2 --splits 8" \
         "e4m3 --tiles 16,32,4,2 --maxnreg 128 --splits 8" "e4m3 --tiles 16,64,4,2 --splits 4"; do
  left 420 && timeout 45 python3 scripts/ncu_mla.py $v --time >> $OUT/times.txt 2>&1
done
cat $OUT/times.txt
N="ncu --clock-control none --kernel-name regex:mla_decode_(split|fp8_mma) --launch-skip 3 --launch-count 1
   --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats
   --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats
   --metrics regex:sm__(inst_executed_pipe_|pipe_).*avg\.pct_of_peak_sustained_active"
which ncu > $OUT/ncu_path.txt 2>&1 || echo "no ncu on PATH" >> $OUT/ncu_path.txt
run() {  # name, ncu extra, script arguments
  left 470 || return
  timeout 70 $N $2 python3 scripts/ncu_mla.py $3 > $OUT/ncu_$1.txt 2>&1
  echo "== $1: $(grep -E 'Duration|Achieved Occupancy|Warp Cycles Per Issued|Issued Warp Per Scheduler' $OUT/ncu_$1.txt | tr -s ' ' | tr '\n' ';')"
}
run fp8_64x2_s4 "--section SourceCounters" "e4m3 --tiles 16,64,4,2 --splits 4"
run e5m2_64x2_s4 "" "e5m2 --tiles 16,64,4,2 --splits 4"
run bf16 "" "bf16"
run fp8_64x2_s4_alu "" "e4m3 --tiles 16,64,4,2 --splits 4 --alu-scores 0b01010 --alu-values 0b1010"
run fp8_32x2_r128_s8 "" "e4m3 --tiles 16,32,4,2 --maxnreg 128 --splits 8"
if left 480; then
  mkdir -p $OUT/probe && PYTHONPATH=src:tests timeout $((560 - SECONDS + START)) python3 scripts/kernels_probe.py \
    mla-fp8 --out $OUT/probe > $OUT/probe_log.txt 2>&1
  tail -n 70 $OUT/probe_log.txt
fi
left 530 && PYTHONPATH=src:tests timeout $((585 - SECONDS + START)) python3 \
  benchmarks/results/round34_h200/scripts/fp8_mma_diag.py > $OUT/fp8_mma_diag.txt 2>&1
tail -n 30 $OUT/fp8_mma_diag.txt 2>/dev/null
python3 benchmarks/results/round38/scripts/summarize.py $OUT > $OUT/summary.txt 2>&1; cat $OUT/summary.txt
echo "call took $((SECONDS - START)) s"
