#!/usr/bin/env bash
# Session 4, last call (machine still warm): sparse (DSA) benchmark of both families, the decode
# benchmark with graph-replay timing, and the host cost of plan.run.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src
timeout -s KILL 100 python3 -m cpattn.bench sparse --iters 5 --out $OUT/sparse-h200 > $OUT/sparse-h200.log 2>&1
echo "sparse rc $?"; grep -v "^\[" $OUT/sparse-h200.log | tail -14
timeout -s KILL 110 python3 -m cpattn.bench decode --cps 1,8 --batches 1,8,64 --keys 128k,1m --q-lens 1,4 --iters 5 \
  --crossover-prefixes 0,16k,64k,256k,1m --out $OUT/decode-h200 > $OUT/decode-h200.log 2>&1
echo "decode rc $?"; grep -v "^\[" $OUT/decode-h200.log | tail -62
timeout -s KILL 70 python3 tools/gpu/profile_host.py > $OUT/profile-host.log 2>&1
echo "profile rc $?"; grep -vE "^ +[0-9]|^$|ncalls|Ordered|function calls" $OUT/profile-host.log | tail -30
