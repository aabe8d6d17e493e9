#!/usr/bin/env bash
# round 30, call 2: quantization="fp8" on the 8B shape: the burst through the default server at budgets 8192 and
# 2048, then decode steps (batch 1, 64), prefill of 8192-token prompts, bf16 / fp8 / bf16 / fp8 in one process.
W=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { OUT=$W/$1 LIMIT=$2 timeout -s INT $(( $2 + 30 )) bash scripts/gpu.sh "$3" >> $W/log_$1.txt 2>&1; (cd $W && tar czf $1.tgz $1 log_$1.txt && rm -rf $1 log_$1.txt); }
START=$SECONDS
export BATCH1_STEP_MS=4.22 KEEP_CHECKPOINT=/tmp/ck8b PYTHONPATH=/tmp/site
LOADS="burst256" SERVE_ARGS="--piecewise-graphs --max-num-batched-tokens 8192 --quantization fp8" run f8192 140 "bench serve"
echo "f8192 done at $((SECONDS-START))" >> $W/times.txt
LOADS="burst256" SERVE_ARGS="--piecewise-graphs --max-num-batched-tokens 2048 --quantization fp8" run f2048 110 "bench serve"
echo "f2048 done at $((SECONDS-START))" >> $W/times.txt
PYTHONPATH=src timeout $(( 560 - (SECONDS-START) )) python3 .gpuw/fp8_engine_timing.py /tmp/ck8b $W/fp8_engine_timing.json > $W/fp8_engine_timing_log.txt 2>&1
echo "timing rc $? at $((SECONDS-START))" >> $W/times.txt
