#!/usr/bin/env bash
# Session 8, fourth call: the dense Hopper and portable kernel GPU tests (their launches go direct
# with per-call pointer tensors as addresses), then the kernel benchmark's dense / paged / decode
# points (kernels unchanged this session: TF/s and the one-call + sync column after the host
# changes; issues 11, 14).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-s8c.log; : > "$T"
. tools/gpu/_tests.sh
run_tests hopper 250 tests/test_triton_hopper_gpu.py tests/test_triton_kernel.py
timeout -s KILL 150 python3 -m cpattn.bench kernel --workloads dense,paged --shapes d128 --seqs 16384,65536 \
  --cps 1,8 --pages 16,64 --no-interleave --backends triton,triton-portable --iters 5 --out $OUT/kernel-h200-s8 \
  > /tmp/k.log 2>&1
echo "kernel rc $?"; grep -E "^\|" /tmp/k.log | cut -c1-160 | head -24
timeout -s KILL 120 python3 -m cpattn.bench kernel --workloads decode --decode-batches 8,64 --decode-lens 4096,32768 \
  --backends triton --iters 10 --out $OUT/kernel-decode-h200-s8 > /tmp/kd.log 2>&1
echo "decode rc $?"; grep -E "^\|" /tmp/kd.log | cut -c1-160 | head -14
