#!/usr/bin/env bash
# Session 10, second call (within 30 s of s11a.sh): FA4 install; whether the 16k ratios depend on
# the timing (backend order, warm-up, repeat length), nvidia-smi sampling the clocks and power;
# then issue 14's whole kernel table with FA4 in one run.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_fa4.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 100 > $OUT/smi-s11b.csv 2>&1 &
SMI=$!
run() {  # label, extra args
  local label=$1; shift
  timeout -s KILL 120 python3 -m cpattn.bench kernel --workloads dense --shapes d128,d192 --seqs 16384 --cps 1,4,8 \
    --no-interleave --iters 5 --out /tmp/t-$label "$@" > /tmp/t-$label.log 2>&1
  echo "$label rc $? [$(date +%T)] $(python3 -c "
import json; rows = json.load(open('/tmp/t-$label.json'))
print(' | '.join(f\"{r['workload'].replace(' S=16k zigzag', '')} {r['backend']} {r['tflops']:.0f} x{r.get('ms', 0) and 1}\" for r in rows))" | sed 's/ x1//g')"
}
run tf-default --backends triton,fa4
run ft-default --backends fa4,triton
run tf-warm --backends triton,fa4 --warmup-ms 200 --min-ms 50
run ft-warm --backends fa4,triton --warmup-ms 200 --min-ms 50
timeout -s KILL 400 python3 -m cpattn.bench kernel --workloads dense,paged,mla,decode,short --shapes d128,d192 \
  --seqs 16384,65536,131072 --cps 1,2,4,8 --pages 16,64,256 --no-interleave --backends triton,fa4 --iters 5 \
  --warmup-ms 200 --min-ms 50 --out $OUT/kernel14-fa4-h200-s11 > $OUT/kernel14-fa4-h200-s11.log 2>&1
echo "kernel rc $? [$(date +%T)]"
kill $SMI
grep -E "^  " $OUT/kernel14-fa4-h200-s11.log | sed 's/(target[^)]*)//g' | cut -c1-150 | head -80
