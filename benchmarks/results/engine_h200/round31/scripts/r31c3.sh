#!/usr/bin/env bash
# Prepared for the next device session (not yet run): call 3 of 3. The real model with fp8 linears on the GPU
# (bfloat16: perplexity against the unquantized engine, answers), the GGUF joined from the two parts carried in
# the two calls before, then the piecewise GPU tests. The GGUF (98 MB, over one call's 64 MiB carry) goes in two halves, made here before the session with
#   G=$(PYTHONPATH=src python -c "from portattn.testing.gguf import smollm2_gguf; print(smollm2_gguf())")
#   mkdir -p .gguf_a .gguf_b && split -b 50M "$G" /tmp/part_ && mv /tmp/part_aa .gguf_a/ && mv /tmp/part_ab .gguf_b/
#   (both folders in .git/info/exclude), call 1 carrying .gguf_a and call 2 .gguf_b on the same warm machine.
W=$OUT
START=$SECONDS
mkdir -p /tmp/gguf_parts && cp .gguf_b/* /tmp/gguf_parts/ 2>/dev/null  # (when this call carries .gguf_b)
cat /tmp/gguf_parts/part_a? > /tmp/smollm2.gguf && ls -l /tmp/smollm2.gguf >> $W/times.txt
PYTHONPATH=src timeout 240 python3 -m benchmarks.real_model --model /tmp/smollm2.gguf --dtype bfloat16 \
  --quantization fp8 --out $W/real_model_fp8.json > $W/real_model_fp8_log.txt 2>&1
echo "real model rc $? at $((SECONDS-START))" >> $W/times.txt
PYTHONPATH=src:tests PORTATTN_TEST_ENGINE_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 \
  tests/engine/test_piecewise.py tests/engine/test_piecewise_gpu.py > $W/tests_piecewise_gpu_log.txt 2>&1
echo "piecewise tests rc $? at $((SECONDS-START))" >> $W/times.txt
