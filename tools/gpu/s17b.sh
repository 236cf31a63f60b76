#!/usr/bin/env bash
# Thirteenth session: the consumers' ping-pong in persistent programs too
# (tools/gpu/patches/persistent_pingpong.patch: consumer 0's first turn is granted once per program,
# not per work item, so the turns alternate across a program's items; "auto" pingpong no longer
# yields to persistent programs). s17a measured persistent (no ping-pong) against one program per
# item (ping-pong) on 64 x 2048 / 32 x 4096: persistent +10% / +2%. (1) All Hopper GPU tests on the
# patched copy (a turn out of step would hang: the test limit); (2) A/B at the defaults, short
# batches (all persistent) two interleaved repeats, dense d128 16k C = 1..8 once (unchanged path:
# one program per item); (3) on the patched copy, 16 x 8192 / 8 x 16384 persistent against one
# program per item (PERSISTENT_MAX_MEAN_KEYS = 3072 was set without ping-pong).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s17b-lines.txt
variant_hopper_tests ppp persistent_pingpong
for rep in 1 2; do
  for tree in src /tmp/ppp/src; do
    ab "short rep $rep" $tree --workloads short --short 1024x128,128x1024,64x2048,32x4096
  done
done
for tree in src /tmp/ppp/src; do
  ab "dense rep 1" $tree --workloads dense --shapes d128 --seqs 16384 --cps 1,2,4,8 --no-interleave
done
for rep in 1 2; do
  for pers in 1 0; do
    ab "long-short-persistent$pers rep $rep" /tmp/ppp/src --workloads short --short 16x8192,8x16384 \
      --sm90-options persistent=$pers
  done
done
cp $L $OUT/
python3 tools/gpu/ab_ratios.py $L src /tmp/ppp/src
