#!/usr/bin/env bash
# Eleventh session, fifth call: does the non-overlapped loop lose by releasing K after Q K^T (s13a:
# the split release at d192 overlap=0 ran 3% below the old tree, geomean)? A/B of the tree (K
# after Q K^T, V after P V) against joint_release_overlap0.patch (both halves after P V, as before
# the split) at d192 overlap=0, 16k / 64k, C = 1..8, two alternating repeats; the Hopper GPU tests
# that run overlap=0 on the joint variant (paged incl. windowed / D64 / the D192 gather,
# persistent bit identity). As run, the joint variant was the working tree ("src" in
# docs/benchmarks/s13/s14b-stdout.log) and the tree a patched copy ("/tmp/early/src"); the two
# measured equal, the tree was kept, and the script was rewritten to patch the other way: the same
# two sources under these labels.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0
. tools/gpu/_variant.sh
make_variant /tmp/joint joint_release_overlap0
T=$OUT/gpu-tests-h200-s14b.log; : > "$T"
. tools/gpu/_tests.sh
PYTHONPATH=/tmp/joint/src:tools/gpu run_tests ov0 80 tests/test_triton_hopper_gpu.py -k "paged_vs_torch or bit_identical"
for rep in 1 2; do
  for tree in /tmp/joint/src src; do
    rm -f /tmp/g.json
    PYTHONPATH=$tree timeout -s KILL 45 python3 -m cpattn.bench kernel --workloads dense --shapes d192 \
      --seqs 16384,65536 --cps 1,2,4,8 --no-interleave --backends triton --iters 5 --sm90-options overlap=0 \
      --out /tmp/g > /tmp/g.log 2>&1
    rc=$?; [ $rc = 0 ] || tail -3 /tmp/g.log
    echo "$tree overlap=0 rep $rep rc $rc $(python3 -c "
import json; rows = json.load(open('/tmp/g.json'))
print(' | '.join(f\"{r['workload'].replace(' zigzag', '')} {r['tflops']:.0f}\" for r in rows))")"
  done
done
