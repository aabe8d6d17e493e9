#!/usr/bin/env bash
# Round 38, call 0 (no carry, about 4 minutes): round 37's call 3 without its burst A/B, for a short device window:
# the fp8 linears' quantizing launches (on by default since round 37) tested on the GPU before any fp8 server runs,
# then their probe (each launch against the two it replaces, graph replays, bytes against copy).
#   OUT=... bash benchmarks/results/round38/scripts/r38c0.sh
export PYTHONPATH=src
START=$SECONDS
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1; cat $OUT/gpu.txt
PORTATTN_TEST_ENGINE_DEVICE=cuda PYTHONPATH=src:tests timeout 200 python3 -m pytest -q -p no:cacheprovider \
  tests/models/test_fp8_linear.py tests/kernels/test_fused_kernels.py > $OUT/tests.txt 2>&1; tail -n 3 $OUT/tests.txt
grep -E "^(FAILED|ERROR)" $OUT/tests.txt | head -20
timeout 120 python3 scripts/fp8_fusion_probe.py --out $OUT > $OUT/fusion_probe.txt 2>&1; cat $OUT/fusion_probe.txt
echo "call took $((SECONDS - START)) s"
