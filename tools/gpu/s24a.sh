#!/usr/bin/env bash
# Twentieth session: the dense sm90 kernel's stage releases made as FA4 makes them, one
# mbarrier.arrive per consumer warp on barriers counting 8, without Triton's warpgroup bar.sync
# (ptx_warp_release.patch: the kernel's PTX rewritten between Triton's ptx and cubin stages; Gluon
# on triton 3.6 cannot write a per-warp arrive), and (ptx_warp_release_top.patch on top) also
# without the bar.sync before each consumer mbarrier wait: 2 / 3 of the loop's 3 bar.syncs gone
# (offline SASS). (1) the Hopper tests but MLA on each patched copy; (2) dense d128 / d192 16k /
# 64k C = 1..8, tree and both copies interleaved, two repeats; paged and short once each;
# ab_ratios.py's verdicts. No carry.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s24a-lines.txt
variant_tests pwa 150 ptx_warp_release -- tests/test_triton_hopper_gpu.py -k "not mla"
variant_tests pwb 150 ptx_warp_release ptx_warp_release_top -- tests/test_triton_hopper_gpu.py -k "not mla"
trees=(src /tmp/pwa/src /tmp/pwb/src)
for rep in 1 2; do
  for tree in "${trees[@]}"; do
    ab "dense rep $rep" "$tree" --workloads dense --shapes d128,d192 --seqs 16384,65536 --cps 1,2,4,8 --no-interleave
  done
done
for tree in "${trees[@]}"; do
  ab "paged rep 1" "$tree" --workloads paged --shapes d128,d192 --seqs 65536 --cps 2 --pages 16,64 --no-interleave
  ab "short rep 1" "$tree" --workloads short --short 1024x128,128x1024,64x2048,32x4096
done
cp "$L" "$OUT/"
python3 tools/gpu/ab_ratios.py "$L" src /tmp/pwa/src
python3 tools/gpu/ab_ratios.py "$L" src /tmp/pwb/src
