#!/usr/bin/env bash
# Round 65's second call: OUT=... bash benchmarks/results/round65/scripts/call2.sh [NAME=value ...]
#   python -m portattn.bench.mla --fp8 (17, 64, 128 heads): the defaults, then with the settings given
#   (scripts/bench_with.py).
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round65/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
ARGS="--fp8 --no-torch --page-sizes 64 --batches 64 --heads 17,64,128 --lengths 4096"
PYTHONPATH=src timeout 120 python3 -m portattn.bench.mla $ARGS --label "$(cat $OUT/gpu.txt), round 65 defaults" \
  --out $OUT/bench_defaults.json 2>&1 | grep -v Warning | tee $OUT/bench_defaults.txt
PYTHONPATH=src timeout 120 python3 $S/bench_with.py "$@" -- $ARGS --label "$(cat $OUT/gpu.txt), round 65, $*" \
  --out $OUT/bench_with.json 2>&1 | grep -v Warning | tee $OUT/bench_with.txt
