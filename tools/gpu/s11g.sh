#!/usr/bin/env bash
# Session 10, seventh call: overlap=2 with its wait for P_{j-1} V_{j-1} gated on the softmax
# (wgmma_wait_after: the softmax now runs under the GEMM in the SASS): the overlap GPU tests, then
# an interleaved A/B of overlap 0 (default) / 2 / 2 + pingpong, sustained timing, two repeats.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-session10g.log; : > "$T"
. tools/gpu/_tests.sh
run_tests overlap 120 tests/test_triton_hopper_gpu.py -k overlap
for rep in 1 2; do
  for opt in overlap=0 overlap=2 overlap=2,pingpong=1; do
    timeout -s KILL 60 python3 -m cpattn.bench kernel --workloads dense --shapes d128,d192 --seqs 16384,65536 \
      --cps 1,4 --no-interleave --backends triton --iters 5 --sm90-options $opt --out /tmp/o-$opt-$rep > /tmp/o.log 2>&1
    echo "$opt rep $rep rc $? $(python3 -c "
import json; rows = json.load(open('/tmp/o-$opt-$rep.json'))
print(' | '.join(f\"{r['workload'].replace(' zigzag', '').replace('S=', '')} {r['tflops']:.0f}\" for r in rows))")"
  done
done
cp /tmp/o-overlap=0-2.json $OUT/overlap0-h200-s11g.json; cp /tmp/o-overlap=2-2.json $OUT/overlap2-h200-s11g.json
