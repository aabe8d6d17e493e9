#!/usr/bin/env bash
# Round 35, call 2: every engine step of the burst (256 x 1024 + 128) and of Poisson 16 req/s (512 +- 50%, 128)
# timed without HTTP (benchmarks/step_trace.py), fp8 linears, captured pieces, budget 2048, as call 1's server.
#   OUT=... bash benchmarks/results/round35/scripts/r35c2.sh
export PYTHONPATH=src
[ -f /tmp/ck8b/config.json ] || timeout 240 python3 -m benchmarks.random_checkpoint /tmp/ck8b --shape llama3-8b \
  --device cuda --dtype bfloat16 > $OUT/ckpt_log.txt 2>&1
F="--device cuda --dtype bfloat16 --page-size 16 --max-num-seqs 256 --max-model-len 4096 --piecewise-graphs
   --quantization fp8 --max-num-batched-tokens 2048 --piecewise-max-tokens 2048"
timeout 150 python3 -m benchmarks.step_trace /tmp/ck8b $F --out $OUT/burst2048.json > $OUT/burst2048.txt 2>&1
timeout 150 python3 -m benchmarks.step_trace /tmp/ck8b $F --burst 400 --rate 16 --input-len 512 --range-ratio 0.5 \
  --out $OUT/poisson2048.json > $OUT/poisson2048.txt 2>&1
# The same loads with each prompt's chunk capped at 128 tokens a step (--long-prefill-token-threshold).
timeout 150 python3 -m benchmarks.step_trace /tmp/ck8b $F --long-prefill-token-threshold 128 --burst 400 --rate 16 \
  --input-len 512 --range-ratio 0.5 --out $OUT/poisson2048c128.json > $OUT/poisson2048c128.txt 2>&1
timeout 150 python3 -m benchmarks.step_trace /tmp/ck8b $F --long-prefill-token-threshold 256 --profile 40:3 \
  --out $OUT/burst2048c256.json > $OUT/burst2048c256.txt 2>&1  # (and the kernels of three mixed steps)
for f in burst2048 poisson2048 poisson2048c128 burst2048c256; do echo "== $f"; grep "steps in\|^slow" $OUT/$f.txt | head -20; done
# The chunk cap through captured pieces, launched ahead, against plain synchronous steps (GPU test).
PORTATTN_TEST_ENGINE_DEVICE=cuda PYTHONPATH=src:tests timeout 120 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_piecewise_gpu.py -k capped > $OUT/test_capped.txt 2>&1; tail -n 3 $OUT/test_capped.txt
# MLA decode over an fp8 latent: the plan's tiles and split counts, and 16 heads at 1-16 splits.
mkdir -p $OUT/probe && PYTHONPATH=src:tests timeout 150 python3 scripts/kernels_probe.py mla-fp8 --out $OUT/probe \
  > $OUT/probe_log.txt 2>&1
tail -n 40 $OUT/probe_log.txt
# Where the 16-head kernel's warpgroup-MMA scores go wrong (one-hot rows; round 34's script, not reached there).
PYTHONPATH=src:tests timeout 90 python3 benchmarks/results/round34_h200/scripts/fp8_mma_diag.py > $OUT/fp8_mma_diag.txt 2>&1
tail -n 30 $OUT/fp8_mma_diag.txt
