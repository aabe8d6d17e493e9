#!/usr/bin/env bash
# Round 55's device call (about 8 minutes), issue 24 item 1:
#   OUT=... bash benchmarks/results/round55/scripts/r55.sh
# 1. round54's next_cases.txt timed once (more fp8 bytes in flight: 32-key tiles in six or eight slots, fp8 values
#    beside four 64-key slots), with the default and the bf16 cache;
# 2. round54's `last`: the seesaw kernel's GPU tests at pages 16 and 8, the producer's copies alone, Nsight Compute
#    of the producer alone (NCU=0 skips it);
# 3. the consumers alone (round54's alone.patch, already applied by 2, and seesaw_alone.patch; PA_NOLOAD=1):
#    alone_cases.txt.
set -f
S4=benchmarks/results/round54/scripts
S5=benchmarks/results/round55/scripts
OUT=$OUT T3=${T3:-150} bash $S4/r54.sh time next_cases.txt 1
OUT=$OUT NCU=${NCU:-1} T2=${T2:-85} T=${T:-120} bash $S4/r54.sh last
patch -p1 < $S5/seesaw_alone.patch > /dev/null
echo "== PA_NOLOAD=1" | tee $OUT/alone_times.txt
PA_NOLOAD=1 PYTHONPATH=src timeout ${T4:-70} python3 $S4/many.py $S5/alone_cases.txt $(( ${T4:-70} - 8 )) 2>&1 |
  grep -v Warning | tee -a $OUT/alone_times.txt
