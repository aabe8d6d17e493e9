#!/usr/bin/env bash
# Round 39, call 2 (carry .whl/, about 6 minutes): issue 23 target 3, where the burst's first stop goes (round 38,
# H100: the first stream stopped 141 ms and the second request's first token came 256 ms after it was sent, where
# one 33 ms step was due; the engine alone had no such stop). Servers at budget 2048, chunk cap 128, fp8 linears,
# captured pieces, the engine in its own process (the default), each with the engine loop's trace
# (PORTATTN_STEP_TRACE: each step's drain, step, emit and publish times, the requests added before it):
#   1. the burst (256 x 1024 + 128) through a server with this round's Outbox (requests to the engine's process
#      sent by a thread of their own, as one list);
#   2. Poisson 16 requests a second through another (its 5-64 ms stops of every stream);
# then each trace's summary (benchmarks/results/round39/scripts/trace_summary.py) and each server's report.
#   OUT=... bash benchmarks/results/round39/scripts/r39c2.sh
W=$OUT
export PYTHONPATH=src
START=$SECONDS
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $W/gpu.txt 2>&1
[ -f /tmp/ck8b/config.json ] || timeout 240 python3 -m benchmarks.random_checkpoint /tmp/ck8b --shape llama3-8b \
  --device cuda --dtype bfloat16 > $W/ckpt_log.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export KEEP_CHECKPOINT=/tmp/ck8b
for load in burst256 poisson16; do
  [ $((SECONDS-START)) -lt 420 ] || break
  PORTATTN_STEP_TRACE=$W/trace_$load.json LOADS=$load PYTHONPATH=/tmp/site OUT=$W/$load LIMIT=150 \
    SERVE_ARGS="--piecewise-graphs --quantization fp8 --max-num-batched-tokens 2048 --piecewise-max-tokens 2048
    --long-prefill-token-threshold 128" timeout -s INT 180 bash scripts/gpu.sh "bench serve" >> $W/log_$load.txt 2>&1
  for _ in $(seq 40); do [ -s $W/trace_$load.json ] && break; sleep 1; done  # (written as the engine stops)
  echo "$load done at $((SECONDS-START)) s"
  grep -A3 "^| server" $W/$load/serve_gpu.md 2>/dev/null | tail -n 1
  python3 benchmarks/results/round39/scripts/trace_summary.py $W/trace_$load.json --first 30 \
    --serve $W/$load/1-bench-serve/serve_$load.json > $W/trace_$load.txt 2>&1; head -n 120 $W/trace_$load.txt
done
(cd $W && tar czf r39c2.tgz --remove-files burst256 poisson16 log_*.txt 2>/dev/null)
echo "call took $((SECONDS - START)) s"
