#!/usr/bin/env bash
# round 30, call 1: an fp8 GEMM probe (torch._scaled_mm row-wise / per-tensor against bf16, 8B shapes), then the
# burst through the default server (engine process on the GPU) at budgets 8192 and 2048, and Poisson 16 at 256.
W=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { OUT=$W/$1 LIMIT=$2 timeout -s INT $(( $2 + 30 )) bash scripts/gpu.sh "$3" >> $W/log_$1.txt 2>&1; (cd $W && tar czf $1.tgz $1 log_$1.txt && rm -rf $1 log_$1.txt); }
START=$SECONDS
timeout 120 python3 .gpuw/fp8_probe.py $W/fp8_probe.json > $W/fp8_probe_log.txt 2>&1
echo "probe done at $((SECONDS-START))" >> $W/times.txt
export BATCH1_STEP_MS=4.22 KEEP_CHECKPOINT=/tmp/ck8b PYTHONPATH=/tmp/site
LOADS="burst256" SERVE_ARGS="--piecewise-graphs --max-num-batched-tokens 8192" run b8192 130 "bench serve"
echo "b8192 done at $((SECONDS-START))" >> $W/times.txt
LOADS="burst256" SERVE_ARGS="--piecewise-graphs --max-num-batched-tokens 2048" run b2048 110 "bench serve"
echo "b2048 done at $((SECONDS-START))" >> $W/times.txt
[ $((SECONDS-START)) -lt 400 ] && LOADS="poisson16" SERVE_ARGS="--piecewise-graphs --max-num-batched-tokens 256" run p256 110 "bench serve"
echo "p256 done at $((SECONDS-START))" >> $W/times.txt
