#!/usr/bin/env bash
# Round 41, call 3 (carry .whl/, about 7 minutes on a fresh machine):
#   1. issue 24 item 1: fp8_mma's coalesced_io GPU tests (its permute order now written in the call: Triton 3.6
#      refused the named tuple), then graph replays of the bf16 cache, fp8_mma and fp8_mma with coalesced_io at
#      B = 64, 128, 32 over 4096 keys (16 heads);
#   2. issue 23 target 3: the burst (256 x 1024 + 128) and Poisson 16 through the server (budget 2048, cap 128,
#      fp8 linears, captured pieces; one prompt a step left unfinished, the default) with the scheduler's fix: the
#      last prompt the limit lets go unfinished takes all a full step has left (call 1: TTFT mean 3.41 s).
#   OUT=... bash benchmarks/results/round41/scripts/r41c2.sh
export PYTHONPATH=src
set -f
START=$SECONDS
O=$OUT/mla; mkdir -p $O
PYTHONPATH=src:tests timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_fp8_mma.py \
  -k "coalesced" > $O/tests.txt 2>&1
echo "tests -k coalesced: $(tail -n 1 $O/tests.txt)"
T() { [ $((SECONDS - START)) -lt 300 ] && timeout 40 python3 scripts/ncu_mla.py "$@" --time >> $O/times.txt 2>&1; }
for b in 64 128 32; do
  T bf16 --batch $b
  T e4m3 --tiles 16,64,4,2 --batch $b
  T e4m3 --tiles 16,64,4,2 --batch $b --coalesced-io
done
grep " ms " $O/times.txt | grep -v "^ " | sed 's/ (the plan.s splits: fp8_mma may run fewer)//'
echo "mla done at $((SECONDS - START)) s"
RUNS="burst256 poisson16" bash benchmarks/results/round40/scripts/r40c2.sh 2>&1 | grep -v "^  " | head -n 30
echo "call took $((SECONDS - START)) s"
