#!/usr/bin/env bash
# Prepared in the twelfth session, not run (its device time ran out): two questions about the 0.3.9
# tree that need no code change. (1) FA4 runs D128 on a 2-stage K/V ring (165 KB of shared
# memory, ncu s15b): 3 stages against 2 with the ping-pong, d128 zigzag 16k / 64k C = 1, 2, 4.
# (2) persistent="auto" takes persistent programs (no ping-pong) up to 3072 mean keys per tile,
# a threshold measured before the ping-pong: short 64 x 2048 / 32 x 4096 persistent against one
# program per item (which now ping-pongs). Two interleaved repeats each.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s17a-lines.txt
for rep in 1 2; do
  for st in 3 2; do
    ab "stages$st rep $rep" src --workloads dense --shapes d128 --seqs 16384,65536 --cps 1,2,4 --no-interleave \
      --sm90-options stages=$st
  done
  for pers in 1 0; do
    ab "persistent$pers rep $rep" src --workloads short --short 64x2048,32x4096 --sm90-options persistent=$pers
  done
done
cp $L $OUT/
