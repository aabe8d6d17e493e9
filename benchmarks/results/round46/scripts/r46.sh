#!/usr/bin/env bash
# Round 46's device calls, issued one after another on a warm machine.
#   OUT=... bash benchmarks/results/round46/scripts/r46.sh first   # no carry: round 45's verify and mma32 in one call
set -f
R=benchmarks/results
case "${1:-}" in
  first)
    nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $OUT/gpu.txt
    mkdir -p $OUT/verify $OUT/mma32
    OUT=$OUT/verify bash $R/round45/scripts/r45.sh verify
    OUT=$OUT/mma32 bash $R/round45/scripts/r45.sh mma32 ;;
  *) echo "expected one of first, got '${1:-}'"; exit 2 ;;
esac
