#!/usr/bin/env bash
# One device call that runs several GPU scripts side by side on a two-GPU machine (nvidia-h200-x2):
# each lane is a list of "script args" run one after the other on its own GPU. Every script writes
# under $OUT/<lane>/; at the end the folder is packed into $OUT/results.tar.gz (one file comes back).
#   OUT=/tmp/o LANE0="bash scripts/gpu_engine.sh tests;bash scripts/gpu_engine.sh decode" \
#     LANE1="STEPS=tests bash scripts/gpu_issue17.sh" bash scripts/gpu_wave.sh
# Each step is a shell command (environment assignments first, as usual). AFTER runs once both lanes
# are done (e.g. timings that need a quiet GPU). On a one-GPU
# machine ONE_GPU=0 runs both lanes on that GPU (for tests, not for timings).
set -uo pipefail
OUT=${OUT:-/tmp/wave}
export PYTHONPATH=src PYTHONUNBUFFERED=1
run_lane() {
  local gpu=$1 steps=$2 dir="$OUT/lane$1"
  mkdir -p "$dir"
  IFS=';' read -ra items <<<"$steps"
  local i=0
  for item in "${items[@]}"; do
    [ -z "${item// }" ] && continue
    i=$((i + 1))
    echo "== $(date -u +%T) lane $gpu: $item"
    (export CUDA_VISIBLE_DEVICES=${ONE_GPU:-$gpu} OUT="$dir"; eval "$item") >"$dir/step$i.log" 2>&1
    echo "== $(date -u +%T) lane $gpu: done $item (exit $?)"
  done
}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
[ -n "${BOTH:-}" ] && { echo "== both GPUs: $BOTH"; mkdir -p "$OUT/both"; (export OUT="$OUT/both"; eval "$BOTH") >"$OUT/both/run.log" 2>&1; }
LIMIT_LANE=${LIMIT_LANE:-540}
timeout "$LIMIT_LANE" bash -c "$(declare -f run_lane); OUT='$OUT'; run_lane 0 \"${LANE0:-}\"" &
timeout "$LIMIT_LANE" bash -c "$(declare -f run_lane); OUT='$OUT'; run_lane 1 \"${LANE1:-}\"" &
wait
[ -n "${AFTER:-}" ] && { echo "== after the lanes: $AFTER"; mkdir -p "$OUT/after"; (export CUDA_VISIBLE_DEVICES=0 OUT="$OUT/after"; timeout "${LIMIT_AFTER:-300}" bash -c "$AFTER") >"$OUT/after/run.log" 2>&1; }
tar -czf "$OUT/results.tar.gz" -C "$OUT" --exclude results.tar.gz . && ls -la "$OUT"
