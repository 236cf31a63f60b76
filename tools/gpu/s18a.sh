#!/usr/bin/env bash
# Prepared in the thirteenth session, not run (no device time left): does softmax_under_pv.patch
# (softmax_j's EX2s under P_{j-1} V_{j-1}; s17e: 0.988, dropped) do more work per clock and lose
# it to a lower clock at the 700 W cap? The benchmark's --clocks (nvidia-smi sampled during each
# backend's warm-up and timed calls: sm_mhz, watts, tflops_per_ghz in the JSON rows) on the tree
# and the patched copy, triton only, d128 / d192 16k / 64k zigzag C = 1, 2 (1.5 s warm-up per
# workload), two interleaved repeats. No FA4, no carry; about 4 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s18a-lines.txt
make_variant /tmp/spv softmax_under_pv
for rep in 1 2; do
  for tree in src /tmp/spv/src; do
    name=tree; [ "$tree" = src ] || name=spv
    stem=$OUT/clocks-$name-rep$rep
    PYTHONPATH=$tree timeout -s KILL 150 python3 -m cpattn.bench kernel --workloads dense --shapes d128,d192 \
      --seqs 16384,65536 --cps 1,2 --no-interleave --no-paged --backends triton --iters 5 --warmup-ms 1500 \
      --min-ms 500 --clocks --out $stem > $stem.log 2>&1
    echo "$name rep $rep rc $?: $(python3 -c "
import json
for r in json.load(open('$stem.json')):
    print(f\"{r['workload'].replace(' zigzag', '')} {r['tflops']:.0f} TF/s {r.get('sm_mhz', 0):.0f} MHz \"
          f\"{r.get('tflops_per_ghz', 0):.0f}/GHz\", end=' | ')")" | tee -a $L
  done
done
cp $L $OUT/
