#!/usr/bin/env bash
# Round 36, call 1 (carry .whl/): the burst's stops (round 35: every stream stops for one step each time the
# decoding count passes 64, 80, ..., 240) against the warm-up of the LM head at every row count.
#   1. step traces of the burst (256 x 1024 + 128, budget 2048, fp8 linears, captured pieces), without the
#      LM head warm-up and with it (the default now): the slow steps, and the launches that waited;
#      and without it but with every CUDA module loaded at start;
#   2. the same burst and Poisson 16 through servers (issue 23 target 3), CONFIGS "budget:cap[:KV-cache dtype]"
#      (cap 0: none; an fp8 cache halves the decodes' cache reads in the mixed steps).
#   OUT=... [CONFIGS="2048:128 2560:128 2048:128:fp8 3072:128"] bash benchmarks/results/round36/scripts/r36c1.sh
W=$OUT
export PYTHONPATH=src
START=$SECONDS
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $W/gpu.txt 2>&1
[ -f /tmp/ck8b/config.json ] || timeout 240 python3 -m benchmarks.random_checkpoint /tmp/ck8b --shape llama3-8b \
  --device cuda --dtype bfloat16 > $W/ckpt_log.txt 2>&1
echo "checkpoint at $((SECONDS-START))" >> $W/times.txt
F="--device cuda --dtype bfloat16 --page-size 16 --max-num-seqs 256 --max-model-len 4096 --piecewise-graphs
   --quantization fp8 --max-num-batched-tokens 2048 --piecewise-max-tokens 2048"
timeout 150 python3 -m benchmarks.step_trace /tmp/ck8b $F --skip-logits-warm-up --out $W/burst_nowarm.json \
  > $W/burst_nowarm.txt 2>&1
echo "trace without warm-up at $((SECONDS-START))" >> $W/times.txt
timeout 150 python3 -m benchmarks.step_trace /tmp/ck8b $F --profile 40:3 --out $W/burst_warm.json \
  > $W/burst_warm.txt 2>&1  # (and the kernels of three mixed steps: what a prefill token costs)
echo "trace with warm-up at $((SECONDS-START))" >> $W/times.txt
# Without the warm-up, every module loaded at start (CUDA_MODULE_LOADING=EAGER): no kernel loads while serving.
CUDA_MODULE_LOADING=EAGER timeout 150 python3 -m benchmarks.step_trace /tmp/ck8b $F --skip-logits-warm-up \
  --out $W/burst_eager_loading.json > $W/burst_eager_loading.txt 2>&1
echo "trace with eager module loading at $((SECONDS-START))" >> $W/times.txt
for f in burst_nowarm burst_warm burst_eager_loading; do echo "== $f"; grep -A14 "steps in" $W/$f.txt | head -30; grep "^slow" $W/$f.txt | head -20; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { OUT=$W/$1 LIMIT=$2 timeout -s INT $(( $2 + 30 )) bash scripts/gpu.sh "$3" >> $W/log_$1.txt 2>&1; (cd $W && tar czf $1.tgz $1 log_$1.txt && rm -rf $1 log_$1.txt); }
export KEEP_CHECKPOINT=/tmp/ck8b LOADS="poisson16 burst256"
for c in ${CONFIGS:-2048:128 2560:128 2048:128:fp8 3072:128}; do  # budget:cap[:KV-cache dtype]
  IFS=: read -r budget cap kv <<< "$c"
  [ $((SECONDS-START)) -lt 430 ] || break
  PYTHONPATH=/tmp/site SERVE_ARGS="--piecewise-graphs --quantization fp8 --max-num-batched-tokens $budget
    --piecewise-max-tokens $budget --long-prefill-token-threshold $cap ${kv:+--kv-cache-dtype $kv}" \
    run b${budget}c${cap}${kv} 180 "bench serve"
  echo "b${budget}c${cap}${kv} done at $((SECONDS-START))" >> $W/times.txt
done
cat $W/times.txt
