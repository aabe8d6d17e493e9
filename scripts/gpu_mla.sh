#!/usr/bin/env bash
# MLA decode on a GPU machine, in one go: the MLA tests on the real Triton backend (fp32, fp16,
# bf16), then the benchmark. Logs and the JSON go to $OUT (default /tmp/mla); the bench arguments
# can be overridden with MLA_BENCH_ARGS (default: --sweep).
set -uo pipefail
out=${OUT:-/tmp/mla}
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
timeout 170 python3 -m pytest tests/test_mla.py -q -x -n 8 -p no:cacheprovider 2>&1 | tee "$out/tests.log"
timeout 290 python3 -m portattn.bench.mla ${MLA_BENCH_ARGS:---sweep} --label "$(cat "$out/gpu.txt")" \
    --out "$out/mla_h200.json" 2>&1 | tee "$out/bench.log"
