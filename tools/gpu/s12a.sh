#!/usr/bin/env bash
# Ninth session, first call (prepared in the eighth): the overlap=2 lead. (1) The two paged + window + sinks
# overlap=2 cases that did not finish in s11g, alone under a limit with a stack dump after 45 s
# (hang or slow compile?), on the tree and on a copy with tools/gpu/patches/overlap2_gated_wait.patch
# (the wait for P_{j-1} V_{j-1} gated on the softmax by setp.neu, D128 / D64 only); (2) d128 dense
# A/B: overlap 0 (default) / overlap 2 / overlap 2 gated, sustained timing, two repeats.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0
rm -rf /tmp/gated && mkdir -p /tmp/gated && cp -r src /tmp/gated/ \
  && patch -s -d /tmp/gated/src -p2 < tools/gpu/patches/overlap2_gated_wait.patch || { echo "patch failed"; exit 1; }
for tree in src /tmp/gated/src; do
  for pp in "" --pingpong; do
    echo "== $tree overlap 2 $pp, page 16, window 700, sinks"
    PYTHONPATH=$tree timeout -s KILL 60 python3 tools/gpu/overlap_case.py --overlap 2 $pp --sinks --stack-after 40 2>&1 | tail -20
    echo "rc ${PIPESTATUS[0]}"
  done
done
for rep in 1 2; do
  for v in "src overlap=0" "src overlap=2" "/tmp/gated/src overlap=2"; do
    set -- $v
    PYTHONPATH=$1 timeout -s KILL 100 python3 -m cpattn.bench kernel --workloads dense --shapes d128 \
      --seqs 16384,65536,131072 --cps 1,2,4,8 --no-interleave --backends triton --iters 5 --sm90-options $2 \
      --out /tmp/g > /tmp/g.log 2>&1
    echo "$1 $2 rep $rep rc $? $(python3 -c "
import json; rows = json.load(open('/tmp/g.json'))
print(' | '.join(f\"{r['workload'].replace('d128 S=', '').replace(' zigzag', '')} {r['tflops']:.0f}\" for r in rows))")"
  done
done
