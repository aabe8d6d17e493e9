#!/usr/bin/env bash
# Round 66's second call, on the warm machine right after the first (about 5 minutes):
#   OUT=... bash benchmarks/results/round66/scripts/call2.sh
#   1. round 65's merge probe in a copy of the tree (merge_probe.patch, made again for this tree: the in-kernel
#      merge's ticket alone, its merge alone), beside the default and the full in-kernel merge;
#   2. round 65's quick_check.py: the seesaw kernel's bfloat16 partials (the default), float32 ones, SPLIT_EXP2 and
#      EARLY_TILES against float64 and each other, 1 and 3 splits (its first case);
#   3. cases.txt timed again (a second sample of the first call's forms).
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round66/scripts
P=benchmarks/results/round65/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
rm -rf /tmp/probe && mkdir /tmp/probe && cp -r src scripts benchmarks /tmp/probe/
(cd /tmp/probe && patch -p1 < $S/merge_probe.patch > /dev/null && \
  PYTHONPATH=src timeout 150 python3 scripts/mla_times.py $P/cases_probe.txt 130 2>&1 | grep -v Warning) \
  | tee $OUT/probe.txt
PYTHONPATH=src:tests timeout 60 python3 benchmarks/results/round65/scripts/quick_check.py default BF16_PARTIALS=False \
  SPLIT_EXP2=True EARLY_TILES=True short 2>&1 | grep -v Warning | tee $OUT/check.txt
PYTHONPATH=src timeout 150 python3 scripts/mla_times.py $S/cases.txt 130 2>&1 | grep -v Warning | tee $OUT/times.txt
