#!/usr/bin/env bash
# Fifteenth session: where the absorbed-MLA decode step's GPU time goes on 0.3.11 (no injected wait),
# at the points under 400 TF/s (B = 8 over 4k and 32k keys, q1) against B = 8 q4 and B = 64 q1, for
# the plan's defaults and three split geometries (fewer, longer programs; two per SM; shorter
# splits): graph-replay µs and the torch.profiler breakdown per kernel (decode_profile.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
timeout -s KILL 300 python3 tools/gpu/decode_profile.py --cases mla:1:8:4k:1,mla:1:8:32k:1,mla:1:8:4k:4,mla:1:64:4k:1 \
  --options ";min_split=1024;programs_per_sm=2;min_split=128,programs_per_sm=2" > $OUT/decode-profile-h200-s19.log 2>&1
echo "profile rc $?"; cut -c1-200 $OUT/decode-profile-h200-s19.log | grep -v "^\s*$" | tail -120
