#!/usr/bin/env bash
# Ninth session, fifth call: persistent programs now take overlap (not pingpong): their
# bit-identity test against one program per item in both loops (overlap 0 / 2), then the short
# batches under persistent="auto" with overlap=0 against overlap=2, two interleaved repeats.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu
T=$OUT/gpu-tests-h200-session11e.log; : > "$T"
. tools/gpu/_tests.sh
run_tests persistent 120 tests/test_triton_hopper_gpu.py -k persistent_is_bit_identical
for rep in 1 2; do
  for o in overlap=0 overlap=2; do
    rm -f /tmp/g.json
    timeout -s KILL 60 python3 -m cpattn.bench kernel --workloads short --short 1024x128,256x512,128x1024,64x2048,32x4096 \
      --backends triton --iters 5 --sm90-options $o --out /tmp/g > /tmp/g.log 2>&1
    rc=$?; [ $rc = 0 ] || tail -5 /tmp/g.log
    echo "short rep $rep $o rc $rc $(python3 -c "
import json; rows = json.load(open('/tmp/g.json'))
print(' | '.join(f\"{r['workload'].replace('d128 ', '')} {r['tflops']:.0f}\" for r in rows))")"
  done
done
