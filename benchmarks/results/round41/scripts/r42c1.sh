#!/usr/bin/env bash
# Next session's call 1 (carry .whl/, about 7 minutes on a fresh machine): issue 23 target 3 through round 40's
# servers (`r40c2.sh`: fp8 linears, captured pieces, cap 128, one prompt a step left unfinished, the default, with
# round 41's fix) at budgets 2048, 2560 and 3072: the burst (256 x 1024 + 128) at each, Poisson 16 at the largest.
# Round 41's step-cost model (`burst_model.py`) gave burst TTFT means of 2.47 / 2.37 / 2.30 s (engine alone; the
# H100's server and client added about 0.15 s at 2048) and ITL p99 at 2.1 / 2.4 / 2.7x the median; the Poisson
# load's gaps do not depend on the budget there. Each run in $OUT/LOAD_BUDGET.
#   OUT=... bash benchmarks/results/round41/scripts/r42c1.sh
START=$SECONDS
for spec in ${RUNS:-burst256:2048 burst256:2560 burst256:3072 poisson16:3072}; do
  [ $((SECONDS - START)) -lt 420 ] || break
  load=${spec%:*}; budget=${spec#*:}; mkdir -p $OUT/${load}_$budget
  echo "== $load at budget $budget"
  RUNS=$load BUDGET=$budget OUT=$OUT/${load}_$budget bash benchmarks/results/round40/scripts/r40c2.sh 2>&1 |
    grep -v "^  " | head -n 6
done
echo "call took $((SECONDS - START)) s"
