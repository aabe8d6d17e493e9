#!/usr/bin/env bash
# On the 2-core CPU machine: portattn serve of the tiny chat model, 800 requests of 64 + 128 tokens at 32 in flight,
# the engine in its own process (b, with the deltas as values) and on a thread (a), in turn b a b a.
set -u
cd "$(dirname "$0")/../../../../.."
export PYTHONPATH=src
OUT=benchmarks/results/engine_h200/round29/cpu_engine_process
[ -d /tmp/chatck ] || python -c "from portattn.testing.chat import save_tiny_chat_checkpoint; save_tiny_chat_checkpoint('/tmp/chatck')"
for run in b3 a3 b4 a4; do
  args=""; [ "${run:0:1}" = b ] && args="--engine-process"
  portattn serve /tmp/chatck --port 8123 $args > $OUT/${run}_server_log.txt 2>&1 &
  pid=$!
  for i in $(seq 1 120); do curl -s http://127.0.0.1:8123/health > /dev/null && break; sleep 1; done
  python -m benchmarks.serve --base-url http://127.0.0.1:8123 --model /tmp/chatck --num-prompts 800 --input-len 64 \
    --output-len 128 --max-concurrency 32 --token-range 1 300 > $OUT/${run}_client_log.txt 2>&1
  kill -INT $pid; wait $pid
done
