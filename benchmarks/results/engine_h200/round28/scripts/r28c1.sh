#!/usr/bin/env bash
# round 28 call 1: server tests (KV usage, metrics children) and compile_ahead beside each other; then the 8B bf16
# cold start with the serial launcher loads, alone.
W=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
run() { OUT=$W/$1 LIMIT=$2 timeout -s INT $(( $2 + 30 )) bash scripts/gpu.sh "$3" >> $W/log_$1.txt 2>&1; (cd $W && tar czf $1.tgz $1 log_$1.txt && rm -rf $1 log_$1.txt); }
START=$SECONDS
run tserver 200 "test server" &
WORKERS=4 run tengine 150 "test engine -- -k 'compile_ahead or piecewise_gpu'" &
wait
echo "tests done at $((SECONDS-START))" >> $W/times.txt
PYTHONPATH=/tmp/site:src timeout 300 python3 -m benchmarks.engine --parts coldstart --cold-runs bfloat16 bfloat16-pyc \
  --workdir /tmp/ck --out $W/cold > $W/cold_log.txt 2>&1
echo "cold rc $? at $((SECONDS-START))" >> $W/times.txt
