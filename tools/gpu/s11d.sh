#!/usr/bin/env bash
# Session 10, fourth call: the persistent dense sm90 consumers issue the next item's Q loads before
# the current item's epilogue (D <= 128): the Hopper GPU tests, then an interleaved A/B of the short
# sequences against the previous tree (tools/gpu/ab_old, untracked: HEAD's src with this bench),
# sustained timing (--warmup-ms 200 --min-ms 50), two repeats each.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0
T=$OUT/gpu-tests-h200-session10d.log; : > "$T"
. tools/gpu/_tests.sh
PYTHONPATH=src:tools/gpu run_tests hopper 280 tests/test_triton_hopper_gpu.py
for rep in 1 2; do
  for tree in old new; do
    if [ $tree = old ]; then P=tools/gpu/ab_old; else P=src; fi
    PYTHONPATH=$P timeout -s KILL 90 python3 -m cpattn.bench kernel --workloads short \
      --short 1024x128,256x512,128x1024,64x2048,32x4096 --backends triton --iters 5 --warmup-ms 200 --min-ms 50 \
      --out /tmp/q-$tree-$rep > /tmp/q.log 2>&1
    echo "$tree rep $rep rc $? $(python3 -c "
import json; rows = json.load(open('/tmp/q-$tree-$rep.json'))
print(' | '.join(f\"{r['workload'].replace('d128 ', '')} {r['tflops']:.0f}\" for r in rows))")"
  done
done
cp /tmp/q-old-2.json $OUT/short-qprefetch-old-h200-s11.json; cp /tmp/q-new-2.json $OUT/short-qprefetch-new-h200-s11.json
