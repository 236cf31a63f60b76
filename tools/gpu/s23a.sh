#!/usr/bin/env bash
# Prepared in the eighteenth session: where the combine's programmatic dependent launch (0.3.15)
# helps and where it costs, over issue 14's whole decode set. s22a measured 8 MLA decode points
# (one lost 3.6%: B = 1 over 4k keys q4, 168 -> 162 TF/s in both repeats, 155 in s22d) and 16
# shard steps. Here: the tree (pdl on) against pdl_default_off.patch (the shard plans' default
# pdl=False, nothing else), two interleaved repeats of MLA decode B = 1 / 8 / 64 over 4k / 32k /
# 128k keys q1 / q4 (graph replay, the table's decode rows plus B = 1) and one rank's shard step
# (ab_layers: GQA and MLA, C = 1 / 8, B = 1 / 8, 4k / 32k keys q1); ab_ratios.py reads the tree as
# NEW against the patched copy as OLD, so a ratio > 1 is PDL's gain. No GPU tests (the patch
# changes one default; every GPU test passed on the tree in s22d), no FA4, no carry; about 7
# minutes. If a group of points loses, a rule for when to launch with PDL (e.g. by split
# length) is the next step; `python -m cpattn.bench decode --no-pdl` / `kernel --decode-options
# pdl=0` time single points without the patch.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s23a-lines.txt
make_variant /tmp/nopdl pdl_default_off
for rep in 1 2; do
  for tree in /tmp/nopdl/src src; do
    AB_LIMIT=200 ab_graph "decode rep $rep" "$tree" --workloads decode --decode-batches 1,8,64 \
      --decode-lens 4096,32768,131072 --decode-qlens 1,4
    ab_layers "layers rep $rep" "$tree"
  done
done
cp "$L" "$OUT/"
python3 tools/gpu/ab_ratios.py "$L" /tmp/nopdl/src src --host-only
