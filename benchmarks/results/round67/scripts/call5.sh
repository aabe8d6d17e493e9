#!/usr/bin/env bash
# Round 67's last call, on the tree to land (MERGE_IN_KERNEL removed):
#   OUT=... bash benchmarks/results/round67/scripts/call5.sh
#   1. python -m portattn.bench.mla --fp8 (cold L2: a page table per input set) at 17, 64 and 128 heads over 4096 keys,
#      alone on the GPU;
#   2. the seesaw tests, the fp8-values GPU test's seesaw cases (64 heads page 64, 17 heads page 64, 32 heads page 16)
#      and the launcher's default fp8 MLA tests (four processes);
#   3. bench.mla --fp8 at 17 heads over 8192 keys (what of the step does not grow with the keys), if time is left.
set -f
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout 100 python3 -m portattn.bench.mla --fp8 --no-torch --page-sizes 64 --batches 64 \
  --heads 17,64,128 --lengths 4096 --label "$(cat $OUT/gpu.txt), round 67" --out $OUT/bench.json 2>&1 \
  | grep -v Warning | tee $OUT/bench.txt
PYTHONPATH=src:tests timeout 170 python3 -m pytest -q -p no:cacheprovider -n 4 -rP tests/kernels/test_mla_seesaw_fp8.py \
  tests/kernels/test_mla_fp8_scores_default.py tests/kernels/test_mla_wide_fp8.py \
  -k "not fp8_values or 64-64-64 or 64-64-17 or 16-64-32" 2>&1 | grep -v Warning > $OUT/tests_full.txt
grep -E "splits, TMA, seesaw|passed|failed|Error|FAILED" $OUT/tests_full.txt | tail -60 | tee $OUT/tests.txt
PYTHONPATH=src timeout 45 python3 -m portattn.bench.mla --fp8 --no-torch --page-sizes 64 --batches 64 \
  --heads 17 --lengths 8192 --label "$(cat $OUT/gpu.txt), round 67, 8192 keys" --out $OUT/bench_8192.json 2>&1 \
  | grep -v Warning | tee $OUT/bench_8192.txt
