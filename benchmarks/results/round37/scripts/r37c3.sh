#!/usr/bin/env bash
# Round 37, call 3 (no carry, about 9 minutes): fp8 linears whose input rows are quantized by the launch before
# them (the norms before q/k/v and gate/up, the gated activation before down; round 37), on the GPU.
#   1. their tests: tests/models/test_fp8_linear.py (each launch bit for bit against the norm's or activation's
#      launch and then the quantizer's, in bf16 too; the MLP and whole models through them against the unfused
#      path, the MLP against the torch code) and the fused kernels' tests (the Gluon MLA kernels' tests moved to
#      round 38's call 1);
#   2. scripts/fp8_fusion_probe.py: each quantizing launch against the two it replaces at a 2,048-token step's rows
#      (the activation's row in registers and in two passes), graph replays, bytes against the copy bandwidth;
#   3. A/B of the burst's steps (256 x 1024 + 128, fp8 linears, captured pieces, budget 2560, chunks capped at 128
#      where the step has room), alternately with them and without (--kernel-options unfused_fp8_norm
#      unfused_fp8_activation),
#      twice each: the mixed steps' median is what it changes.
#   OUT=... bash benchmarks/results/round37/scripts/r37c3.sh
export PYTHONPATH=src
START=$SECONDS
PORTATTN_TEST_ENGINE_DEVICE=cuda PYTHONPATH=src:tests timeout 200 python3 -m pytest -q -p no:cacheprovider tests/models/test_fp8_linear.py \
  tests/kernels/test_fused_kernels.py > $OUT/tests.txt 2>&1; tail -n 3 $OUT/tests.txt
timeout 120 python3 scripts/fp8_fusion_probe.py --out $OUT > $OUT/fusion_probe.txt 2>&1; cat $OUT/fusion_probe.txt
[ -f /tmp/ck8b/config.json ] || timeout 240 python3 -m benchmarks.random_checkpoint /tmp/ck8b --shape llama3-8b \
  --device cuda --dtype bfloat16 > $OUT/ckpt_log.txt 2>&1
F="--device cuda --dtype bfloat16 --page-size 16 --max-num-seqs 256 --max-model-len 4096 --piecewise-graphs
   --quantization fp8 --max-num-batched-tokens 2560 --piecewise-max-tokens 2560 --long-prefill-token-threshold 128"
for i in 1 2; do
  [ $((SECONDS-START)) -lt 420 ] || break
  timeout 120 python3 -m benchmarks.step_trace /tmp/ck8b $F --out $OUT/fused$i.json > $OUT/fused$i.txt 2>&1
  timeout 120 python3 -m benchmarks.step_trace /tmp/ck8b $F --kernel-options unfused_fp8_norm unfused_fp8_activation \
    --out $OUT/unfused$i.json > $OUT/unfused$i.txt 2>&1
  echo "pair $i done at $((SECONDS-START)) s"
done
grep -H "steps in\|engine alone\|launches that waited" $OUT/fused*.txt $OUT/unfused*.txt
