#!/usr/bin/env bash
# Prepared in the thirteenth session, not run (no device time left): does softmax_under_pv.patch
# (softmax_j's EX2s under P_{j-1} V_{j-1}; s17e: 0.988, dropped) do more work per clock and lose
# it to a lower clock at the 700 W cap? SM clock / power sampled by nvidia-smi while the benchmark
# times the tree and the patched copy (triton only, d128 / d192 16k / 64k zigzag C = 1, 2; 1.5 s
# warm-up per workload), two interleaved repeats; clock_probe.py attributes the samples per
# result (TF/s per GHz, J per PFLOP). No FA4, no carry; about 4 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s18a-lines.txt
make_variant /tmp/spv softmax_under_pv
F=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.sw_power_cap
for rep in 1 2; do
  for tree in src /tmp/spv/src; do
    name=tree; [ "$tree" = src ] || name=spv
    stem=clocks-$name-rep$rep
    nvidia-smi --query-gpu=$F --format=csv,noheader,nounits -lms 100 > $OUT/$stem-smi.csv 2>&1 &
    smi=$!
    PYTHONPATH=$tree timeout -s KILL 150 python3 -m cpattn.bench kernel --workloads dense --shapes d128,d192 \
      --seqs 16384,65536 --cps 1,2 --no-interleave --no-paged --backends triton --iters 5 --warmup-ms 1500 \
      --min-ms 500 --out $OUT/$stem > $OUT/$stem.log 2>&1
    echo "bench $tree rep $rep rc $?"
    kill $smi; wait $smi 2>/dev/null
    python3 tools/gpu/clock_probe.py $OUT/$stem.log $OUT/$stem-smi.csv $OUT/$stem-probe.json
  done
done
