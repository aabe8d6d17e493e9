#!/usr/bin/env bash
# LSE, merging, cascade attention, ALiBi, window_right and any head dim on a GPU, from the
# repository root (no install needed; PYTHONPATH is set here):
#   OUT=/some/folder bash scripts/gpu_issue17.sh                 # every step (up to about 13 minutes)
#   STEPS="tests check" OUT=... bash scripts/gpu_issue17.sh      # some steps, e.g. in two calls of
#   STEPS="cascade head_dims" OUT=... bash scripts/gpu_issue17.sh  # under 10 minutes each
# Steps: the op, Triton, LSE/merge, cascade and MLA tests on the GPU (fp32, fp16, bf16; the Triton
# head-dim test covers every multiple of 8 up to 256 there), `portattn check` in fp16 and bf16,
# the cascade benchmark (with the shared-pass split sweep) and the head-dim benchmark. Each step
# has a time limit so that one slow step cannot take the others' results with it. Logs and JSON
# go to $OUT (default /tmp/issue17).
set -uo pipefail
OUT=${OUT:-/tmp/issue17}
STEPS=${STEPS:-tests check cascade head_dims}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
has() { [[ " $STEPS " == *" $1 "* ]]; }
{
  echo "== $(date -u +%FT%TZ) src sha256 $(find src scripts -type f \( -name '*.py' -o -name '*.sh' \) | sort | xargs cat | sha256sum | cut -c1-12)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"

if has tests; then
  echo "== tests (GPU: fp32, fp16, bf16)"
  SECONDS=0
  timeout "${TEST_LIMIT:-300}" $PY -m pytest -q --maxfail=30 -n 8 -p no:cacheprovider --durations=15 \
    tests/test_ops.py tests/test_triton_backend.py tests/test_lse_merge.py tests/test_cascade.py tests/test_mla.py \
    --junitxml="$OUT/tests.xml" 2>&1 | tail -n 60 | tee "$OUT/tests.log"
  echo "tests: ${SECONDS} s" | tee -a "$OUT/tests.log"
fi

if has check; then
  echo "== portattn check (fp16, bf16)"
  SECONDS=0
  timeout "${CHECK_LIMIT:-120}" $PY -m portattn.cli check --dtype fp16 --dtype bf16 --page-size 1 --page-size 7 \
    --page-size 64 2>&1 | tee "$OUT/check.log"
  echo "check: ${SECONDS} s" | tee -a "$OUT/check.log"
fi

if has cascade; then
  echo "== cascade benchmark"
  SECONDS=0
  timeout "${CASCADE_LIMIT:-240}" $PY -m portattn.bench.cascade --sweep --label "$(cat "$OUT/gpu.txt" 2>/dev/null)" \
    --out "$OUT/cascade.json" 2>&1 | tee "$OUT/cascade.log"
  echo "cascade: ${SECONDS} s" | tee -a "$OUT/cascade.log"
fi

if has head_dims; then
  echo "== head-dim benchmark"
  SECONDS=0
  timeout "${HEAD_DIMS_LIMIT:-200}" $PY -m portattn.bench.head_dims --out "$OUT/head_dims.json" 2>&1 \
    | tee "$OUT/head_dims.log"
  echo "head_dims: ${SECONDS} s" | tee -a "$OUT/head_dims.log"
fi
