#!/usr/bin/env bash
# round 28 call 4: cold start A/B, workers niced and importing ahead: workers pyc, threads pyc, workers pyc, workers
W=$OUT
START=$SECONDS
cold() {  # name env runs...
  local name=$1 envs=$2; shift 2
  env $envs PYTHONPATH=src timeout 150 python3 -m benchmarks.engine --parts coldstart --cold-runs "$@" \
    --workdir /tmp/ck --out $W/$name > $W/${name}_log.txt 2>&1
  echo "$name rc $? at $((SECONDS-START))" >> $W/times.txt
  cp $W/$name/engine_coldstart.json $W/${name}_coldstart.json; rm -rf $W/$name
}
cold w1 PORTATTN_COMPILE_WORKERS=1 bfloat16-pyc
cold t1 PORTATTN_COMPILE_WORKERS=0 bfloat16-pyc
cold w2 PORTATTN_COMPILE_WORKERS=1 bfloat16-pyc
[ $((SECONDS-START)) -lt 380 ] && cold w3 PORTATTN_COMPILE_WORKERS=1 bfloat16
[ $((SECONDS-START)) -lt 450 ] && cold t2 PORTATTN_COMPILE_WORKERS=0 bfloat16
