#!/usr/bin/env bash
# On a GPU machine, from the repository root, with PYTHONPATH=src (no install needed):
# the op test suite on the GPU (fp32, fp16, bf16), `portattn check` (bf16), the attention benchmark
# and the vision-tower benchmark. Each step has a time limit so that one slow step cannot take the
# others' results with it. Output goes to $OUT (default benchmarks/results).
#   PYTHONPATH=src bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
LOG="$OUT/h200_gpu_check.txt"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  # A hash of the source files as they are on this machine (a copied .git may lag behind them).
  echo "== $(date -u +%FT%TZ) src sha256 $(find src scripts -type f -name '*.py' -o -name '*.sh' | sort | xargs cat | sha256sum | cut -c1-12)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "== tests (GPU: fp32, fp16, bf16)"
  timeout "${TEST_LIMIT:-240}" $PY -m pytest -q --maxfail=20 -n 8 -p no:cacheprovider \
    tests/test_ops.py tests/test_triton_backend.py tests/test_mla.py tests/test_encoder.py 2>&1 | tail -n 25
  echo "== portattn check (bf16)"
  timeout "${CHECK_LIMIT:-110}" $PY -m portattn.cli check --dtype bf16 --page-size 1 --page-size 7 --page-size 64 2>&1
  echo "== benchmark"
  timeout "${BENCH_LIMIT:-80}" $PY -m portattn.bench --out "$OUT" --tag h200_bench 2>&1
  echo "== vision benchmark"
  timeout "${VISION_LIMIT:-90}" $PY -m benchmarks.vision --device cuda --out "$OUT/vision_h200.json" 2>&1
} 2>&1 | tee "$LOG"
