#!/usr/bin/env bash
# On a 2-core CPU machine: portattn serve of the tiny chat model (portattn.testing.chat), 800 requests of 64 + 128
# tokens at 32 in flight, with the engine on a thread (A) and in its own process (B), in turn A B A B.
set -u
cd "$(dirname "$0")/../../../../.."
export PYTHONPATH=src
OUT=benchmarks/results/engine_h200/round28/cpu_engine_process
[ -d /tmp/chatck ] || python -c "from portattn.testing.chat import save_tiny_chat_checkpoint; save_tiny_chat_checkpoint('/tmp/chatck')"
for run in a1 b1 a2 b2; do
  args=""; [ "${run:0:1}" = b ] && args="--engine-process"
  portattn serve /tmp/chatck --port 8123 $args > $OUT/${run}_server_log.txt 2>&1 &
  pid=$!
  for i in $(seq 1 120); do curl -s http://127.0.0.1:8123/health > /dev/null && break; sleep 1; done
  python -m benchmarks.serve --base-url http://127.0.0.1:8123 --model /tmp/chatck --num-prompts 800 --input-len 64 \
    --output-len 128 --max-concurrency 32 --token-range 1 300 > $OUT/${run}_client_log.txt 2>&1
  kill -INT $pid; wait $pid
done
