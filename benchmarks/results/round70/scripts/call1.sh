#!/usr/bin/env bash
# Round 70's call: OUT=... bash benchmarks/results/round70/scripts/call1.sh
#   1. python -m portattn.bench.mla --fp8 at 17, 32, 64 and 128 heads over 4096 keys (round 69's defaults), alone;
#   2. round 69's forms.py (round 68's step, ONE_PASS, KEEP_QUERIES, both) at 17 and 64 heads, three rounds;
#   3. the GPU tests round 69 left: the 16-head fp8-values case and the four-switch PDL / early-copies test.
set -f
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout 120 python3 -m portattn.bench.mla --fp8 --no-torch --page-sizes 64 --batches 64 \
  --heads 17,32,64,128 --lengths 4096 --label "$(cat $OUT/gpu.txt), round 70" --out $OUT/bench.json 2>&1 \
  | grep -v Warning | tee $OUT/bench.txt
PYTHONPATH=src timeout 300 python3 benchmarks/results/round69/scripts/forms.py --cases 17:4096,64:4096 --rounds 3 2>&1 \
  | grep -v Warning | tee $OUT/forms.txt
PYTHONPATH=src:tests timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 -rA tests/kernels/test_mla_wide_fp8.py \
  -k "pdl_and_early or (fp8_values and (64-64-16 or 64-64-17))" 2>&1 | grep -v Warning > $OUT/tests_full.txt
grep -E "PASSED|passed|failed|Error|FAILED|SKIPPED" $OUT/tests_full.txt | tail -40 | tee $OUT/tests.txt
