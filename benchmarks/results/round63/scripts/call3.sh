#!/usr/bin/env bash
# Round 63's third call (under 10 minutes): OUT=... bash benchmarks/results/round63/scripts/call3.sh
#   1. quick_check.py: both seesaw forms, only the last tile masked, against the float64 reference;
#   2. cases3.txt timed; mask_every_tile.patch applied, cases3_old.txt timed; reverted; cases3.txt's first lines again;
#   3. python -m portattn.bench.mla --fp8, PAIR_MAX on and off (17, 64, 128 heads);
#   4. trace.patch applied, trace.py for both forms at 64 heads.
set -f
export PYTHONUNBUFFERED=1
S=benchmarks/results/round63/scripts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src:tests timeout 120 python3 $S/quick_check.py 2>&1 | grep -v Warning | tee $OUT/check.txt
PYTHONPATH=src timeout 150 python3 scripts/mla_times.py $S/cases3.txt 140 2>&1 | grep -v Warning | tee $OUT/times_new.txt
patch -p1 < $S/mask_every_tile.patch
PYTHONPATH=src timeout 110 python3 scripts/mla_times.py $S/cases3_old.txt 100 2>&1 | grep -v Warning \
  | tee $OUT/times_old.txt
patch -R -p1 < $S/mask_every_tile.patch
head -3 $S/cases3.txt > /tmp/again.txt
PYTHONPATH=src timeout 40 python3 scripts/mla_times.py /tmp/again.txt 30 2>&1 | grep -v Warning | tee $OUT/times_again.txt
A="--fp8 --no-torch --page-sizes 64 --batches 64 --heads 17,64,128 --lengths 4096"
for form in on off; do
  PYTHONPATH=src timeout 60 python3 $S/bench_pair.py $form $A --label "$(cat $OUT/gpu.txt), pair max $form" \
    --out $OUT/bench_pair_$form.json 2>&1 | grep -v Warning | tee $OUT/bench_pair_$form.txt
done
patch -p1 < $S/trace.patch && PYTHONPATH=src timeout 60 python3 $S/trace.py $OUT pair_h64_s2 seesaw_h64_s2 2>&1 \
  | grep -v Warning | tee $OUT/trace.txt
