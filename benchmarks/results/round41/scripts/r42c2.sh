#!/usr/bin/env bash
# Next session's call 2 (no carry, about 6 minutes): issue 24 item 1 on (if it comes) an H200, whose bf16 MLA
# kernel ran 25% faster than the H100's in round 40 while fp8_mma (latency-bound in round 38) ran 7% faster:
#   1. graph replays at B = 64 and 128 over 4096 keys (16 heads): the bf16 cache, the default over e4m3 and e5m2
#      (fp8_mma, 64 keys, 2 buffers, coalesced_io) and more bytes in flight: 64 keys in 3 and 4 buffers (131 and
#      168 KB of shared memory compiled for sm_90 by Triton 3.6), 32 keys in 4 (93 KB; two programs an SM would
#      fit, but the plan's splits are cut to one an SM), and at B=64 the plan's own 4 splits (two programs an SM,
#      slower before coalesced_io);
#   2. the 48 reference cases of tests/kernels/test_mla_fp8_mma.py (round 41 ran 32 of them with coalesced_io the
#      default before its device time ended).
#   OUT=... bash benchmarks/results/round41/scripts/r42c2.sh
export PYTHONPATH=src
set -f
START=$SECONDS
O=$OUT
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $O/gpu.txt 2>&1
T() { [ $((SECONDS - START)) -lt 200 ] && timeout 40 python3 scripts/ncu_mla.py "$@" --time >> $O/times.txt 2>&1; }
for b in 64 128; do
  T bf16 --batch $b
  T e4m3 --batch $b
  T e5m2 --batch $b
  T e4m3 --tiles 16,64,4,3 --coalesced-io --batch $b
  T e4m3 --tiles 16,64,4,4 --coalesced-io --batch $b
  T e4m3 --tiles 16,32,4,4 --coalesced-io --batch $b
  [ $b = 64 ] && T e4m3 --batch $b --splits 4  # (the plan's count kept: two programs an SM)
done
grep " ms " $O/times.txt | grep -v "^ " | sed 's/ (the plan.s splits: fp8_mma may run fewer)//'
echo "timings done at $((SECONDS - START)) s"
PYTHONPATH=src:tests timeout $((560 - SECONDS + START)) python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_mla_fp8_mma.py -k test_against_the_reference > $O/tests.txt 2>&1
echo "reference cases: $(tail -n 1 $O/tests.txt)"
echo "call took $((SECONDS - START)) s"
