#!/usr/bin/env bash
# A short GPU check of the families added in this release (one H200, about 4 minutes):
# each family's parity with transformers at two cells of the matrix (page 7 whole prompts; page 1
# with prefix caching and chunks of 8), the MXFP4 gpt-oss checkpoint at one cell, and captured decode
# graphs against the eager engine (fp32 and bf16), all with the engine on the GPU. One pytest process
# per family, side by side; logs under $OUT. From the repository root:
#   OUT=/tmp/q PYTHONPATH=src bash scripts/gpu_families_quick.sh
set -uo pipefail
OUT=${OUT:-/tmp/families_quick}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PORTATTN_TEST_ENGINE_DEVICE=cuda
PY=${PYTHON:-python3}
LIMIT=${LIMIT:-190}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} >"$OUT/versions.txt" 2>&1
CELLS="p7-noprefix-whole or p1-prefix-chunked8 or 7-True-True or clamps"
for family in gpt_oss gemma2 gemma3 mistral; do
  timeout "$LIMIT" $PY -m pytest -v -p no:cacheprovider --tb=short -rfE "tests/engine/test_$family.py" -k "$CELLS" \
    >"$OUT/parity_$family.log" 2>&1 &
done
# The MoE families, Phi-3 and FP8 weight checkpoints (parity cells of test_parity.py, ids family-page-...).
timeout "$LIMIT" $PY -m pytest -v -p no:cacheprovider --tb=short -rfE tests/engine/test_parity.py \
  tests/engine/test_fp8_weights.py -k "(qwen2_moe or qwen3_moe or mixtral or phi3) and 7-prefix-chunked8 or fp8" \
  >"$OUT/parity_more.log" 2>&1 &
timeout "$LIMIT" $PY -m pytest -v -n 2 -p no:cacheprovider --tb=short -rfE tests/engine/test_graphs_gpu.py \
  -k "mistral or mixtral or phi3 or gemma2 or gemma3 or gpt_oss or qwen2_moe or qwen3_moe" >"$OUT/graphs.log" 2>&1 &
wait
grep -h -E "passed|failed|error" "$OUT"/*.log | grep -E "^=+ .* in [0-9.]+s" >"$OUT/summary.txt"
cat "$OUT/versions.txt" "$OUT/summary.txt"
