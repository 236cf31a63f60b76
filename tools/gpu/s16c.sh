#!/usr/bin/env bash
# Twelfth session: the consumers' ping-pong as FA3 / FA4 run it (named hardware barriers: a
# consumer bar.syncs on its turn barrier before issuing Q K_j^T and P_{j-1} V_{j-1}, then
# bar.arrives on the other's; tools/gpu/patches/named_pingpong.patch) made the default at D128
# and D192 with overlap and one program per item (pingpong_auto.patch). (1) All Hopper GPU tests
# on that source (every default D128 / D192 case then ping-pongs); (2) A/B against the tree at
# the defaults, dense d128 / d192 16k / 64k C = 1, 2, 4, 8, two interleaved repeats, also on top
# of the named-barrier ring release (s16a: dropped, for information); paged 16 / 64 once;
# (3) choose_s16.py's verdict into /tmp/s16-choice.txt for s16d.sh; (4) FA4 stage 1.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s16c-lines.txt
variant_hopper_tests ppa named_pingpong pingpong_auto
make_variant /tmp/ppnb named_pingpong named_ring_release pingpong_auto
for rep in 1 2; do
  for tree in src /tmp/ppa/src /tmp/ppnb/src; do
    ab "dense rep $rep" $tree --workloads dense --shapes d128,d192 --seqs 16384,65536 --cps 1,2,4,8 --no-interleave
  done
done
for tree in src /tmp/ppa/src; do
  ab "paged rep 1" $tree --workloads paged --shapes d128,d192 --seqs 65536 --cps 2 --pages 16,64 --no-interleave
done
cp $L $OUT/
python3 tools/gpu/ab_ratios.py $L src /tmp/ppa/src
python3 tools/gpu/ab_ratios.py $L src /tmp/ppnb/src
python3 tools/gpu/choose_s16.py $L > /tmp/s16-choice.txt; echo "PINGPONG_HEAD_DIMS chosen: $(cat /tmp/s16-choice.txt)"
bash .gpu/fa4-1/stage.sh
