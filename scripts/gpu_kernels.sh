#!/usr/bin/env bash
# Kernel work on a GPU machine, from the repository root (no install needed):
#   OUT=/some/folder STEPS="probe-unaligned tests probe bench" bash scripts/gpu_kernels.sh
# Steps (each with a time limit, so that one slow step cannot take the others' results with it):
#   probe-unaligned  head dims 40/59/72 launched as before the row alignment (own process: it may die
#                    on an illegal access), with the compiled kernels' TTGIR/PTX kept in unaligned_asm.tgz
#   tests            the Triton, head-dim, fp8, MLA and float32 tests on the GPU (fp32, fp16, bf16)
#   probe            scripts/kernels_probe.py fp32 fp8 long (float32 dots, fp8 decode and its tiles,
#                    the long decode over tiles and splits, graph-timed)
#   bench            python -m portattn.bench --graph (every case as CUDA-graph replays)
#   guard            python -m portattn.bench.guard against bench/results/round3_h200/baseline.json
#   sanitize         compute-sanitizer on the unaligned head dim 72 launch
# Logs and JSON go to $OUT (default /tmp/kernels).
set -uo pipefail
OUT=${OUT:-/tmp/kernels}
STEPS=${STEPS:-probe-unaligned tests probe}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
has() { [[ " $STEPS " == *" $1 "* ]]; }
{
  echo "== $(date -u +%FT%TZ) src sha256 $(find src scripts tests -type f \( -name '*.py' -o -name '*.sh' \) | sort | xargs cat | sha256sum | cut -c1-12)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"

if has probe-unaligned; then  # beside the tests (both only check values): its own process and log
  echo "== head dims 40/59/72 with the row alignment forced to 1 (in the background)"
  (TRITON_CACHE_DIR=/tmp/unaligned_cache timeout "${UNALIGNED_LIMIT:-90}" $PY scripts/kernels_probe.py \
    headdims-unaligned --out "$OUT" > "$OUT/unaligned.log" 2>&1; echo "rc=$?" >> "$OUT/unaligned.log"
   cd /tmp/unaligned_cache 2>/dev/null && find . -name 'attention_fwd_kernel.*' \( -name '*.ttgir' -o -name '*.ptx' \) \
    | head -n 12 | tar czf "$OUT/unaligned_asm.tgz" -T -) &
  UNALIGNED_PID=$!
fi

if has tests; then
  echo "== tests (GPU)"
  SECONDS=0
  timeout "${TEST_LIMIT:-170}" $PY -m pytest -q --maxfail=40 -n "${WORKERS:-12}" -p no:cacheprovider \
    ${TESTS:-tests/test_triton_backend.py tests/test_fp8_ops.py tests/test_mla.py tests/test_ops.py::test_paged_head_dims} \
    2>&1 | tail -n 45 | tee "$OUT/tests.log"
  echo "tests: ${SECONDS} s" | tee -a "$OUT/tests.log"
fi

if [ -n "${UNALIGNED_PID:-}" ]; then
  wait "$UNALIGNED_PID"
  grep -v "^\s*$" "$OUT/unaligned.log" | grep -v Warning | tail -n 25
fi

if has probe; then
  echo "== probes: ${PROBES:-fp32 fp8 long}"
  SECONDS=0
  timeout "${PROBE_LIMIT:-200}" $PY scripts/kernels_probe.py ${PROBES:-fp32 fp8 long} --out "$OUT" 2>&1 \
    | tee "$OUT/probe.log" | grep -v Warning
  echo "probe: ${SECONDS} s"
fi

if has bench; then
  echo "== benchmark (graph-timed) and guard"
  SECONDS=0
  timeout "${BENCH_LIMIT:-150}" $PY -m portattn.bench --graph --out "$OUT" --tag bench ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.log"
  echo "bench: ${SECONDS} s"
fi

if has guard; then  # the benchmark guard against the committed baseline (the bench step's JSON when there is none)
  echo "== guard"
  SECONDS=0
  [ -f bench/results/round3_h200/baseline.json ] || { mkdir -p bench/results/round3_h200; \
    cp "$OUT/bench.json" bench/results/round3_h200/baseline.json; echo "baseline: this run's bench.json"; }
  timeout "${GUARD_LIMIT:-60}" $PY -m portattn.bench.guard 2>&1 | tee "$OUT/guard.log"
  echo "guard: ${SECONDS} s"
fi

if has sanitize; then
  echo "== compute-sanitizer: unaligned head dim 72"
  SECONDS=0
  timeout "${SANITIZE_LIMIT:-60}" compute-sanitizer --tool memcheck --print-limit 5 \
    $PY scripts/kernels_probe.py headdims-unaligned --dims 72 --out /tmp/san 2>&1 | grep -v "^\s*$" | head -n 60 \
    | tee "$OUT/sanitize.log"
  echo "sanitize: ${SECONDS} s"
fi
