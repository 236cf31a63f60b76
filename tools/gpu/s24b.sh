#!/usr/bin/env bash
# Twentieth session: s24a removed Triton's three warpgroup bar.syncs per key block (per-warp stage
# releases, ptx_warp_release + _top) and measured dense 1.001: the bar.syncs are not the gap. FA4's
# loop has neither those nor turn-taking between the consumers; Nsight Compute (s23c) counts ~3.6
# warps per issue stalled on barriers in ours against ~0.5 in FA4's, where the ping-pong turns are
# the barriers left. d128 zigzag 16k / 64k C = 1..8, three interleaved repeats of: the tree, the
# tree with pingpong=0, the per-warp-release copy (both patches) with its default (ping-pong on) and
# with pingpong=0. No carry.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s24b-lines.txt
make_variant /tmp/pp0
make_variant /tmp/pwb ptx_warp_release ptx_warp_release_top
make_variant /tmp/pwb0 ptx_warp_release ptx_warp_release_top
DENSE=(--workloads dense --shapes d128 --seqs 16384,65536 --cps 1,2,4,8 --no-interleave)
for rep in 1 2 3; do
  ab "dense rep $rep" src "${DENSE[@]}"
  ab "dense rep $rep" /tmp/pp0/src "${DENSE[@]}" --sm90-options pingpong=0
  ab "dense rep $rep" /tmp/pwb/src "${DENSE[@]}"
  ab "dense rep $rep" /tmp/pwb0/src "${DENSE[@]}" --sm90-options pingpong=0
done
cp "$L" "$OUT/"
for t in /tmp/pp0/src /tmp/pwb/src /tmp/pwb0/src; do python3 tools/gpu/ab_ratios.py "$L" src $t; done
python3 tools/gpu/ab_ratios.py "$L" /tmp/pp0/src /tmp/pwb0/src
