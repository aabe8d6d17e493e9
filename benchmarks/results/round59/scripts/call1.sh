#!/usr/bin/env bash
# Round 59, call 1: the in-kernel merge checked and timed; half_early_scores.patch tested and timed; the seesaw
# kernel's time against its tiles; the MLA benchmark's graph-replay form.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round59/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout 150 python3 $S/check_merge.py 2>&1 | grep -v Warning | tee $OUT/check_merge.txt
PYTHONPATH=src timeout 100 python3 $S/many.py $S/cases_merge.txt 90 2>&1 | grep -v Warning | tee $OUT/times_merge.txt
patch -p1 < $S/half_early_scores.patch > /dev/null
PYTHONPATH=src:tests timeout 90 python3 -m pytest -q -p no:cacheprovider -rf \
  -k "fp8_values and (64-64-64 or 16-64-100 or 8-64-40)" tests/kernels/test_mla_wide_fp8.py 2>&1 \
  | grep -v Warning | tail -n 5 | tee $OUT/tests_half_early.txt
PYTHONPATH=src timeout 75 python3 $S/many.py $S/cases_half.txt 65 2>&1 | grep -v Warning | tee $OUT/times_half.txt
patch -R -p1 < $S/half_early_scores.patch > /dev/null
PYTHONPATH=src timeout 60 python3 $S/many.py $S/cases_sweep.txt 50 2>&1 | grep -v Warning | tee $OUT/sweep.txt
PYTHONPATH=src timeout 70 python3 -m portattn.bench.mla --fp8 --no-torch --out $OUT/mla_fp8_heads.json \
  --page-sizes 64 --batches 64 --heads 17,64,128 --lengths 4096 \
  --label "$(cat $OUT/gpu.txt), round 59" 2>&1 | grep -v Warning | tee $OUT/mla_fp8_heads.txt
