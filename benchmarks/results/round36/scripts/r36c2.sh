#!/usr/bin/env bash
# Round 36, call 2 (no carry): Poisson 16 req/s (512 +- 50%, 128) step traces, fp8 linears, budget 2048:
# with captured pieces, without and with each prompt's chunk capped at 128 tokens, and without pieces (every
# mixed step eager, at any token count: do its launches wait for kernel loads, as the LM head's did?); the
# capped pieces' GPU test. (The MLA fp8 split sweep and the warpgroup-MMA diagnosis moved to round 37's call 4.)
#   OUT=... bash benchmarks/results/round36/scripts/r36c2.sh
export PYTHONPATH=src
[ -f /tmp/ck8b/config.json ] || timeout 240 python3 -m benchmarks.random_checkpoint /tmp/ck8b --shape llama3-8b \
  --device cuda --dtype bfloat16 > $OUT/ckpt_log.txt 2>&1
B="--device cuda --dtype bfloat16 --page-size 16 --max-num-seqs 256 --max-model-len 4096 --quantization fp8
   --max-num-batched-tokens 2048"
P="--burst 400 --rate 16 --input-len 512 --range-ratio 0.5"
F="$B --piecewise-graphs --piecewise-max-tokens 2048"
timeout 150 python3 -m benchmarks.step_trace /tmp/ck8b $F $P --out $OUT/poisson.json > $OUT/poisson.txt 2>&1
timeout 150 python3 -m benchmarks.step_trace /tmp/ck8b $F $P --long-prefill-token-threshold 128 \
  --out $OUT/poisson_c128.json > $OUT/poisson_c128.txt 2>&1
timeout 150 python3 -m benchmarks.step_trace /tmp/ck8b $B $P --out $OUT/poisson_eager.json > $OUT/poisson_eager.txt 2>&1
for f in poisson poisson_c128 poisson_eager; do echo "== $f"; grep -A12 "steps in" $OUT/$f.txt | head -20; done
PORTATTN_TEST_ENGINE_DEVICE=cuda PYTHONPATH=src:tests timeout 120 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_piecewise_gpu.py -k capped > $OUT/test_capped.txt 2>&1; tail -n 3 $OUT/test_capped.txt
