#!/usr/bin/env bash
# The one GPU runner. From the repository root on a GPU machine (no install needed):
#
#   bash scripts/gpu.sh STEP [STEP ...]
#
# Each STEP is one quoted word list: a test suite, a benchmark or the check, with optional arguments
# after `--` (passed to pytest, the benchmark or `portattn check`):
#
#   "test ops"        tests/ops, backends, kernels, runtime, check on the GPU (fp32, fp16, bf16)
#   "test engine"     tests/models and tests/engine with the engine on the GPU (PORTATTN_TEST_ENGINE_DEVICE=cuda)
#   "test server"     tests/server, tests/bench and tests/examples on the GPU machine
#   "test tp"         tests/distributed over NCCL (needs two GPUs)
#   "bench ops"       python -m portattn.bench (the op benchmarks against their peers)
#   "bench engine"    python -m benchmarks.engine (decode steps, throughput, cold start, ...); SmolLM2's offline
#                     512 x (512 + 128) beside the 8B shape's: -- --parts throughput --model FILE.gguf
#                     --prompt-len 512 --output-len 128
#   "bench real_model"  python -m benchmarks.real_model (SmolLM2: answers, batch-1 step and its breakdown, offline)
#   "bench host_path"   python -m benchmarks.host_path --device cuda (the host's part of a decode step, model stubbed)
#   "bench spec_decode"  python -m benchmarks.spec_decode (SmolLM2 with and without n-gram speculation, MODEL=path)
#   "bench serve"     portattn serve on a Llama-3-8B-shaped checkpoint (or MODEL=path, DATASET=prompts file)
#                     + python -m benchmarks.serve at several loads; needs wheels a bare GPU image may lack
#                     (fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection, and
#                     for fastapi 0.165 annotated-doc and opentelemetry-api);
#                     SERVE_ARGS="..." go to the server, KEEP_CHECKPOINT=dir keeps the random checkpoint for
#                     the next serve step, LOADS="conc1 poisson16 burst256" (the default) picks loads; the
#                     notes and plot by benchmarks.serve_report
#                     (BATCH1_STEP_MS=the engine's batch-1 step for the concurrency-1 target)
#   "bench mixed"     scripts/engine_timeline.py mixed (32 decodes over 1024 keys and an arriving prompt of
#                     256 / 512 / 768 tokens): plain, with --piecewise, plain again; then scripts/launch_cost.py
#   "bench tp"        python -m benchmarks.tp (two GPUs)
#   "bench vision"    python -m benchmarks.vision
#   "bench mla" | "bench cascade" | "bench head_dims"   the op library's other benchmarks
#   "bench guard"     python -m portattn.bench.guard: the guarded op cases against their committed baseline
#   "bench probe -- SECTION ..."   scripts/kernels_probe.py (head dims without row alignment, fp8, long decode, fp32)
#   "check"           portattn check
#
# Suites are the test folders: tests/conftest.py marks every test with its folder's name (`ops`,
# `engine`, ...), so `test NAME` is `pytest -m NAME` and `-- -k EXPR` narrows it.
#
# Output: one folder, $OUT (the device tool sets it; default /tmp/portattn-gpu). Every step writes
# $OUT/<n>-<step>/ (its log, JUnit XML or JSON), status.txt gets one line per step, and the end packs
# everything into $OUT/results.tar.gz (one file to bring back). Every step has a time limit
# (LIMIT=seconds, default 540) so that one slow step cannot take the others' results with it.
#
# Examples:
#   bash scripts/gpu.sh "test ops" "bench ops -- --case 'decode B=64 L=4096 P=16'"
#   bash scripts/gpu.sh "test engine -- -k 'matches_transformers and p7'" "bench engine -- --parts copy decode"
#   the captured-graph tests in three parts of under 150 s each (tests/engine/test_graphs_gpu.py):
#   LIMIT=150 bash scripts/gpu.sh "test engine -- -k 'graphs_gpu and dense'" "test engine -- -k 'graphs_gpu and moe'" \
#     "test engine -- -k 'graphs_gpu and not dense and not moe'"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/portattn-gpu}
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LIMIT=${LIMIT:-540}
WORKERS=${WORKERS:-8}

