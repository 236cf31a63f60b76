#!/usr/bin/env bash
# Ninth session, fourth call (within 30 s of s12c.sh): FA4 install, then issue 14's whole kernel
# table with FA4 in one run under the overlap="auto" default, sustained timing, short batches
# 1024x128 / 128x1024 / 64x2048 / 32x4096.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_fa4.sh
timeout -s KILL 500 python3 -m cpattn.bench kernel --workloads dense,paged,mla,decode,short --shapes d128,d192 \
  --seqs 16384,65536,131072 --cps 1,2,4,8 --pages 16,64,256 --no-interleave --backends triton,fa4 --iters 5 \
  --short 1024x128,128x1024,64x2048,32x4096 --warmup-ms 200 --min-ms 50 \
  --out $OUT/kernel14-fa4-h200-s12 > $OUT/kernel14-fa4-h200-s12.log 2>&1
echo "kernel rc $? [$(date +%T)]"
grep -E "^  " $OUT/kernel14-fa4-h200-s12.log | sed 's/(target[^)]*)//g' | cut -c1-150 | head -90
