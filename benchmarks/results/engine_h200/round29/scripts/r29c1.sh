#!/usr/bin/env bash
# next round, call 1: cold (empty Triton cache) and warm (restart) starts, compile workers spawned at the first miss
# against threads alone (PORTATTN_COMPILE_WORKERS=0); the GPU tests of the round's changes beside each other first.
W=$OUT
run() { OUT=$W/$1 LIMIT=$2 timeout -s INT $(( $2 + 30 )) bash scripts/gpu.sh "$3" >> $W/log_$1.txt 2>&1; (cd $W && tar czf $1.tgz $1 log_$1.txt && rm -rf $1 log_$1.txt); }
START=$SECONDS
WORKERS=4 run tengine 140 "test engine -- -k 'compile_ahead'" &
WORKERS=4 run tops 120 "test ops -- -k 'compile_workers or repeat_launch'" &
wait
echo "tests done at $((SECONDS-START))" >> $W/times.txt
cold() {  # name env runs...
  local name=$1 envs=$2; shift 2
  env $envs PYTHONPATH=src timeout 200 python3 -m benchmarks.engine --parts coldstart --cold-runs "$@" \
    --workdir /tmp/ck --out $W/$name > $W/${name}_log.txt 2>&1
  echo "$name rc $? at $((SECONDS-START))" >> $W/times.txt
  cp $W/$name/engine_coldstart.json $W/${name}_coldstart.json; rm -rf $W/$name
}
cold w PORTATTN_COMPILE_WORKERS=1 bfloat16-pyc bfloat16-pyc-warm
cold t PORTATTN_COMPILE_WORKERS=0 bfloat16-pyc bfloat16-pyc-warm
[ $((SECONDS-START)) -lt 450 ] && cold w2 PORTATTN_COMPILE_WORKERS=1 bfloat16-pyc
