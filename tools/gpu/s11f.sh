#!/usr/bin/env bash
# Session 10, sixth call (within 30 s of `bash .gpu/fa4-1/stage.sh`): FA4 install, then the short
# sequences against FA4 varlen after the Q prefetch of the persistent consumers, sustained timing.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_fa4.sh
timeout -s KILL 200 python3 -m cpattn.bench kernel --workloads short --short 1024x128,128x1024,64x2048,32x4096 \
  --backends triton,triton-per-tile,fa4 --iters 5 --warmup-ms 200 --min-ms 50 \
  --out $OUT/short-fa4-h200-s11 > $OUT/short-fa4-h200-s11.log 2>&1
echo "short rc $?"; grep -E "^\| d128|^  d128" $OUT/short-fa4-h200-s11.log
