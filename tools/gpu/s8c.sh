#!/usr/bin/env bash
# Session 7, third call: the issue-13 decode table with the timer change (one untimed call before
# each timed run) and the new eager step column (attention + merge issued together), L = 128k and
# 1M, B = 1, 8, 64 (s7a's run).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
timeout -s KILL 420 python3 -m cpattn.bench decode --shapes mla,gqa --cps 1,8 --batches 1,8,64 --keys 128k,1m \
  --q-lens 1,4 --iters 20 --no-crossover --out $OUT/decode-h200-s7 > $OUT/decode-h200-s7.log 2>&1
echo "decode rc $?"; grep -E "C=8 / C=1|GQA|KV bytes" $OUT/decode-h200-s7.log | cut -c1-160
