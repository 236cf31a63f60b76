#!/usr/bin/env bash
# Session 9, fourth call (within 30 s of s10c.sh): FA4 install, then issue 14's kernel table in one
# run: dense / paged (D128, D192) and short sequences against FA4, absorbed MLA prefill and decode.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_fa4.sh
timeout -s KILL 500 python3 -m cpattn.bench kernel --workloads dense,paged,mla,decode,short --shapes d128,d192 \
  --seqs 16384,65536,131072 --cps 1,2,4,8 --pages 16,64,256 --no-interleave --backends triton,fa4 --iters 5 \
  --out $OUT/kernel14-fa4-h200-s10 > $OUT/kernel14-fa4-h200-s10.log 2>&1
echo "kernel rc $?"
grep -E "^  " $OUT/kernel14-fa4-h200-s10.log | sed 's/(target[^)]*)//g' | cut -c1-150 | head -80
