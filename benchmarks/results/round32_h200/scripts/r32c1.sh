#!/usr/bin/env bash
# Prepared for the next device session (not yet run): about 6 minutes. MLA decode over an e4m3 cache through
# the Gluon kernel (mla_decode_fp8_mma): its GPU tests, the ops' MLA tests with the kernel chosen by default,
# then the mla-fp8 probe (its rows first). Run from the repository root:
#   OUT=... bash benchmarks/results/round32_h200/scripts/r32c1.sh
W=$OUT
START=$SECONDS
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $W/gpu.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $W/gpu.txt 2>&1
PYTHONPATH=src:tests timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_fp8_mma.py \
  > $W/tests_mla_fp8_mma_gpu_log.txt 2>&1
echo "kernel tests rc $? at $((SECONDS-START))" >> $W/times.txt
# the ops' MLA and fp8 tests with FP8_MMA on: the kernel where it runs (512 + 64 latents), the fallback elsewhere
PYTHONPATH=src:tests timeout 150 python3 -c "
import sys, pytest
import portattn.kernels.triton.mla_decode_launch as m
m.FP8_MMA = True
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/ops/test_mla.py', 'tests/ops/test_fp8_ops.py',
                      'tests/models/test_deepseek_v3.py', '-k', 'mla or deepseek or fp8']))
" > $W/tests_ops_mla_fp8_mma_on_log.txt 2>&1
echo "ops tests rc $? at $((SECONDS-START))" >> $W/times.txt
PYTHONPATH=src:tests timeout $(( 570 - (SECONDS-START) )) python3 scripts/kernels_probe.py mla-fp8 --out $W/probe \
  > $W/probe_mla_fp8_log.txt 2>&1
echo "probe rc $? at $((SECONDS-START))" >> $W/times.txt
