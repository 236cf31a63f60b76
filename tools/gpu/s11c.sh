#!/usr/bin/env bash
# Session 10, third call: the 16k dense points under sustained load (--warmup-ms 200 --min-ms 50,
# the timing of s11b's table): sm90 option variants, interleaved, two repeats; then the short
# sequences with the persistent schedule forced on / off.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
one() {  # label, bench args...
  local label=$1; shift
  timeout -s KILL 90 python3 -m cpattn.bench kernel --iters 5 --warmup-ms 200 --min-ms 50 --out /tmp/v-$label "$@" > /tmp/v.log 2>&1
  echo "$label rc $? $(python3 -c "
import json; rows = json.load(open('/tmp/v-$label.json'))
print(' | '.join(f\"{r['workload'].replace(' zigzag', '').replace('S=', '')} {r['backend'].replace('triton', 't')} {r['tflops']:.0f}\" for r in rows))")"
}
for rep in 1 2; do
  for opt in stages=3 sections=0 stages=2 block_n=64,stages=4; do
    one "$opt-$rep" --workloads dense --shapes d128,d192 --seqs 16384 --cps 1,2,4,8 --no-interleave --backends triton \
      --sm90-options $opt
  done
done
for rep in 1 2; do
  one "short-$rep" --workloads short --short 128x1024,64x2048,32x4096 --backends triton,triton-per-tile
done
