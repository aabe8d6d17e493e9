#!/usr/bin/env bash
# Next session's call 1 (no carry, about 7 minutes): issue 24 item 1 at 16 heads on the GPU.
#   1. coalesced_io's GPU tests (round 40 fixed its compile under Triton 3.6: permute's order as a tuple), then the
#      default cases' tests (round 40's call did not reach them);
#   2. graph replays at B = 8, 16, 32, 64, 128 over 4096 keys: the bf16 cache, e4m3 through the portable kernel,
#      through fp8_mma (the plan's splits cut to one program an SM) with and without coalesced_io; at B = 8 and 16
#      also fp8_mma at the plan's own split count (a given count is kept): round 40 measured fp8_mma at 0.56x and
#      0.72x the bf16 cache there;
#   3. Nsight Compute over fp8_mma with coalesced_io at B=64;
# everything in $OUT/r41c1.tar.gz, the summary printed.
#   OUT=... bash benchmarks/results/round40/scripts/r41c1.sh
export PYTHONPATH=src
set -f
START=$SECONDS
left() { [ $((SECONDS - START)) -lt ${1:-540} ]; }
O=$(mktemp -d)
for k in "coalesced or cut_to_one_program" "test_against_the_reference"; do
  left 200 && PYTHONPATH=src:tests timeout $((230 - SECONDS + START)) python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_mla_fp8_mma.py -k "$k" >> $O/tests.txt 2>&1
  echo "tests -k '$k': $(tail -n 1 $O/tests.txt)"
done
T() { left 420 && timeout 40 python3 scripts/ncu_mla.py "$@" --time >> $O/times.txt 2>&1; }
declare -A PLAN=([8]=32 [16]=16 [32]=8 [64]=4 [128]=2)
for b in 64 8 16 32 128; do
  T bf16 --batch $b
  T e4m3 --portable --batch $b
  T e4m3 --tiles 16,64,4,2 --batch $b
  T e4m3 --tiles 16,64,4,2 --batch $b --coalesced-io
  case $b in 8|16) T e4m3 --tiles 16,64,4,2 --batch $b --coalesced-io --splits ${PLAN[$b]};; esac
done
cat $O/times.txt | grep -v "^ " | grep " ms "
N="ncu --clock-control none --kernel-name regex:mla_decode_fp8_mma --launch-skip 3 --launch-count 1
   --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis
   --section SourceCounters"
left 500 && timeout 70 $N python3 scripts/ncu_mla.py e4m3 --tiles 16,64,4,2 --coalesced-io > $O/ncu_coalesced.txt 2>&1
grep -E 'Duration|excessive sectors|DRAM Throughput' $O/ncu_coalesced.txt | tr -s ' '
python3 benchmarks/results/round39/scripts/summarize.py $O > $O/summary.txt 2>&1; cat $O/summary.txt | head -40
tar -czf $OUT/r41c1.tar.gz -C $O .
echo "call took $((SECONDS - START)) s"
