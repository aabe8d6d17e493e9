#!/usr/bin/env bash
# round 28 call 2: the server (uvloop + httptools, budget 256, pieces) at Poisson 16, three times, with the lighter
# per-token metrics and the statistics line's CPU shares
W=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { OUT=$W/$1 LIMIT=$2 timeout -s INT $(( $2 + 30 )) bash scripts/gpu.sh "$3" >> $W/log_$1.txt 2>&1; (cd $W && tar czf $1.tgz $1 log_$1.txt && rm -rf $1 log_$1.txt); }
START=$SECONDS
export BATCH1_STEP_MS=4.22 KEEP_CHECKPOINT=/tmp/ck8b PYTHONPATH=/tmp/site
for s in s1 s2 s3; do
  LOADS="poisson16" SERVE_ARGS="--piecewise-graphs --max-num-batched-tokens 256" run $s 120 "bench serve"
  echo "$s done at $((SECONDS-START))" >> $W/times.txt
  [ $((SECONDS-START)) -gt 420 ] && break
done
