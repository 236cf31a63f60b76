#!/usr/bin/env bash
# Twelfth session, last budget (~250 s): FA4 runs D128 on a 2-stage K/V ring (165 KB of shared
# memory, ncu s15b); the tree at 0.3.9 (ping-pong at D128) with 3 stages against 2, d128 zigzag
# 16k / 64k C = 1, 2, 4, two interleaved repeats.
set -uo pipefail
cd "$(dirname "$0")/../.."
L=/tmp/s17a-lines.txt; : > $L
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0
. tools/gpu/_variant.sh
for rep in 1 2; do
  for st in 3 2; do
    ab "stages$st rep $rep" src --workloads dense --shapes d128 --seqs 16384,65536 --cps 1,2,4 --no-interleave \
      --sm90-options stages=$st
  done
done
cp $L $OUT/
