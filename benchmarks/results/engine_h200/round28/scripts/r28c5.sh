#!/usr/bin/env bash
# round 28 call 5: the workers' final form (a reaper thread at the end): GPU tests beside each other; one cold run
W=$OUT
run() { OUT=$W/$1 LIMIT=$2 timeout -s INT $(( $2 + 30 )) bash scripts/gpu.sh "$3" >> $W/log_$1.txt 2>&1; (cd $W && tar czf $1.tgz $1 log_$1.txt && rm -rf $1 log_$1.txt); }
START=$SECONDS
WORKERS=4 run tengine 140 "test engine -- -k 'compile_ahead'" &
WORKERS=2 run tops 90 "test ops -- -k 'compile_workers'" &
wait
echo "tests done at $((SECONDS-START))" >> $W/times.txt
PYTHONPATH=src timeout 100 python3 -m benchmarks.engine --parts coldstart --cold-runs bfloat16-pyc \
  --workdir /tmp/ck --out $W/w4 > $W/w4_log.txt 2>&1
echo "w4 rc $? at $((SECONDS-START))" >> $W/times.txt
cp $W/w4/engine_coldstart.json $W/w4_coldstart.json; rm -rf $W/w4
