#!/usr/bin/env bash
# Round 71's H200 call: OUT=... bash benchmarks/results/round71/scripts/call1.sh
#   Round 70's call2.sh (the H200 bench at 17, 32, 64 and 128 heads, then round 69's forms.py), run again as it is.
set -f
bash benchmarks/results/round70/scripts/call2.sh
