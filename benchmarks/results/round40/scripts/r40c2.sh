#!/usr/bin/env bash
# Round 40, call 2 (carry .whl/, about 8 minutes): issue 23 target 3 through servers at budget 2048, chunk cap 128,
# fp8 linears, captured pieces, the engine in its own process, each with the engine loop's trace
# (PORTATTN_STEP_TRACE):
#   1. the burst (256 x 1024 + 128) with round 39's Outbox (requests to the engine's process as one list);
#   2. Poisson 16 requests a second;
#   3. Poisson 16 with --max-num-partial-prefills 1 (one prompt a step left unfinished: round 38's Poisson gaps
#      were over twice the median in 0.4% of the moments no prompt was prefilling, 1.0% with one, 2.2% with two,
#      16% with four);
# then each trace's summary (round 39's trace_summary.py) and each server's report.
#   OUT=... bash benchmarks/results/round40/scripts/r40c2.sh
W=$OUT
export PYTHONPATH=src
START=$SECONDS
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $W/gpu.txt 2>&1
[ -f /tmp/ck8b/config.json ] || timeout 240 python3 -m benchmarks.random_checkpoint /tmp/ck8b --shape llama3-8b \
  --device cuda --dtype bfloat16 > $W/ckpt_log.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export KEEP_CHECKPOINT=/tmp/ck8b
B=${BUDGET:-2048}  # (round 41: BUDGET= for other token budgets; round 42: EXTRA= for more server flags)
BASE="--piecewise-graphs --quantization fp8 --max-num-batched-tokens $B --piecewise-max-tokens $B
  --long-prefill-token-threshold 128"
for run in ${RUNS:-poisson16 poisson16_p1 burst256}; do
  [ $((SECONDS-START)) -lt 450 ] || break
  load=${run%_p1}; extra=""; [ $run = poisson16_p1 ] && extra="--max-num-partial-prefills 1"
  PORTATTN_STEP_TRACE=$W/trace_$run.json LOADS=$load PYTHONPATH=/tmp/site OUT=$W/$run LIMIT=150 \
    SERVE_ARGS="$BASE $extra ${EXTRA:-}" timeout -s INT 180 bash scripts/gpu.sh "bench serve" >> $W/log_$run.txt 2>&1
  for _ in $(seq 40); do [ -s $W/trace_$run.json ] && break; sleep 1; done  # (written as the engine stops)
  echo "$run done at $((SECONDS-START)) s"
  grep -A3 "^| server" $W/$run/1-bench-serve/serve_gpu.md 2>/dev/null | tail -n 1
  python3 benchmarks/results/round39/scripts/trace_summary.py $W/trace_$run.json --first 30 \
    --serve $W/$run/1-bench-serve/serve_$load.json > $W/trace_$run.txt 2>&1; head -n 60 $W/trace_$run.txt
done
(cd $W && tar czf r40c2.tgz --remove-files burst256 poisson16 poisson16_p1 log_*.txt 2>/dev/null)
echo "call took $((SECONDS - START)) s"
