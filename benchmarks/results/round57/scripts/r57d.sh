#!/usr/bin/env bash
# Round 57's last call (about 7 minutes): OUT=... bash benchmarks/results/round57/scripts/r57d.sh
#   1. the MLA benchmark with fp8 caches beside bf16 (python -m portattn.bench.mla --fp8), the new defaults;
#   2. GPU tests touched by the new defaults: the default-choice tests, fp8_mma's default-tiles test (the wide forms
#      declined), the MLA ops' tests.
set -f
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout ${T1:-300} python3 -m portattn.bench.mla --fp8 --no-torch --out $OUT/mla_fp8.json \
  --label "$(cat $OUT/gpu.txt), round 57" 2>&1 | grep -v Warning | tee $OUT/mla_fp8.txt
[ "${T2:-130}" = 0 ] && exit 0
PYTHONPATH=src:tests timeout ${T2:-130} python3 -m pytest -q -p no:cacheprovider -rf \
  tests/kernels/test_mla_fp8_scores_default.py tests/kernels/test_mla_fp8_mma.py::test_the_default_tiles_of_24_heads_over_40_sequences_give_the_reference \
  tests/ops/test_mla.py 2>&1 | grep -v Warning | tail -n 15 > $OUT/tests.txt
tail -n 3 $OUT/tests.txt
