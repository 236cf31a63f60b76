#!/usr/bin/env bash
# Session 9, third call (FA4 staging part 1 first): GPU tests of the MLA decode pair mode (two-split
# tiles merged inside the kernel, no combine) and of the dense sm90 kernel with persistent="auto",
# then the pair mode A/B (decode table, alternating runs) and short sequences auto / per-tile.
set -uo pipefail
cd "$(dirname "$0")/../.."
bash .gpu/fa4-1/stage.sh > /tmp/fa4-stage1.log 2>&1; echo "fa4 stage 1 rc $?"
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-session9.log; : > "$T"
. tools/gpu/_tests.sh
run_tests shard 200 tests/test_shard_attention.py tests/test_plans.py tests/test_host_launch_gpu.py
run_tests hopper 250 tests/test_triton_hopper_gpu.py tests/test_triton_kernel.py
for rep in 1 2; do
  for pair in 1 0; do
    timeout -s KILL 60 python3 -m cpattn.bench kernel --workloads decode --decode-batches 8 --decode-lens 4096,32768 \
      --decode-qlens 4 --decode-options pair=$pair --backends triton --iters 10 --out /tmp/kd-$pair-$rep > /tmp/kd.log 2>&1
    echo "pair=$pair rep $rep rc $? $(python3 -c "
import json; d = json.load(open('/tmp/kd-$pair-$rep.json')); rows = d['rows'] if isinstance(d, dict) else d
print(' | '.join(f\"{r['workload'].replace('mla576 decode ', '')} {r['tflops']:.0f}/{r['tflops_graph']:.0f}\" for r in rows))")"
  done
done
cp /tmp/kd-1-2.json $OUT/decode-pair-h200-s10.json; cp /tmp/kd-0-2.json $OUT/decode-nopair-h200-s10.json
timeout -s KILL 100 python3 -m cpattn.bench kernel --workloads short \
  --short 1024x128,128x1024,64x2048,32x4096,16x8192 --backends triton,triton-per-tile --iters 10 \
  --out /tmp/short > /tmp/short.log 2>&1
echo "short rc $?"; grep -E "^\| d128" /tmp/short.log
