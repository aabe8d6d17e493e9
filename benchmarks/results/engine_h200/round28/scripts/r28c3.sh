#!/usr/bin/env bash
# round 28 call 3: compile workers: GPU tests (beside each other), then the 8B bf16 cold start with the workers
# (bfloat16, bfloat16-pyc) and without them (bfloat16-pyc, PORTATTN_COMPILE_WORKERS=0), alone; then one server at
# Poisson 16 with its engine thread under cProfile.
W=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
run() { OUT=$W/$1 LIMIT=$2 timeout -s INT $(( $2 + 30 )) bash scripts/gpu.sh "$3" >> $W/log_$1.txt 2>&1; (cd $W && tar czf $1.tgz $1 log_$1.txt && rm -rf $1 log_$1.txt); }
START=$SECONDS
WORKERS=4 run tengine 150 "test engine -- -k 'compile_ahead'" &
WORKERS=2 run tops 100 "test ops -- -k 'compile_workers'" &
wait
echo "tests done at $((SECONDS-START))" >> $W/times.txt
PYTHONPATH=/tmp/site:src timeout 200 python3 -m benchmarks.engine --parts coldstart --cold-runs bfloat16 bfloat16-pyc \
  --workdir /tmp/ck --out $W/cold_workers > $W/cold_workers_log.txt 2>&1
echo "cold workers rc $? at $((SECONDS-START))" >> $W/times.txt
PORTATTN_COMPILE_WORKERS=0 PYTHONPATH=/tmp/site:src timeout 120 python3 -m benchmarks.engine --parts coldstart \
  --cold-runs bfloat16-pyc --workdir /tmp/ck --out $W/cold_threads > $W/cold_threads_log.txt 2>&1
echo "cold threads rc $? at $((SECONDS-START))" >> $W/times.txt
rm -rf /tmp/ck
PROF_OUT=$W/engine_thread.prof PYTHONPATH=.gpuw/prof:/tmp/site BATCH1_STEP_MS=4.22 LOADS="poisson16" \
  SERVE_ARGS="--piecewise-graphs --max-num-batched-tokens 256" run sprof 120 "bench serve"
sleep 8
echo "serve done at $((SECONDS-START))" >> $W/times.txt
