#!/usr/bin/env bash
# Round 39, call 1 (no carry, at most about 9 minutes): issue 24 item 1, the 16-head fp8 MLA decode.
# Round 38's Nsight Compute report put 66% of the fp8_mma kernel's global sectors down as excessive; compiled for
# sm_90 the kernel loads the queries two bytes a lane in every warp (288 loads a lane, each lane its own sector)
# and stores its output four bytes a lane. MLATileConfig(coalesced_io=True) loads and stores 16 bytes a lane.
#   1. the Gluon MLA kernels' GPU tests: coalesced_io and the split count cut by round 38's rule (first run on a
#      GPU) against the float64 reference, and
#      round 38's variants (e5m2, integer unpacking, page ids ahead), whose outcome was lost then;
#   2. graph-replay timings: the bf16 cache, e4m3 and e5m2 through fp8_mma at the plan's split count (cut to one
#      program an SM) with and without coalesced_io, at B = 64 and then 8, 16, 32, 128; at B=64 also splits 4 and 2;
#   3. Nsight Compute over one launch with and without coalesced_io (memory workload and source counters);
# everything in $OUT/r39c1.tar.gz (the device returns few files), the summary printed.
#   OUT=... bash benchmarks/results/round39/scripts/r39c1.sh
export PYTHONPATH=src
set -f
START=$SECONDS
left() { [ $((SECONDS - START)) -lt ${1:-540} ]; }
O=$(mktemp -d)
# (each variant compiles its own kernels: coalesced_io and the cut split count first, then round 38's variants,
# then the default's cases)
for k in "coalesced or cut_to_one_program" "variants and not coalesced" "test_against_the_reference"; do
  left 200 && PYTHONPATH=src:tests timeout $((230 - SECONDS + START)) python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_mla_fp8_mma.py -k "$k" >> $O/tests.txt 2>&1
  echo "tests -k '$k': $(tail -n 1 $O/tests.txt)"
done
T() { left 400 && timeout 40 python3 scripts/ncu_mla.py "$@" --time >> $O/times.txt 2>&1; }
for b in 64 8 16 32 128; do
  T bf16 --batch $b
  for kv in e4m3 e5m2; do
    T $kv --tiles 16,64,4,2 --batch $b
    T $kv --tiles 16,64,4,2 --batch $b --coalesced-io
  done
  [ $b = 64 ] && T bf16 --batch 64 --splits 2
  [ $b = 64 ] && for s in 4 2; do T e4m3 --tiles 16,64,4,2 --splits $s --coalesced-io; done
done
cat $O/times.txt
N="ncu --clock-control none --kernel-name regex:mla_decode_fp8_mma --launch-skip 3 --launch-count 1
   --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats
   --section MemoryWorkloadAnalysis --section SourceCounters"
for v in default coalesced; do
  extra=""; [ $v = coalesced ] && extra="--coalesced-io"
  left 500 && timeout 70 $N python3 scripts/ncu_mla.py e4m3 --tiles 16,64,4,2 $extra > $O/ncu_$v.txt 2>&1
  echo "== $v: $(grep -E 'Duration|excessive sectors|DRAM Throughput' $O/ncu_$v.txt | tr -s ' ' | tr '\n' ';')"
done
python3 benchmarks/results/round39/scripts/summarize.py $O > $O/summary.txt 2>&1; cat $O/summary.txt
tar -czf $OUT/r39c1.tar.gz -C $O .
echo "call took $((SECONDS - START)) s"
