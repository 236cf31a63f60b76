#!/usr/bin/env bash
# Fifteenth session, with the last 420 s of device time: does MLA prefill gain from decode's loop
# order too (0.3.12: the other warpgroup's block before the wait for this one's, so a stage frees
# one Q K^T earlier)? Its K is 98% L2 hits (s19e) but its warps still stall on the stage (long
# scoreboard 8.8 per issue). mla_pv_first_all.patch takes that order in every mode. (1) the Hopper
# file's MLA GPU tests on the patched copy (100 s); (2) A/B MLA prefill 16k / 64k C = 1, 4 and
# 16k paged 64 against the tree, two interleaved repeats, ab_ratios.py's verdict. Adopting it
# would still need the shard-attention MLA tests (s19f's selection).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s19g-lines.txt
variant_tests pfa 100 mla_pv_first_all -- tests/test_triton_hopper_gpu.py -k mla
for rep in 1 2; do
  for tree in src /tmp/pfa/src; do
    ab "mla rep $rep" $tree --workloads mla
  done
done
cp $L $OUT/
python3 tools/gpu/ab_ratios.py $L src /tmp/pfa/src
