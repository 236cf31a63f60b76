#!/usr/bin/env bash
# Twentieth session: the last difference between FA4's key loop and ours that the Gluon source can
# express (nineteenth session, offline SASS): FA4 waits for V_{j-1} only after issuing Q K_j^T
# (v_wait_after_qk.patch; offline the overlapped loop then reads wait, turn, gmma x8, wait, gmma
# x8 as FA4's). (1) the Hopper tests but MLA on the patched copy; (2) dense d128 / d192 16k / 64k
# C = 1..8, tree and patch interleaved, two repeats, short once; ab_ratios.py's verdict. No carry.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s24d-lines.txt
variant_tests vw 150 v_wait_after_qk -- tests/test_triton_hopper_gpu.py -k "not mla"
for rep in 1 2; do
  for tree in src /tmp/vw/src; do
    ab "dense rep $rep" "$tree" --workloads dense --shapes d128,d192 --seqs 16384,65536 --cps 1,2,4,8 --no-interleave
  done
done
for tree in src /tmp/vw/src; do
  ab "short rep 1" "$tree" --workloads short --short 1024x128,128x1024,64x2048,32x4096
done
cp "$L" "$OUT/"
python3 tools/gpu/ab_ratios.py "$L" src /tmp/vw/src
