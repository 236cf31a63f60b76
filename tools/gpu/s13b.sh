#!/usr/bin/env bash
# Eleventh session, second call, right after s13a.sh: O stored through the free
# Q tile (tools/gpu/patches/o_smem_epilogue.patch: stmatrix into shared memory, then 16-byte
# coalesced stores; offline per consumer 8 STSM + 8 LDS.128 + 8 STG.E.128 instead of 32 STG.E,
# no new spills). (1) All Hopper GPU tests on a patched copy of src; (2) A/B tree vs patched at
# the defaults, short batches and d128 / d192 dense 16k / 64k, sustained timing, two interleaved
# repeats; (3) FA4 stage 1 for s13c.sh (the next call, within 30 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s13b-lines.txt
variant_hopper_tests osmem o_smem_epilogue
for rep in 1 2; do
  for tree in src /tmp/osmem/src; do
    ab "short rep $rep" $tree --workloads short --short 1024x128,256x512,128x1024,64x2048,32x4096
    ab "dense rep $rep" $tree --workloads dense --shapes d128,d192 --seqs 16384,65536 --cps 1,2,8 --no-interleave
  done
done
cp $L $OUT/
bash .gpu/fa4-1/stage.sh
