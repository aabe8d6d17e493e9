#!/usr/bin/env bash
# Prepared for the next device session (not yet run): call 1 of 3, about 8 minutes.
# The fp8 row_linear read as words (inline PTX): its GPU tests, then the decode-step A/B of the three one-row
# paths over fp8 weights against bf16 (8B shape). Run from the repository root:
#   OUT=... bash benchmarks/results/engine_h200/round31/scripts/r31c1.sh
W=$OUT
S=benchmarks/results/engine_h200/round31/scripts
START=$SECONDS
mkdir -p /tmp/gguf_parts && cp .gguf_a/* /tmp/gguf_parts/ 2>/dev/null  # half of the real model's GGUF (call 3 joins)
PYTHONPATH=src:tests PORTATTN_TEST_ENGINE_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 \
  tests/kernels/test_fused_linear.py tests/models/test_fp8_linear.py -k "fp8 or row_linear or words" \
  > $W/tests_fp8_words_gpu_log.txt 2>&1
echo "tests rc $? at $((SECONDS-START))" >> $W/times.txt
[ -f /tmp/ck8b/config.json ] || PYTHONPATH=src timeout 300 python3 -m benchmarks.random_checkpoint /tmp/ck8b \
  --shape llama3-8b --device cuda --dtype bfloat16 > $W/ckpt_log.txt 2>&1
echo "ckpt at $((SECONDS-START))" >> $W/times.txt
PYTHONPATH=src timeout $(( 560 - (SECONDS-START) )) python3 $S/fp8_decode_ab.py /tmp/ck8b $W/fp8_decode_ab.json \
  > $W/fp8_decode_ab_log.txt 2>&1
echo "timing rc $? at $((SECONDS-START))" >> $W/times.txt
