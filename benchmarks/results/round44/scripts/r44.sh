#!/usr/bin/env bash
# Round 44's device work, for the next session with device time: one part a call, each under 10 minutes. The
# machine goes back 30 s after a call ends, so issue the calls one after another.
#   OUT=... bash benchmarks/results/round44/scripts/r44.sh gemm     # no carry
#   OUT=... bash benchmarks/results/round44/scripts/r44.sh serve    # carry .whl (server wheels only: 64 MiB a call)
#   OUT=... bash benchmarks/results/round44/scripts/r44.sh serve_fast   # carry .whl
#   OUT=... bash benchmarks/results/round44/scripts/r44.sh mla16    # no carry
#   OUT=... bash benchmarks/results/round44/scripts/r44.sh mla32    # no carry
#   OUT=... bash benchmarks/results/round44/scripts/r44.sh mla128   # no carry
# gemm:   scripts/fp8_gemm_probe.py (no carry, about a minute): the fp8 linears' matmul with and without fast
#         accumulation at the 8B shape's projections, which set how fast the burst's prefill steps can be.
# serve:  issue 23 target 3 on the issues' GPU: the burst (256 x 1024 + 128) at budgets 2048 and 3072 and Poisson 16
#         at 3072 (round 42's r42c3.sh; about 5 minutes, at most 10); one archive, each server's row and the traces.
# serve_fast: ../fp8_fast_accum.patch applied to the device's copy (the fp8 linears' matmul with fast accumulation
#         above 128 rows, as vLLM's), its GPU test and the fp8 linear tests, then the burst and Poisson 16 at 3072:
#         against serve's runs on the same machine (about 6 minutes).
# mla16:  issue 24 item 1 at 16 heads: the fp8 MLA kernel against the bf16 cache, and its 48 reference cases
#         (round 41's r42c2.sh; about 6 minutes).
# mla32:  issue 24 item 1 at 32 and 64 heads (DeepSeek-V3's 128 heads over 4 and 2 GPUs; over 8 it is 16): the
#         bf16 cache, the default over e4m3 (the portable kernel at 32, the wide one at 64) and the fp8_mma kernel in
#         16-head blocks, which takes only up to 16 heads by default; B=64 and 128 over 4096 keys (about 4 minutes).
# mla128: issue 24 item 1 at 128 heads: round 43's pipelined e4m3-products patch applied to the device's copy of the
#         tree (the next call gets a fresh copy), then its timings beside the bf16 cache and its GPU tests (round 42's
#         r42c5.sh with PIPELINED=1; at most 9 minutes).
set -f
R=benchmarks/results
case "${1:-}" in
  gemm) PYTHONPATH=src timeout 300 python3 scripts/fp8_gemm_probe.py --out $OUT/fp8_gemm_probe.json 2>&1 |
           tee $OUT/fp8_gemm_probe.txt ;;
  serve) RUNS=${RUNS:-"burst256:2048 burst256:3072 poisson16:3072"} OUT=$OUT bash $R/round42/scripts/r42c3.sh ;;
  serve_fast)
    P=$R/round44/fp8_fast_accum.patch
    git apply $P 2>/dev/null || patch -p1 -s --forward < $P || { echo "the patch did not apply"; exit 1; }
    grep -q "FAST_ACCUM_ABOVE_ROWS" src/portattn/models/layers/fp8_linear.py || { echo "not patched"; exit 1; }
    PYTHONPATH=src:tests PORTATTN_TEST_ENGINE_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider \
      tests/models/test_fp8_linear.py -k "dequantized_operands or agrees or captured" 2>&1 | tail -n 3
    NAME=r44fast RUNS="burst256:3072 poisson16:3072" OUT=$OUT bash $R/round42/scripts/r42c3.sh ;;
  mla16) OUT=$OUT bash $R/round41/scripts/r42c2.sh ;;
  mla32)
    START=$SECONDS
    for h in 32 64; do for b in 64 128; do
      for form in "bf16" "e4m3" "e4m3 --tiles 16,64,4,2 --coalesced-io"; do
        [ $((SECONDS - START)) -lt 420 ] && PYTHONPATH=src timeout 60 python3 scripts/ncu_mla.py $form --heads $h \
          --batch $b --time 2>&1 | tail -n 1 | tee -a $OUT/mla32.txt
      done
    done; done ;;
  mla128)
    P=$R/round43/fp8_products_pipelined.patch
    git apply $P 2>/dev/null || patch -p1 -s --forward < $P || { echo "the patch did not apply"; exit 1; }
    grep -q "def _e4m3_pipelined" src/portattn/kernels/triton/mla_decode_wide.py || { echo "not patched"; exit 1; }
    PIPELINED=1 OUT=$OUT bash $R/round42/scripts/r42c5.sh ;;
  *) echo "expected one of gemm, serve, serve_fast, mla16, mla32, mla128, got '${1:-}'"; exit 2 ;;
esac
