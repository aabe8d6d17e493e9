#!/usr/bin/env bash
# The gpt-oss, Gemma 2, Gemma 3 and Mistral parity tests with the engine on a GPU (its default
# backend, float32; transformers' reference stays on the CPU), which backend the engine picks for
# each family, and `portattn check` (every dtype, page sizes 1, 7, 16) for the features they use.
# From the repository root:
#   PYTHONPATH=src bash scripts/gpu_families.sh
# Writes $OUT/families_gpu.log, $OUT/families_gpu.xml (JUnit) and $OUT/families_gpu.json (counts).
set -uo pipefail
OUT=${OUT:-/tmp/families}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PORTATTN_TEST_ENGINE_DEVICE=${PORTATTN_TEST_ENGINE_DEVICE:-cuda}
PY=${PYTHON:-python3}
TESTS="tests/engine/test_gpt_oss.py tests/engine/test_gemma2.py tests/engine/test_gemma3.py tests/engine/test_mistral.py"
{
  echo "== $(date -u +%FT%TZ) src sha256 $(find src scripts tests -type f \( -name '*.py' -o -name '*.sh' \) | sort | xargs cat | sha256sum | cut -c1-12)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  echo "== backend picked per family (engine on $PORTATTN_TEST_ENGINE_DEVICE)"
  timeout "${PICK_LIMIT:-120}" $PY - <<'PYEOF' 2>&1
import os, tempfile
from transformers.utils import logging
from portattn.engine.llm import LLM
from portattn.testing import save_tiny_checkpoint
logging.disable_progress_bar()
with tempfile.TemporaryDirectory() as root:
    for family in ("gpt_oss", "gemma2", "gemma3", "mistral"):
        engine = LLM(save_tiny_checkpoint(family, f"{root}/{family}"), num_pages=8, max_model_len=128, device=os.environ["PORTATTN_TEST_ENGINE_DEVICE"]).engine
        features = sorted(set().union(*(layer.features for layer in engine.model.attention_layers())))
        print(f"{family:8} backend {engine.backend.name:7} features {features}")
PYEOF
  echo "== parity tests (engine on $PORTATTN_TEST_ENGINE_DEVICE)"
  timeout "${TEST_LIMIT:-420}" $PY -m pytest -q -n "${WORKERS:-4}" -p no:cacheprovider -rfE $TESTS --junitxml "$OUT/families_gpu.xml" 2>&1 | tail -n 40
  echo "== portattn check"
  timeout "${CHECK_LIMIT:-150}" $PY -m portattn.cli check --page-size 1 --page-size 7 --page-size 16 2>&1
} 2>&1 | tee "$OUT/families_gpu.log"
$PY - "$OUT" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
counts = {}
try:
    for case in ET.parse(f"{out}/families_gpu.xml").iter("testcase"):
        family = case.get("classname", "").rsplit(".", 1)[-1].removeprefix("test_")
        state = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        counts.setdefault(family, {"passed": 0, "failed": 0, "skipped": 0})[state] += 1
except (FileNotFoundError, ET.ParseError) as err:
    counts = {"error": str(err)}
json.dump(counts, open(f"{out}/families_gpu.json", "w"), indent=2)
print(json.dumps(counts))
PYEOF
