#!/usr/bin/env bash
# next round, call 2: the server at Poisson 16 (budget 256, pieces, uvloop + httptools) with the quicker repeated-
# launch check: the engine on a thread (t) and in its own process (p), in turn t p t p (p99/median per server;
# the statistics line's engine-thread share).
W=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { OUT=$W/$1 LIMIT=$2 timeout -s INT $(( $2 + 30 )) bash scripts/gpu.sh "$3" >> $W/log_$1.txt 2>&1; (cd $W && tar czf $1.tgz $1 log_$1.txt && rm -rf $1 log_$1.txt); }
START=$SECONDS
export BATCH1_STEP_MS=4.22 KEEP_CHECKPOINT=/tmp/ck8b PYTHONPATH=/tmp/site
for s in t1 p1 t2 p2 p3; do
  extra=""; [ "${s:0:1}" = p ] && extra="--engine-process"
  LOADS="poisson16" SERVE_ARGS="--piecewise-graphs --max-num-batched-tokens 256 $extra" run $s 120 "bench serve"
  echo "$s done at $((SECONDS-START))" >> $W/times.txt
  [ $((SECONDS-START)) -gt 440 ] && break
done
