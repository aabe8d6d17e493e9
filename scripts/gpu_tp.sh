#!/usr/bin/env bash
# On a machine with two GPUs (nvidia-h200-x2), from the repository root, with PYTHONPATH=src:
#   PYTHONPATH=src bash scripts/gpu_tp.sh tests   # tests/distributed with NCCL, engines on cuda:0 + cuda:1
#   PYTHONPATH=src bash scripts/gpu_tp.sh bench   # python -m benchmarks.tp (Llama-3-8B shape, bf16)
# (no argument: both, one after the other; each part stays within 10 minutes). Results go to $OUT
# (default benchmarks/results): tp_gpu_<part>.txt logs, tp.json and tp_notes.md from the benchmark.
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
PARTS=${1:-tests bench}

header() {
  echo "== $(date -u +%FT%TZ) src sha256 $(find src scripts -type f -name '*.py' -o -name '*.sh' | sort | xargs cat | sha256sum | cut -c1-12)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>/dev/null
  nvidia-smi topo -m 2>/dev/null
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
}

for part in $PARTS; do
  case $part in
    tests)
      {
        header
        echo "== tests/distributed, NCCL (PORTATTN_TEST_ENGINE_DEVICE=cuda)"
        PORTATTN_TEST_ENGINE_DEVICE=cuda timeout "${TEST_LIMIT:-540}" $PY -m pytest -q -p no:cacheprovider \
          --durations=20 tests/distributed 2>&1 | grep -v "^DEBUG" | tail -n 60
      } 2>&1 | tee "$OUT/tp_gpu_tests.txt"
      ;;
    bench)
      {
        header
        echo "== python -m benchmarks.tp"
        timeout "${BENCH_LIMIT:-560}" $PY -m benchmarks.tp --out "$OUT" \
          --checkpoint "${TP_CHECKPOINT:-/tmp/portattn_llama3_8b_shape}" 2>&1 | grep -v "loading weights"
      } 2>&1 | tee "$OUT/tp_gpu_bench.txt"
      ;;
    *)
      echo "expected a part in {tests, bench}, got $part" >&2
      exit 2
      ;;
  esac
done
