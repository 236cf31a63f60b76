#!/usr/bin/env bash
# Session 9, first call (FA4 staging part 1 first): the dense decode-shaped plans' pad-row launch
# (its GPU test, the decode table at B = 8 / 64 over 4k keys: s9j.sh, never run), then short
# sequences with one program per tile against the persistent sm90 schedule over more shapes
# (issue 14: which batches should take the persistent schedule by default?).
set -uo pipefail
cd "$(dirname "$0")/../.."
bash .gpu/fa4-1/stage.sh > /tmp/fa4-stage1.log 2>&1; echo "fa4 stage 1 rc $?"
bash tools/gpu/s9j.sh
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
echo "== short: one program per tile vs persistent"
timeout -s KILL 200 python3 -m cpattn.bench kernel --workloads short \
  --short 1024x128,256x512,128x1024,64x2048,32x4096,16x8192,8x16384 --backends triton,triton-persistent --iters 10 \
  --out $OUT/short-persistent-h200-s10 > $OUT/short-persistent-h200-s10.log 2>&1
echo "rc $?"; grep -A20 "^| workload" $OUT/short-persistent-h200-s10.log | head -22
