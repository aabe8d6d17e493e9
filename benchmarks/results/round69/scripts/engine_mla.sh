#!/usr/bin/env bash
# Round 69: the engine's fp8-cache tests of DeepSeek's MLA on the GPU (ONE_PASS, KEEP_QUERIES on): OUT=... bash engine_mla.sh
set -f
PORTATTN_TEST_ENGINE_DEVICE=cuda PYTHONPATH=src:tests timeout 170 python3 -m pytest -q -p no:cacheprovider -n 4 -rA \
  tests/engine/test_fp8_engine.py -k "deepseek or mla" 2>&1 | grep -v Warning > $OUT/engine_full.txt
grep -E "passed|failed|FAILED|Error" $OUT/engine_full.txt | tail -20