header() {
  echo "== $(date -u +%FT%TZ) src sha256 $(find src benchmarks scripts -type f \( -name '*.py' -o -name '*.sh' \) | sort | xargs cat | sha256sum | cut -c1-12)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
}

run_tests() {  # suite dir [pytest args]
  local suite=$1 dir=$2
  shift 2
  local marker=$suite env=()
  case $suite in
    ops) marker="ops or backends or kernels or runtime or check" ;;
    engine) marker="models or engine"; env=(PORTATTN_TEST_ENGINE_DEVICE=cuda) ;;
    server) marker="server or bench or examples" ;;
    tp) marker="distributed"; env=(PORTATTN_TEST_ENGINE_DEVICE=cuda) ;;
    *) echo "expected a test suite in {ops, engine, server, tp}, got $suite"; return 2 ;;
  esac
  local workers=$WORKERS
  [ "$suite" = tp ] && workers=1
  # SIGINT at the limit: pytest stops and still prints the failures so far (a KILL would lose them).
  env "${env[@]}" timeout -s INT -k 30 "$LIMIT" $PY -m pytest tests -q -p no:cacheprovider -m "$marker" \
    -n "$workers" --maxfail=50 --durations=15 -rfE --junitxml="$dir/junit.xml" "$@" 2>&1 | tail -n 80
}

serve_bench() {  # dir [extra client args]: a checkpoint served on the GPU, loads from the client
  # MODEL=path serves that checkpoint or .gguf file (DATASET=file sends its prompts, e.g. the real-text
  # benchmarks/prompts/chat.jsonl); otherwise a Llama-3-8B-shaped checkpoint of random weights.
  local dir=$1 port=${PORT:-8000} shape=${SHAPE:-llama3-8b} dtype=${DTYPE:-bfloat16}
  shift
  local ckpt_dir
  ckpt_dir=$(mktemp -d)
  local base="http://127.0.0.1:$port" ckpt="$ckpt_dir/$shape-random" name="$shape-random" server_pid= data=()
  # (a RETURN trap outlives its function: it clears itself, or the next function's return finds no ckpt_dir)
  trap '[ -n "${server_pid:-}" ] && kill "$server_pid" 2>/dev/null; rm -rf "${ckpt_dir:-}"; trap - RETURN' RETURN
  if [ -n "${MODEL:-}" ]; then
    ckpt=$MODEL
    shape=$(basename "$MODEL")
    name=$shape
    data=(--tokenizer "$MODEL" ${DATASET:+--dataset "$DATASET" --endpoint /v1/chat/completions})
  else
    # KEEP_CHECKPOINT=dir: the random checkpoint written there once and kept for the next serve steps
    [ -n "${KEEP_CHECKPOINT:-}" ] && ckpt=$KEEP_CHECKPOINT
    [ -f "$ckpt/config.json" ] ||
      timeout 300 $PY -m benchmarks.random_checkpoint "$ckpt" --shape "$shape" --device cuda --dtype "$dtype" || return 1
  fi
  $PY -m portattn.cli -v serve "$ckpt" --served-model-name "$name" --device cuda --dtype "$dtype" \
    --page-size 16 --max-num-seqs 256 --max-model-len 4096 --host 127.0.0.1 --port "$port" \
    ${SERVE_ARGS:-} >"$dir/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 600); do
    curl -sf "$base/health" >/dev/null 2>&1 && break
    kill -0 "$server_pid" 2>/dev/null || { echo "the server exited"; tail -n 30 "$dir/server.log"; return 1; }
    sleep 1
  done
  load() {  # name, then the client's arguments; LOADS="..." runs only the loads it names
    local name=$1
    shift
    [[ " ${LOADS:-conc1 poisson16 burst256} " == *" $name "* ]] || return 0
    echo "== load $name: $*"
    timeout 170 $PY -m benchmarks.serve --base-url "$base" --label "cuda-$shape-$name" --token-range 2 500 \
      --result-json "$dir/serve_$name.json" "${data[@]}" "$@"
  }
  load conc1 --num-prompts 8 --max-concurrency 1 --input-len 512 --output-len 128
  load poisson16 --num-prompts 400 --request-rate 16 --input-len 512 --output-len 128 --range-ratio 0.5
  load burst256 --num-prompts 256 --request-rate inf --input-len 1024 --output-len 128
  curl -s "$base/metrics" | grep -v '^#' | grep -v '_bucket' >"$dir/metrics.txt"
  $PY -m benchmarks.serve_report "$dir" --out "$dir" ${BATCH1_STEP_MS:+--batch1-step-ms "$BATCH1_STEP_MS"}
}

