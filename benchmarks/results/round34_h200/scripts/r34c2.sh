#!/usr/bin/env bash
# Round 34, engine call (about 9 minutes; carry .whl/: fastapi and the rest): issue 23 target 3 with the mixed
# steps of up to the token budget in captured pieces (--piecewise-max-tokens). One server configuration takes
# both the burst of 256 x (1024 + 128) and Poisson 16 req/s of 512 + 128 (targets: burst TTFT mean <= 2.5 s with
# ITL p99 <= 3x its median, Poisson ITL p99 <= 2x its median): fp8 linears at budgets 2048 and 4096. Round 34's
# call 1 checked the pieces of 1024 and 2048 tokens against plain steps first. Run from the repository root:
#   OUT=... bash benchmarks/results/round34_h200/scripts/r34c2.sh
W=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { OUT=$W/$1 LIMIT=$2 timeout -s INT $(( $2 + 30 )) bash scripts/gpu.sh "$3" >> $W/log_$1.txt 2>&1; (cd $W && tar czf $1.tgz $1 log_$1.txt && rm -rf $1 log_$1.txt); }
START=$SECONDS
[ -f /tmp/ck8b/config.json ] || PYTHONPATH=src timeout 240 python3 -m benchmarks.random_checkpoint /tmp/ck8b \
  --shape llama3-8b --device cuda --dtype bfloat16 > $W/ckpt_log.txt 2>&1
echo "checkpoint at $((SECONDS-START))" >> $W/times.txt
export BATCH1_STEP_MS=4.22 KEEP_CHECKPOINT=/tmp/ck8b PYTHONPATH=/tmp/site LOADS="poisson16 burst256"
P="--piecewise-graphs --quantization fp8"
SERVE_ARGS="$P --max-num-batched-tokens 2048 --piecewise-max-tokens 2048" run f2048p 180 "bench serve"
echo "f2048p done at $((SECONDS-START))" >> $W/times.txt
[ $((SECONDS-START)) -lt 360 ] && SERVE_ARGS="$P --max-num-batched-tokens 4096 --piecewise-max-tokens 4096" \
  run f4096p 180 "bench serve"
echo "f4096p done at $((SECONDS-START))" >> $W/times.txt
