#!/usr/bin/env bash
# Session 8, tenth call (issue 14): the dense decode-shaped plans' pad rows in one launch (was a
# zero and a fill): its GPU test, then the decode kernel table at B = 8 / 64 over 4k keys.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-s8j.log; : > "$T"
. tools/gpu/_tests.sh
run_tests pad 60 tests/test_host_launch_gpu.py -k "pad_rows or decode_step"
timeout -s KILL 60 python3 -m cpattn.bench kernel --workloads decode --decode-batches 8,64 --decode-lens 4096 \
  --backends triton --iters 10 --out $OUT/kernel-decode-pad-h200-s8 > /tmp/kd.log 2>&1
echo "decode rc $?"; grep -E "^\| mla" /tmp/kd.log | cut -c1-120
python3 -c "
import json; d = json.load(open('$OUT/kernel-decode-pad-h200-s8.json')); rows = d['rows'] if isinstance(d, dict) else d
print(' | '.join(f\"{r['workload'].replace('mla576 decode ', '')} {r['tflops']:.0f}/{r['tflops_graph']:.0f}\" for r in rows))"
