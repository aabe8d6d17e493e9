#!/usr/bin/env bash
# round 29, call 3: the server's GPU tests with the engine process (its default on GPUs now), then cold and warm
# (restart) starts, compile workers (spawned at the first miss) against threads alone.
W=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { OUT=$W/$1 LIMIT=$2 timeout -s INT $(( $2 + 30 )) bash scripts/gpu.sh "$3" >> $W/log_$1.txt 2>&1; (cd $W && tar czf $1.tgz $1 log_$1.txt && rm -rf $1 log_$1.txt); }
START=$SECONDS
PYTHONPATH=/tmp/site WORKERS=4 run tserver 170 "test server"
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
