#!/usr/bin/env bash
# Nineteenth session, first of an FA4 pair (carry [".gpu/fa4-1"]; s23c.sh follows within 30 s):
# FA4 stage 1, then where the dense D128 kernel loses at 16k (issue 14: d128 16k C = 4 / 8 at
# 0.91-0.92x FA4 in s22c, while 64k C = 4 / 8 run at 1.0-1.07x) measured against two schedule
# changes that need no code: the L2 head sections off (`--sm90-options sections=0`: heaviest
# first with head groups fastest; the 16k points plan two sections of four head groups) and
# persistent programs (`persistent=1`: one program per SM walking the items, no ping-pong; last
# measured on 0.3.x at 16k C = 8: 319 vs 554 TF/s). d128 zigzag 16k / 64k, C = 1, 2, 4, 8, two
# interleaved repeats; ab_ratios.py against the tree's defaults. About 5 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s23b-lines.txt
bash .gpu/fa4-1/stage.sh
make_variant /tmp/sec0
make_variant /tmp/pers
DENSE=(--workloads dense --shapes d128 --seqs 16384,65536 --cps 1,2,4,8 --no-interleave)
for rep in 1 2; do
  AB_LIMIT=150 ab "dense rep $rep" src "${DENSE[@]}"
  AB_LIMIT=150 ab "dense rep $rep" /tmp/sec0/src "${DENSE[@]}" --sm90-options sections=0
  AB_LIMIT=150 ab "dense rep $rep" /tmp/pers/src "${DENSE[@]}" --sm90-options persistent=1
done
cp "$L" "$OUT/"
python3 tools/gpu/ab_ratios.py "$L" src /tmp/sec0/src
python3 tools/gpu/ab_ratios.py "$L" src /tmp/pers/src
