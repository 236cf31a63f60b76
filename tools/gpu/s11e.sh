#!/usr/bin/env bash
# Session 10, fifth call: the persistent consumers locate the next work item before the key blocks
# (its dependent scalar loads resolve under them) and issue its Q loads before the epilogue: the
# persistent GPU tests, then short sequences old (HEAD before this session) / v1 (s11d: item located
# and Q loaded before the epilogue) / new, interleaved, sustained timing, two repeats.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0
T=$OUT/gpu-tests-h200-session10e.log; : > "$T"
. tools/gpu/_tests.sh
PYTHONPATH=src:tools/gpu run_tests persistent 150 tests/test_triton_hopper_gpu.py -k "persistent or short or pad or nan"
for rep in 1 2; do
  for tree in old v1 new; do
    case $tree in old) P=tools/gpu/ab_old;; v1) P=tools/gpu/ab_v1;; new) P=src;; esac
    PYTHONPATH=$P timeout -s KILL 90 python3 -m cpattn.bench kernel --workloads short \
      --short 1024x128,256x512,128x1024,64x2048,32x4096 --backends triton --iters 5 --warmup-ms 200 --min-ms 50 \
      --out /tmp/q-$tree-$rep > /tmp/q.log 2>&1
    echo "$tree rep $rep rc $? $(python3 -c "
import json; rows = json.load(open('/tmp/q-$tree-$rep.json'))
print(' | '.join(f\"{r['workload'].replace('d128 ', '')} {r['tflops']:.0f}\" for r in rows))")"
  done
done
cp /tmp/q-old-2.json $OUT/short-qprefetch-old-h200-s11e.json; cp /tmp/q-new-2.json $OUT/short-qprefetch-new-h200-s11e.json
