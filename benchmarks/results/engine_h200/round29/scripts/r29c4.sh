#!/usr/bin/env bash
# round 29, call 4: Poisson 16 through the server again, the engine process now the default on a GPU (p: no
# flag) against --no-engine-process (t), in the order p t p (call 2 ran t p t p p).
W=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { OUT=$W/$1 LIMIT=$2 timeout -s INT $(( $2 + 30 )) bash scripts/gpu.sh "$3" >> $W/log_$1.txt 2>&1; (cd $W && tar czf $1.tgz $1 log_$1.txt && rm -rf $1 log_$1.txt); }
START=$SECONDS
export BATCH1_STEP_MS=4.22 KEEP_CHECKPOINT=/tmp/ck8b PYTHONPATH=/tmp/site
for s in p4 t3 p5; do
  extra=""; [ "${s:0:1}" = t ] && extra="--no-engine-process"
  LOADS="poisson16" SERVE_ARGS="--piecewise-graphs --max-num-batched-tokens 256 $extra" run $s 110 "bench serve"
  echo "$s done at $((SECONDS-START))" >> $W/times.txt
  [ $((SECONDS-START)) -gt 200 ] && break
done
