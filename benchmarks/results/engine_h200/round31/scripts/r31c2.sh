#!/usr/bin/env bash
# Prepared for the next device session (not yet run): call 2 of 3, about 9 minutes (needs .whl/ carried:
# fastapi and the rest, as in round 30). The burst of 256 x (1024 + 128) through the default server with the
# mixed steps of up to the token budget in captured pieces (--piecewise-max-tokens), fp8 at budgets 2048 and
# 4096, bf16 at 2048 (issue 23 target 3: TTFT mean <= 2.5 s with ITL p99 <= 3x the median).
W=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { OUT=$W/$1 LIMIT=$2 timeout -s INT $(( $2 + 30 )) bash scripts/gpu.sh "$3" >> $W/log_$1.txt 2>&1; (cd $W && tar czf $1.tgz $1 log_$1.txt && rm -rf $1 log_$1.txt); }
START=$SECONDS
mkdir -p /tmp/gguf_parts && cp .gguf_b/* /tmp/gguf_parts/ 2>/dev/null  # half of the real model's GGUF (call 3 joins)
# first (round 33): captured pieces of 1024 and 2048 tokens against plain steps; the bursts need them
PYTHONPATH=src:tests PORTATTN_TEST_ENGINE_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_piecewise_gpu.py -k thousand > $W/tests_piecewise_2048_gpu_log.txt 2>&1
PIECES_RC=$?
echo "pieces test rc $PIECES_RC at $((SECONDS-START))" >> $W/times.txt
[ $PIECES_RC -eq 0 ] || exit 1
export BATCH1_STEP_MS=4.22 KEEP_CHECKPOINT=/tmp/ck8b PYTHONPATH=/tmp/site
P="--piecewise-graphs"
LOADS="burst256" SERVE_ARGS="$P --max-num-batched-tokens 2048 --piecewise-max-tokens 2048 --quantization fp8" run f2048p 150 "bench serve"
echo "f2048p done at $((SECONDS-START))" >> $W/times.txt
LOADS="burst256" SERVE_ARGS="$P --max-num-batched-tokens 4096 --piecewise-max-tokens 4096 --quantization fp8" run f4096p 150 "bench serve"
echo "f4096p done at $((SECONDS-START))" >> $W/times.txt
[ $((SECONDS-START)) -lt 380 ] && LOADS="burst256" SERVE_ARGS="$P --max-num-batched-tokens 2048 --piecewise-max-tokens 2048" run b2048p 150 "bench serve"
echo "b2048p done at $((SECONDS-START))" >> $W/times.txt
