#!/usr/bin/env bash
# Round 35, call 3 (carry .whl/): issue 23 target 3 through the server with each prompt's chunk capped
# (--long-prefill-token-threshold), fp8 linears, captured pieces: the burst of 256 x (1024 + 128) and
# Poisson 16 req/s of 512 +- 50% + 128 through one server per configuration ("budget:threshold" in CONFIGS).
#   OUT=... [CONFIGS="2048:128 2560:0 4096:256"] bash benchmarks/results/round35/scripts/r35c3.sh  (0: no cap)
W=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { OUT=$W/$1 LIMIT=$2 timeout -s INT $(( $2 + 30 )) bash scripts/gpu.sh "$3" >> $W/log_$1.txt 2>&1; (cd $W && tar czf $1.tgz $1 log_$1.txt && rm -rf $1 log_$1.txt); }
START=$SECONDS
[ -f /tmp/ck8b/config.json ] || PYTHONPATH=src timeout 240 python3 -m benchmarks.random_checkpoint /tmp/ck8b \
  --shape llama3-8b --device cuda --dtype bfloat16 > $W/ckpt_log.txt 2>&1
export KEEP_CHECKPOINT=/tmp/ck8b PYTHONPATH=/tmp/site LOADS="poisson16 burst256"
for c in ${CONFIGS:-2048:128 2560:0 4096:256}; do
  budget=${c%:*} cap=${c#*:}
  [ $((SECONDS-START)) -lt 420 ] || break
  SERVE_ARGS="--piecewise-graphs --quantization fp8 --max-num-batched-tokens $budget --piecewise-max-tokens $budget
    --long-prefill-token-threshold $cap" run b${budget}c${cap} 180 "bench serve"
  echo "b${budget}c${cap} done at $((SECONDS-START))" >> $W/times.txt
done
cat $W/times.txt
