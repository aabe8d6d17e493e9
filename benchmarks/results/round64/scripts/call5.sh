#!/usr/bin/env bash
# Round 64's fifth call: OUT=... bash benchmarks/results/round64/scripts/call5.sh
#   the clock64 trace of the seesaw kernel with transposing loads and without (trace.patch applied here only)
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round64/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
git apply $S/trace.patch || patch -p1 < $S/trace.patch
PYTHONPATH=src timeout 240 python3 $S/trace.py $OUT 2>&1 | grep -v Warning | tail -8
python3 $S/analyse_trace.py $OUT/trace_*.pt 2>&1 | tee $OUT/analysis.txt
