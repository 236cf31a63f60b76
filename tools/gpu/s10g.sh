#!/usr/bin/env bash
# Session 9, seventh call: the dense sm90 grid without L2 head sections where they would leave a
# long tail (sections="auto"): its GPU tests, then d192 zigzag with sections forced on against
# auto, two alternating repeats.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-session9g.log; : > "$T"
. tools/gpu/_tests.sh
run_tests sections 100 tests/test_triton_hopper_gpu.py -k "sections or persistent_is_bit"
for rep in 1 2; do
  for opt in sections=1 sections=auto; do
    timeout -s KILL 60 python3 -m cpattn.bench kernel --workloads dense --shapes d192 --seqs 16384,65536,131072 \
      --cps 1,2,4,8 --no-interleave --backends triton --sm90-options $opt --iters 5 --out /tmp/s-$opt-$rep > /tmp/s.log 2>&1
    echo "$opt rep $rep rc $? $(python3 -c "
import json; rows = json.load(open('/tmp/s-$opt-$rep.json'))
print(' | '.join(f\"{r['workload'].replace('d192 S=', '').replace(' zigzag', '')} {r['tflops']:.0f}\" for r in rows))")"
  done
done
cp /tmp/s-sections=1-2.json $OUT/d192-sections-on-h200-s10.json; cp /tmp/s-sections=auto-2.json $OUT/d192-sections-auto-h200-s10.json
