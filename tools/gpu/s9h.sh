#!/usr/bin/env bash
# Session 8, eighth call (issue 14, for the next session): where the absorbed-MLA decode step's
# GPU time goes at B = 8 over 4k keys (the point under 400 TF/s), against B = 64.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
timeout -s KILL 150 python3 tools/gpu/decode_profile.py --cases mla:1:8:4k:1,mla:1:8:4k:4,mla:1:64:4k:1 \
  > $OUT/decode-profile-h200-s8.log 2>&1
echo "profile rc $?"; cut -c1-200 $OUT/decode-profile-h200-s8.log | tail -40
