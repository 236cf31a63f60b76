#!/usr/bin/env bash
# Session 10, first call (FA4 staging part 1 first): the L2-section decision per d192 point (and
# the L2 size torch reports), the revised sections GPU test, then the s10g A/B again with the
# 1.05 default: d192 zigzag, sections forced on against auto, two alternating repeats.
set -uo pipefail
cd "$(dirname "$0")/../.."
bash .gpu/fa4-1/stage.sh > /tmp/fa4-stage1.log 2>&1; echo "fa4 stage 1 rc $?"
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-session10a.log; : > "$T"
. tools/gpu/_tests.sh
python3 tools/gpu/sections_decisions.py --shapes d192,d128 --seqs 16384,65536,131072 --cps 1,2,4,8 2>&1 | tail -30
run_tests sections 150 tests/test_triton_hopper_gpu.py -k "sections or persistent_is_bit"
for rep in 1 2; do
  for opt in sections=1 sections=auto; do
    timeout -s KILL 70 python3 -m cpattn.bench kernel --workloads dense --shapes d192 --seqs 16384,65536,131072 \
      --cps 1,2,4,8 --no-interleave --backends triton --sm90-options $opt --iters 5 --out /tmp/s-$opt-$rep > /tmp/s.log 2>&1
    echo "$opt rep $rep rc $? $(python3 -c "
import json; rows = json.load(open('/tmp/s-$opt-$rep.json'))
print(' | '.join(f\"{r['workload'].replace('d192 S=', '').replace(' zigzag', '')} {r['tflops']:.0f}\" for r in rows))")"
  done
done
cp /tmp/s-sections=1-2.json $OUT/d192-sections-on-h200-s11.json; cp /tmp/s-sections=auto-2.json $OUT/d192-sections-auto-h200-s11.json
