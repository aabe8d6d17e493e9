#!/usr/bin/env bash
# The hardening tests on a GPU machine, from the repository root (no install needed):
#   PYTHONPATH=src OUT=/tmp/hardening bash scripts/gpu_hardening.sh
# 1. op rules on the real Triton backend (fp32, fp16, bf16): queries beyond the keys, all-empty
#    batches, page-table checks, refusals; 2. the engine-boundary and checkpoint tests where CUDA
#    exists (a device index past the last GPU is refused; the no-CUDA cases skip); 3. the engine
#    parity tests with the engine on the GPU, which now pass the start-up checks. Writes
#    $OUT/summary.json (exit status and test counts per step) and one log per step.
set -uo pipefail
out=${OUT:-/tmp/hardening}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee "$out/versions.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | tee -a "$out/versions.txt"

step() {  # step NAME LIMIT ARGS...: pytest ARGS under a time limit, results to $out/NAME.{log,xml}
  local name=$1 limit=$2
  shift 2
  timeout "$limit" $PY -m pytest -q -p no:cacheprovider --junitxml="$out/$name.xml" "$@" >"$out/$name.log" 2>&1
  echo "$name: exit $?" | tee -a "$out/status.txt"
  tail -n 3 "$out/$name.log"
}
: >"$out/status.txt"
step ops 240 -n 8 tests/test_hardening_ops.py tests/test_hardening_paging.py tests/test_validation.py tests/test_mla.py
step engine_boundary 240 -n 4 tests/engine/test_hardening_inputs.py tests/engine/test_hardening_checkpoints.py
PORTATTN_TEST_ENGINE_DEVICE=cuda step parity_cuda 300 -n 4 tests/engine -k "matches_transformers or image_prompt"
$PY - "$out" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
summary = {}
for line in (out / "status.txt").read_text().splitlines():
    name, status = line.split(": exit ")
    entry = {"exit": int(status)}
    xml = out / f"{name}.xml"
    if xml.exists():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        entry |= {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary[name] = entry
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
PY
