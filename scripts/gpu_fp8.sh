#!/usr/bin/env bash
# fp8 KV caches on a GPU machine, from the repository root (no install needed):
#   1. the fp8 op, write-path and benchmark tests on the GPU (Triton natively; fp32, fp16, bf16),
#   2. the fp8 engine tests with the engine on the GPU (its default backend),
#   3. the decode benchmark: fp8 e4m3 B=64 x 4096 against the same call on the bf16 cache and the
#      bf16 decode case (targets: >= 1.8x bf16, >= 90% of copy counted in fp8 bytes),
#   4. `portattn check --json` (bf16, page sizes 1, 7, 16): every row, fp8 and MLA included.
# FP8_SWEEP=1 also times other tiles and split counts for the fp8 case. Each step has a time limit
# (the whole script stays under 10 minutes). Everything goes to $OUT (default benchmarks/results):
# gpu_fp8.log, fp8_bench.json, fp8_bench.png, check.json.
#   OUT=/tmp/fp8 bash scripts/gpu_fp8.sh
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  echo "== $(date -u +%FT%TZ) src sha256 $(find src scripts tests -type f \( -name '*.py' -o -name '*.sh' \) | sort | xargs cat | sha256sum | cut -c1-12)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "== fp8 tests (GPU)"
  timeout "${TEST_LIMIT:-180}" $PY -m pytest -q --maxfail=20 -n 8 -p no:cacheprovider \
    tests/test_fp8_ops.py tests/test_fp8_cache.py tests/test_bench.py 2>&1 | tail -n 25
  echo "== fp8 engine tests (engine on the GPU)"
  PORTATTN_TEST_ENGINE_DEVICE=cuda timeout "${ENGINE_LIMIT:-120}" $PY -m pytest -q -n 4 -p no:cacheprovider \
    tests/engine/test_fp8_engine.py 2>&1 | tail -n 15
  echo "== benchmark: fp8 and bf16 decode"
  timeout "${BENCH_LIMIT:-100}" $PY -m portattn.bench --case "decode B=64 L=4096 P=16" --out "$OUT" --tag fp8_bench 2>&1
  if [ "${FP8_SWEEP:-0}" = 1 ]; then
    echo "== sweep: fp8 decode tiles and splits"
    timeout "${SWEEP_LIMIT:-120}" $PY -m portattn.bench --case "fp8 e4m3 decode" --sweep --out /tmp --tag fp8_sweep 2>&1 \
      | grep -E "^sweep|fp8"
  fi
  echo "== portattn check --json (bf16)"
  timeout "${CHECK_LIMIT:-150}" $PY -m portattn.cli check --dtype bf16 --page-size 1 --page-size 7 --page-size 16 \
    --json "$OUT/check.json" 2>&1
} 2>&1 | tee "$OUT/gpu_fp8.log"
