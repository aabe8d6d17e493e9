#!/usr/bin/env bash
# On a GPU machine, from the repository root, with PYTHONPATH=src (no install needed):
# the op test suite and `portattn check` in every dtype (bf16 and fp16 included), then the benchmark.
# Output goes to $OUT (default bench/results): gpu_check.txt, bench JSON and PNG.
#   PYTHONPATH=src bash scripts/gpu_check.sh [extra args for python -m portattn.bench]
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
LOG="$OUT/h200_gpu_check.txt"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo no-git)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "== tests (GPU: fp32, fp16, bf16)"
  $PY -m pytest -q --maxfail=20 -n 8 -p no:cacheprovider tests/test_ops.py tests/test_triton_backend.py tests/test_bench.py 2>&1 | tail -n 15
  echo "== portattn check"
  $PY -m portattn.cli check --dtype bf16 --dtype fp16 2>&1 | tail -n 80
  echo "== benchmark"
  $PY -m portattn.bench --out "$OUT" --tag h200_bench "$@" 2>&1
} 2>&1 | tee "$LOG"
