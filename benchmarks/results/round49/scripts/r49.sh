#!/usr/bin/env bash
# Round 49's device calls, one after another on a warm machine.
#   OUT=... bash benchmarks/results/round49/scripts/r49.sh probe  # which side bounds the warp-specialized form's
#                                                                  # step; its WHOLE variants tested and timed
#   OUT=... bash benchmarks/results/round49/scripts/r49.sh overlap  # WHOLE and OVERLAP tested, then timed
#   OUT=... bash benchmarks/results/round49/scripts/r49.sh final    # the committed defaults timed and tested
#   OUT=... bash benchmarks/results/round49/scripts/r49.sh serve  # carry .whl: issue 23 target 3 (an H200)
# probe and overlap time experimental knobs (WS_WHOLE, WS_PROBE, WS_PREGS, WS_OVERLAP) that only
# scripts/ws_knobs.patch adds, applied to b130664's src/portattn/kernels/triton/mla_decode_wide.py (call 2 ran an
# earlier set of them, with WS_WHOLE also giving the bf16 producer two copies in flight).
set -f
R=benchmarks/results
case "${1:-}" in
  probe)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src timeout ${T1:-200} python3 $R/round49/scripts/ws_probe.py $R/round49/scripts/${CASES:-probe_cases.txt} \
      $(( ${T1:-200} - 20 )) 2>&1 | grep -v Warning | tee $OUT/probe_times.txt
    WS_WHOLE=1 WS_PREGS=104 PYTHONPATH=src:tests timeout ${T2:-150} python3 -m pytest -q -p no:cacheprovider -rf \
      tests/kernels/test_mla_wide.py -k "${K:-producer}" 2>&1 | tail -n 8 | tee $OUT/tests_whole.txt ;;
  overlap)  # both knobs on through the reference tests first, then timed
    WS_WHOLE=1 WS_OVERLAP=1 PYTHONPATH=src:tests timeout 150 python3 -m pytest -q -p no:cacheprovider -rf \
      tests/kernels/test_mla_wide.py -k "producer and not compiles" 2>&1 | tail -n 8 | tee $OUT/tests_overlap.txt
    PYTHONPATH=src timeout 200 python3 $R/round49/scripts/ws_probe.py $R/round49/scripts/overlap_cases.txt 180 2>&1 |
      grep -v Warning | tee $OUT/overlap_times.txt ;;
  final)  # the committed defaults timed, then the wide kernel's GPU tests and the MLA op's
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
    PYTHONPATH=src timeout 110 python3 $R/round46/scripts/mla_many.py $R/round49/scripts/final_cases.txt 100 2>&1 |
      grep -v Warning | tee $OUT/final_times.txt
    PYTHONPATH=src:tests timeout 230 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_mla_wide.py \
      tests/ops/test_mla.py 2>&1 | tail -n 8 | tee $OUT/tests.txt ;;
  serve) OUT=$OUT bash $R/round45/scripts/r45.sh serve ;;
  *) echo "expected one of probe, overlap, final, serve, got '${1:-}'"; exit 2 ;;
esac
