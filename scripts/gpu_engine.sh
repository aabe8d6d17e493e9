#!/usr/bin/env bash
# The engine on a GPU, in steps that each fit a 10-minute call (results under $OUT, default benchmarks/results):
#   PYTHONPATH=src bash scripts/gpu_engine.sh tests        # graphs vs eager for every family + parity with graphs on
#   PYTHONPATH=src bash scripts/gpu_engine.sh decode       # copy bandwidth, decode step times vs the limit, launches
#   PYTHONPATH=src bash scripts/gpu_engine.sh throughput   # 512 x (1024 + 256) offline, portattn
#   PYTHONPATH=src bash scripts/gpu_engine.sh hf           # the same through transformers (eager; static cache + compile)
#   PYTHONPATH=src bash scripts/gpu_engine.sh coldstart    # fresh process, empty Triton cache, bf16
#   PYTHONPATH=src bash scripts/gpu_engine.sh coldstart-fp32  # the same in float32
#   PYTHONPATH=src bash scripts/gpu_engine.sh families     # Llama 4- and DeepSeek-V3-shaped models with graphs
# Each benchmark step writes engine_<part>.json; engine_gpu.md and engine_decode.png are rebuilt from every
# engine_*.json found in $OUT (copy earlier steps' JSON there to get one report).
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
STEP=${1:-tests}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOG="$OUT/gpu_engine_${STEP}.txt"
bench() { timeout "${LIMIT:-560}" $PY -m benchmarks.engine --out "$OUT" "$@" 2>&1; }
{
  echo "== $(date -u +%FT%TZ) $STEP; src sha256 $(find src scripts -type f -name '*.py' -o -name '*.sh' | sort | xargs cat | sha256sum | cut -c1-12)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  case "$STEP" in
    tests)
      timeout "${LIMIT:-250}" $PY -m pytest -q -n 4 -p no:cacheprovider --maxfail=20 \
        tests/test_graph_plan.py tests/test_fused_kernels.py 2>&1 | tail -n 20
      PORTATTN_TEST_ENGINE_DEVICE=cuda timeout "${LIMIT:-330}" $PY -m pytest -q -n 4 -p no:cacheprovider --maxfail=20 \
        tests/engine/test_graphs_gpu.py tests/engine/test_parity.py tests/engine/test_deepseek_v3.py \
        tests/engine/test_qwen2_5_vl.py -k "graphs or matches_transformers or image_prompt" 2>&1 | tail -n 40 ;;
    decode) bench --parts copy decode launches ;;
    throughput) bench --parts throughput ;;
    hf) bench --parts hf hf-compile ;;
    coldstart) bench --parts coldstart --cold-dtypes bfloat16 ;;
    coldstart-fp32) bench --parts coldstart --cold-dtypes float32 ;;
    families) bench --parts llama4 deepseek ;;
    *) echo "unknown step $STEP (tests, decode, throughput, hf, coldstart, coldstart-fp32, families)"; exit 2 ;;
  esac
} 2>&1 | tee "$LOG"
