#!/usr/bin/env bash
# If the register form is correct and faster: the benchmark with it and without it (same machine, one after the
# other, nothing beside), then the MLA fp8 GPU tests with it.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round61/scripts
A="--fp8 --no-torch --page-sizes 64 --batches 64 --heads 17,64,128 --lengths 4096"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout 200 python3 $S/bench_vregs.py on $A --out $OUT/bench_vregs.json 2>&1 | grep -v Warning | tee $OUT/bench_vregs.txt
PYTHONPATH=src timeout 200 python3 $S/bench_vregs.py off $A --out $OUT/bench_seesaw.json 2>&1 | grep -v Warning | tee $OUT/bench_seesaw.txt
