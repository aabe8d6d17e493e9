#!/usr/bin/env bash
# round 30, call 6: fp8 weights in the fused small-batch launches (norm_linear, row_linear with weight_scale):
# their GPU tests (bf16 too), the fp8 engine's tests, then the decode steps and prefill timed again (bf16, fp8).
W=$OUT
START=$SECONDS
PYTHONPATH=src:tests PORTATTN_TEST_ENGINE_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 \
  tests/kernels/test_fused_linear.py tests/models/test_fp8_linear.py tests/models/test_fused_linear_layers.py \
  > $W/tests_fp8_fused_gpu_log.txt 2>&1
echo "tests rc $? at $((SECONDS-START))" >> $W/times.txt
[ -f /tmp/ck8b/config.json ] || PYTHONPATH=src timeout 300 python3 -m benchmarks.random_checkpoint /tmp/ck8b --shape llama3-8b --device cuda --dtype bfloat16 > $W/ckpt_log.txt 2>&1
echo "ckpt at $((SECONDS-START))" >> $W/times.txt
PYTHONPATH=src timeout 200 python3 .gpuw/fp8_engine_timing.py /tmp/ck8b $W/fp8_engine_timing_fused.json > $W/fp8_engine_timing_fused_log.txt 2>&1
echo "timing rc $? at $((SECONDS-START))" >> $W/times.txt
