#!/usr/bin/env bash
# Session 9, fifth call: the paged loader issuing all K copies before V's, and the MLA pair merge
# in two 128-column passes: GPU tests, then an A/B against the previous tree (tools/gpu/ab_old,
# a copy of src/ before both changes), alternating runs: paged 16 / 64 vs packed (C = 2) and
# the B = 8 q4 decode points.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0
T=$OUT/gpu-tests-h200-session9e.log; : > "$T"
. tools/gpu/_tests.sh
PYTHONPATH=src:tools/gpu run_tests paged 200 tests/test_triton_hopper_gpu.py tests/test_shard_attention.py -k "paged or page or pair or mla"
for rep in 1 2; do
  for tree in src tools/gpu/ab_old; do
    tag=$([ $tree = src ] && echo new || echo old)
    PYTHONPATH=$tree timeout -s KILL 120 python3 -m cpattn.bench kernel --workloads dense,paged --shapes d128,d192 \
      --seqs 65536,131072 --cps 2 --pages 16,64 --no-interleave --backends triton --iters 5 --out /tmp/p-$tag-$rep \
      > /tmp/p.log 2>&1
    echo "$tag rep $rep paged rc $?"; grep -E "paged(16|64):" /tmp/p.log | sed 's/(target[^)]*)//g' | cut -c1-90
    PYTHONPATH=$tree timeout -s KILL 60 python3 -m cpattn.bench kernel --workloads decode --decode-batches 8 \
      --decode-lens 4096,32768 --decode-qlens 4 --backends triton --iters 10 --out /tmp/d-$tag-$rep > /tmp/d.log 2>&1
    echo "$tag rep $rep decode rc $? $(python3 -c "
import json; d = json.load(open('/tmp/d-$tag-$rep.json')); rows = d['rows'] if isinstance(d, dict) else d
print(' | '.join(f\"{r['workload'].replace('mla576 decode ', '')} {r['tflops']:.0f}/{r['tflops_graph']:.0f}\" for r in rows))")"
  done
done
cp /tmp/p-new-2.json $OUT/paged-kfirst-h200-s10.json; cp /tmp/p-old-2.json $OUT/paged-interleaved-h200-s10.json
