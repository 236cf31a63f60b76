#!/usr/bin/env bash
# Ready for the next session (issue 13, 11): the decode table again with the timer change (one
# untimed call before each timed run) at more iterations, and host µs on that session's host.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
timeout -s KILL 300 python3 -m cpattn.bench decode --shapes mla,gqa --cps 1,8 --batches 1,8,64 --keys 128k,1m \
  --q-lens 1,4 --iters 20 --no-crossover --out $OUT/decode-h200-s7 > $OUT/decode-h200-s7.log 2>&1
echo "decode rc $?"; grep -E "C=8 / C=1|GQA" $OUT/decode-h200-s7.log | cut -c1-160
timeout -s KILL 120 python3 tools/gpu/profile_host.py > $OUT/host-h200-s7.log 2>&1
echo "host rc $?"; grep -E "same K/V|one call" $OUT/host-h200-s7.log | cut -c1-200
