#!/usr/bin/env bash
# round 30, call 3: quantization="fp8" on the 8B shape: decode steps (batch 1, 64) and the prefill of 8192-token
# prompts, bf16 then fp8 in one process; then the burst through the default server at budgets 16384 and 4096.
W=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { OUT=$W/$1 LIMIT=$2 timeout -s INT $(( $2 + 30 )) bash scripts/gpu.sh "$3" >> $W/log_$1.txt 2>&1; (cd $W && tar czf $1.tgz $1 log_$1.txt && rm -rf $1 log_$1.txt); }
START=$SECONDS
export BATCH1_STEP_MS=4.22 KEEP_CHECKPOINT=/tmp/ck8b
[ -f /tmp/ck8b/config.json ] || PYTHONPATH=src timeout 300 python3 -m benchmarks.random_checkpoint /tmp/ck8b --shape llama3-8b --device cuda --dtype bfloat16 > $W/ckpt_log.txt 2>&1
PYTHONPATH=src timeout 240 python3 .gpuw/fp8_engine_timing.py /tmp/ck8b $W/fp8_engine_timing.json > $W/fp8_engine_timing_log.txt 2>&1
echo "timing rc $? at $((SECONDS-START))" >> $W/times.txt
export PYTHONPATH=/tmp/site
LOADS="burst256" SERVE_ARGS="--piecewise-graphs --max-num-batched-tokens 16384 --quantization fp8" run f16384 120 "bench serve"
echo "f16384 done at $((SECONDS-START))" >> $W/times.txt
[ $((SECONDS-START)) -lt 420 ] && LOADS="burst256" SERVE_ARGS="--piecewise-graphs --max-num-batched-tokens 4096 --quantization fp8" run f4096 110 "bench serve"
echo "f4096 done at $((SECONDS-START))" >> $W/times.txt
