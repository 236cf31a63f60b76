#!/usr/bin/env bash
# Session 9, second call (within 30 s of s10a.sh): FA4 install, then short sequences with one
# program per tile, the persistent sm90 schedule and FA4 varlen in one run (issue 14's short
# target: >= 0.9x FA4 on 1024 x 128 and 64 x 2048).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_fa4.sh
for rep in 1 2; do
timeout -s KILL 200 python3 -m cpattn.bench kernel --workloads short \
  --short 1024x128,256x512,128x1024,64x2048,32x4096,16x8192 --backends triton,triton-persistent,fa4 --iters 10 \
  --out $OUT/short-persistent-fa4-h200-s10-r$rep > $OUT/short-persistent-fa4-h200-s10-r$rep.log 2>&1
echo "rep $rep rc $?"; grep -A22 "^| workload" $OUT/short-persistent-fa4-h200-s10-r$rep.log | head -24
done
