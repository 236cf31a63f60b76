#!/usr/bin/env bash
# Eleventh session, first call: K and V halves of a stage released separately
# (tools/gpu/patches/split_kv_release.patch: K after Q K^T, V after P V, the loader arming each
# ready barrier once its half is free), which should let overlap=2 stream K_{j+1} while V_{j-1}
# is still read: at D192 (2 stages) overlap=2 holds both stages and ran 9-20% slower (s12b).
# (1) All Hopper GPU tests on a patched copy of src (a deadlock shows as the limit); (2) A/B tree
# vs patched, overlap 0 / 2 (and the tree at overlap=1, never timed sustained, and with 64-key
# blocks x 4 stages at overlap=2: at D192 the other way to give the overlapped loop more than 2
# stages; offline no spills), d128 + d192 dense at 16k / 64k, sustained timing, two repeats.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s13a-lines.txt
variant_hopper_tests split split_kv_release
for rep in 1 2; do
  for v in "src overlap=0" "src overlap=1" "src overlap=2" "/tmp/split/src overlap=0" "/tmp/split/src overlap=2" \
           "src block_n=64,stages=4,overlap=2"; do
    set -- $v; tree=$1; o=$2
    rm -f /tmp/g.json
    PYTHONPATH=$tree timeout -s KILL 60 python3 -m cpattn.bench kernel --workloads dense --shapes d128,d192 \
      --seqs 16384,65536 --cps 1,2,4,8 --no-interleave --backends triton --iters 5 --sm90-options $o \
      --out /tmp/g > /tmp/g.log 2>&1
    rc=$?; [ $rc = 0 ] || tail -5 /tmp/g.log
    echo "$tree $o rep $rep rc $rc $(python3 -c "
import json; rows = json.load(open('/tmp/g.json'))
print(' | '.join(f\"{r['workload'].replace(' zigzag', '')} {r['tflops']:.0f}\" for r in rows))")" | tee -a $L
  done
done
cp $L $OUT/
