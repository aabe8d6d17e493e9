#!/usr/bin/env bash
# Round 45's device calls, issued one after another on a warm machine (it goes back 30 s after a call ends). The
# real model's GGUF travels in four parts (`.gguf_1` .. `.gguf_4`, git-excluded, 23.5 MiB each), one a call, and is
# joined in /tmp/gg on the last; the server wheels are kept in /tmp/whl from the first call.
#   OUT=... bash benchmarks/results/round45/scripts/r45.sh serve   # carry .whl: issue 23 target 3 (burst, Poisson 16)
#   OUT=... bash benchmarks/results/round45/scripts/r45.sh g1      # carry .gguf_1: the 32-head fp8 MLA default path
#   OUT=... bash benchmarks/results/round45/scripts/r45.sh g2      # carry .gguf_2: scripts/fp8_gemm_probe.py
#   OUT=... bash benchmarks/results/round45/scripts/r45.sh g3      # carry .gguf_3: the copy alone
#   OUT=... bash benchmarks/results/round45/scripts/r45.sh g4      # carry .gguf_4: the real model, fast accumulation
#   OUT=... bash benchmarks/results/round45/scripts/r45.sh mla64   # no carry: 64 heads with round 43's e4m3 products
#   OUT=... bash benchmarks/results/round45/scripts/r45.sh verify  # no carry: the wide kernel's new rules, timed, tested
#   OUT=... bash benchmarks/results/round45/scripts/r45.sh mma32   # no carry: fp8_mma in 32-head blocks, timed, tested
set -f
R=benchmarks/results
part() { nvidia-smi --query-gpu=name --format=csv,noheader; mkdir -p /tmp/gg && cp "$1"/part /tmp/gg/p"${1#.gguf_}" && ls -l /tmp/gg; }
case "${1:-}" in
  serve)
    rm -rf /tmp/whl && cp -r .whl /tmp/whl
    nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $OUT/gpu.txt
    RUNS=${RUNS:-"burst256:3072 poisson16:3072"} OUT=$OUT bash $R/round44/scripts/r44.sh serve ;;
  g1)
    part .gguf_1
    for form in bf16 e4m3 e5m2; do
      PYTHONPATH=src timeout 60 python3 scripts/ncu_mla.py $form --heads 32 --batch 64 --time 2>&1 | tail -n 1 |
        tee -a $OUT/mla32_default.txt
    done
    PYTHONPATH=src:tests timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_fp8_mma.py \
      -k "test_against_the_reference and 40" 2>&1 | tail -n 5 | tee $OUT/mla_fp8_mma_40.txt ;;
  g2)
    part .gguf_2
    OUT=$OUT bash $R/round44/scripts/r44.sh gemm ;;
  g3) part .gguf_3 ;;
  g4)
    part .gguf_4
    cat /tmp/gg/p1 /tmp/gg/p2 /tmp/gg/p3 /tmp/gg/p4 > /tmp/gg/model.gguf && sha256sum /tmp/gg/model.gguf
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .gguf_4/*.whl 2>&1 | tail -n 2
    git apply $R/round44/fp8_fast_accum.patch || { echo "the patch did not apply"; exit 1; }
    PYTHONPATH=/tmp/site:src:. timeout 300 python3 $R/round44/scripts/fast_accum_real_model.py /tmp/gg/model.gguf \
      2>&1 | grep -v Warning | tail -n 12 | tee $OUT/fast_accum_real_model.txt ;;
  mla64)
    git apply $R/round43/fp8_products_pipelined.patch || { echo "the patch did not apply"; exit 1; }
    T() { timeout 60 python3 scripts/ncu_mla.py "$@" --time --error 2>&1 | grep " ms \|Error" | tee -a $OUT/mla64.txt; }
    export PYTHONPATH=src
    for b in 64 128; do
      T bf16 --heads 64 --batch $b
      T e4m3 --heads 64 --batch $b
      T e4m3 --heads 64 --batch $b --wide --fp8-products --tiles 64,64,8,2
      T e4m3 --heads 64 --batch $b --wide --fp8-products --pipelined --tiles 64,64,8,2
      T e4m3 --heads 64 --batch $b --wide --fp8-products --pipelined --tiles 64,64,8,3
    done ;;
  verify)
    export PYTHONPATH=src
    for h in ${HEADS:-17 32 48}; do for b in ${BATCHES:-8 64 128}; do
      timeout 60 python3 scripts/ncu_mla.py bf16 --heads $h --batch $b --time 2>&1 | tail -n 1
    done; done | tee $OUT/wide_default_after.txt
    PYTHONPATH=src:tests timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_wide.py 2>&1 |
      tail -n 4 | tee $OUT/tests.txt ;;
  mma32)
    export PYTHONPATH=src
    for h in 32 17; do for b in 64 128; do
      for form in "bf16" "e4m3" "e4m3 --tiles 32,64,8,2 --coalesced-io" "e4m3 --tiles 32,64,8,3 --coalesced-io" \
                  "e5m2 --tiles 32,64,8,2 --coalesced-io"; do
        timeout 60 python3 scripts/ncu_mla.py $form --heads $h --batch $b --time 2>&1 | tail -n 1
      done
    done; done | tee $OUT/mma32.txt
    PYTHONPATH=src:tests timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_fp8_mma.py \
      -k "32_head_blocks or launcher_passes" 2>&1 | tail -n 6 | tee $OUT/tests.txt ;;
  *) echo "expected one of serve, g1, g2, g3, g4, mla64, verify, mma32, got '${1:-}'"; exit 2 ;;
esac
