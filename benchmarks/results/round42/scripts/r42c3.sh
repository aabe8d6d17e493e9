#!/usr/bin/env bash
# Round 42, call 3 (carry .whl/): round 41's r42c1.sh for the runs named in RUNS (default: the burst and Poisson 16
# at budget 3072), into a folder outside $OUT, then everything in one archive (a call brings back at most 8 files)
# and each server's report row.
#   OUT=... RUNS="burst256:3072 poisson16:3072" bash benchmarks/results/round42/scripts/r42c3.sh
NAME=${NAME:-r42c3}; W=/tmp/$NAME; rm -rf $W; mkdir -p $W  # (EXTRA: more server flags, e.g. "--kv-cache-dtype fp8")
RUNS=${RUNS:-burst256:3072 poisson16:3072} OUT=$W bash benchmarks/results/round41/scripts/r42c1.sh > $W/log.txt 2>&1
for t in $W/*/r40c2.tgz; do (cd $(dirname $t) && tar xzf r40c2.tgz); done
grep -h "^| 1-bench" $W/*/*/1-bench-serve/serve_gpu.md
grep -h "reached the engine\|steps, " $W/*/trace_*.txt
(cd $W && tar czf $OUT/$NAME.tgz --exclude='*.png' .)
