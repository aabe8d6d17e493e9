#!/usr/bin/env bash
# On a GPU machine, from the repository root: the serving benchmark of a Llama-3-8B-shaped checkpoint
# (random bf16 weights and a word-level tokenizer of the full vocabulary, written to a temporary
# folder), `portattn serve` on the GPU, and `python -m benchmarks.serve` against it at several
# loads, in one run. Results in $OUT (default benchmarks/results/gpu_serve): one JSON per load, the log,
# the server's log and its final /metrics. About 6 minutes on an H200.
#   PYTHONPATH=src bash scripts/gpu_serve.sh
# (A smoke run of the same steps on a CPU: SHAPE=tiny DEVICE=cpu DTYPE=float32 QUICK=1 bash scripts/gpu_serve.sh)
#
# Wheels the GPU image lacks (Python 3.12; install them, then add their folder to PYTHONPATH):
#   fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5
#   annotated-types==0.8.0 typing-inspection==0.4.5 opentelemetry-api==1.45.2
# (aiohttp, prometheus-client, anyio, h11, click, annotated-doc and typing-extensions are in the image.)
set -uo pipefail
OUT=${OUT:-benchmarks/results/gpu_serve}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
PORT=${PORT:-8000}
BASE="http://127.0.0.1:$PORT"
SHAPE=${SHAPE:-llama3-8b}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
CKPT_DIR=$(mktemp -d)
CKPT="$CKPT_DIR/$SHAPE-random"
LOG="$OUT/log.txt"

main() {
  SERVER_PID=
  cleanup() {
    if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; fi
    rm -rf "$CKPT_DIR"
  }
  trap cleanup EXIT
  echo "== $(date -u +%FT%TZ) src sha256 $(find src scripts -type f \( -name '*.py' -o -name '*.sh' \) | sort | xargs cat | sha256sum | cut -c1-12)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  $PY -c "import torch, fastapi, uvicorn, aiohttp; print('torch', torch.__version__, 'fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__)" || exit 1
  echo "== writing the checkpoint ($SHAPE, random $DTYPE weights drawn on $DEVICE)"
  timeout 300 $PY -m benchmarks.random_checkpoint "$CKPT" --shape "$SHAPE" --device "$DEVICE" --dtype "$DTYPE" || exit 1
  du -sh "$CKPT"
  echo "== starting the server"
  # 20000 pages of 16 tokens: 320k tokens of KV cache (128 KiB per token in bf16, about 40 GiB).
  $PY -m portattn.cli -v serve --model "$CKPT" --served-model-name "$SHAPE-random" --device "$DEVICE" \
    --dtype "$DTYPE" --page-size 16 --num-pages 20000 --max-num-seqs 256 --max-model-len 4096 \
    --chunked-prefill-size 8192 \
    --host 127.0.0.1 --port "$PORT" >"$OUT/server.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 600); do
    curl -sf "$BASE/health" >/dev/null 2>&1 && break
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "the server exited"; tail -n 30 "$OUT/server.log"; exit 1; }
    sleep 1
  done
  curl -sf "$BASE/health" >/dev/null || { echo "the server did not become healthy"; exit 1; }
  run() {  # name, limit in seconds, then the client's arguments
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" $PY -m benchmarks.serve --base-url "$BASE" --label "$DEVICE-$SHAPE-$name" \
      --token-range 2 500 --result-json "$OUT/serve_gpu_$name.json" "$@"
  }
  if [ -n "${QUICK:-}" ]; then
    run quick 120 --num-prompts 4 --max-concurrency 2 --input-len 32 --output-len 8
  else
  run conc1 120 --num-prompts 8 --max-concurrency 1 --input-len 512 --output-len 128
  run poisson4 150 --num-prompts 200 --request-rate 4 --input-len 512 --output-len 128
  run poisson16 150 --num-prompts 400 --request-rate 16 --input-len 512 --output-len 128 --range-ratio 0.5
  run burst256 150 --num-prompts 256 --request-rate inf --input-len 1024 --output-len 128
  fi
  curl -s "$BASE/metrics" | grep -v '^#' | grep -v '_bucket' >"$OUT/metrics.txt"
  grep -c "preempted request" "$OUT/server.log" | sed 's/^/preemptions logged: /'
}

main 2>&1 | tee "$LOG"