run_bench() {  # name dir [args]
  local name=$1 dir=$2
  shift 2
  case $name in
    ops) timeout "$LIMIT" $PY -m portattn.bench --out "$dir" "$@" ;;
    mla | cascade | head_dims) timeout "$LIMIT" $PY -m "portattn.bench.$name" --out "$dir/$name.json" "$@" ;;
    guard) timeout "$LIMIT" $PY -m portattn.bench.guard "$@" ;;
    probe) PYTHONPATH="$PYTHONPATH:tests" timeout "$LIMIT" $PY scripts/kernels_probe.py "$@" --out "$dir" ;;
    engine | tp) timeout "$LIMIT" $PY -m "benchmarks.$name" --out "$dir" "$@" ;;
    real_model) timeout "$LIMIT" $PY -m benchmarks.real_model --out "$dir/real_model.json" "$@" ;;
    spec_decode) timeout "$LIMIT" $PY -m benchmarks.spec_decode --model "${MODEL:-$($PY -c 'from portattn.testing import smollm2_gguf; print(smollm2_gguf())')}" \
      --device cuda --out "$dir/spec_decode.json" "$@" ;;
    host_path) timeout "$LIMIT" $PY -m benchmarks.host_path --device cuda --out "$dir/host_path.json" "$@" ;;
    vision) timeout "$LIMIT" $PY -m benchmarks.vision --device cuda --out "$dir/vision.json" "$@" ;;
    serve) serve_bench "$dir" "$@" ;;
    mixed)  # the step that prefills an arriving prompt beside 32 decodes: plain, in captured pieces, plain again
      for run in plain piecewise plain2; do
        timeout "$LIMIT" $PY scripts/engine_timeline.py mixed --batch 32 --context 1024 --out "$dir/mixed_$run.json" \
          $([ "$run" = piecewise ] && echo --piecewise) "$@" || return
      done
      timeout 120 $PY scripts/launch_cost.py | tee "$dir/launch_cost.txt" ;;
    *) echo "expected a benchmark in {ops, engine, real_model, host_path, spec_decode, serve, mixed, tp, vision, mla, cascade, head_dims, guard, probe}, got $name"; return 2 ;;
  esac 2>&1
}

[ $# -gt 0 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; }
header | tee "$OUT/env.txt"
: >"$OUT/status.txt"
n=0
for step in "$@"; do
  n=$((n + 1))
  eval "words=($step)"
  kind=${words[0]}
  name=
  first=1
  if [ "$kind" != check ]; then name=${words[1]:-}; first=2; fi
  args=()
  for ((i = first; i < ${#words[@]}; i++)); do
    [ "${words[i]}" = "--" ] && continue
    args+=("${words[i]}")
  done
  dir="$OUT/$n-$kind${name:+-$name}"
  mkdir -p "$dir"
  echo "== $(date -u +%T) step $n: $step"
  SECONDS=0
  case $kind in
    test) run_tests "$name" "$dir" "${args[@]}" ;;
    bench) run_bench "$name" "$dir" "${args[@]}" ;;
    check) timeout "$LIMIT" $PY -m portattn.cli check --json "$dir/check.json" "${args[@]}" 2>&1 ;;
    *) echo "expected a step test, bench or check, got $kind" ;;
  esac >"$dir/log.txt" 2>&1
  status=$?
  tail -n 25 "$dir/log.txt"
  echo "$n $step: exit $status, ${SECONDS} s" | tee -a "$OUT/status.txt"
done
tar -czf "$OUT/results.tar.gz" -C "$OUT" --exclude results.tar.gz . 2>/dev/null
cat "$OUT/status.txt"
