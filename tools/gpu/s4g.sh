#!/usr/bin/env bash
# Session 4, validation call: the recalibrated pass-KV / pass-Q cost model at its calibration
# point (T=1024, C=4) and out of sample (T=4096 C=4, T=1024 C=8); absorbed-MLA decode through
# dense decode-shaped plans after the planned split / combine launches.
set -uo pipefail
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src
cd "$(dirname "$0")/../.."
for tc in "1024 4" "4096 4" "1024 8"; do
  set -- $tc
  timeout -s KILL 60 python3 -m cpattn.bench decode --shapes gqa --cps 1 --batches 1 --keys 4k --q-lens 1 --iters 5 \
    --crossover-tokens $1 --crossover-cp $2 --crossover-prefixes 0,4k,16k,64k,256k,1m --out $OUT/crossover-t$1-c$2 \
    > $OUT/crossover-t$1-c$2.log 2>&1
  echo "T=$1 C=$2 rc $?: $(grep 'crossover (prefix' $OUT/crossover-t$1-c$2.log)"
done
timeout -s KILL 80 python3 -m cpattn.bench kernel --workloads decode --decode-batches 1,8,64 --decode-lens 4096,32768 \
  --backends triton --iters 5 --out $OUT/kernel-decode-h200 > $OUT/kernel-decode-h200.log 2>&1
echo "kernel rc $?"; grep -v "^\[" $OUT/kernel-decode-h200.log | grep "decode" | head -30
