#!/usr/bin/env bash
# Prepared for the next device session (not yet run): about 9 minutes; supersedes round 32's r32c1.sh. The two
# Gluon MLA kernels (mla_decode_fp8_mma: up to 16 heads over e4m3; mla_decode_wide: 64-head blocks over bf16,
# fp16, e4m3, e5m2): their GPU tests, the ops' MLA tests with both switched on (the kernels where they run, the
# fallback elsewhere), then the mla-fp8 probe (16 heads: the fp8_mma tiles first; 128 heads: the wide tiles
# beside the portable ones). Run from the repository root:
#   OUT=... bash benchmarks/results/round33_h200/scripts/r33c1.sh
W=$OUT
START=$SECONDS
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $W/gpu.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $W/gpu.txt 2>&1
PYTHONPATH=src:tests timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 tests/kernels/test_mla_wide.py \
  tests/kernels/test_mla_fp8_mma.py > $W/tests_gluon_mla_gpu_log.txt 2>&1
echo "kernel tests rc $? at $((SECONDS-START))" >> $W/times.txt
PYTHONPATH=src:tests timeout 120 python3 -c "
import sys, pytest
import portattn.kernels.triton.mla_decode_launch as m
m.FP8_MMA = m.WIDE = True
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/ops/test_mla.py', 'tests/ops/test_fp8_ops.py',
                      'tests/models/test_deepseek_v3.py', '-k', 'mla or deepseek or fp8']))
" > $W/tests_ops_mla_gluon_on_log.txt 2>&1
echo "ops tests rc $? at $((SECONDS-START))" >> $W/times.txt
PYTHONPATH=src:tests timeout $(( 570 - (SECONDS-START) )) python3 scripts/kernels_probe.py mla-fp8 --out $W/probe \
  > $W/probe_mla_fp8_log.txt 2>&1
echo "probe rc $? at $((SECONDS-START))" >> $W/times.txt
