#!/usr/bin/env bash
# Session 4, tuning aid: the split target (programs per SM) of the Triton split-KV kernel for one
# sequence (GQA 32/8 D128, B = 1, q1), C = 1 and a C = 8 shard, eager and graph-replay timing.
set -uo pipefail
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src
cd "$(dirname "$0")/../.."
for pps in 6 12 16 24; do
  timeout -s KILL 40 python3 -m cpattn.bench decode --shapes gqa --cps 1,8 --batches 1 --keys 128k,1m --q-lens 1 \
    --iters 5 --no-crossover --programs-per-sm $pps --out $OUT/pps$pps > $OUT/pps$pps.log 2>&1
  echo "programs_per_sm=$pps rc $?"; grep "^| gqa" $OUT/pps$pps.log
done
