#!/usr/bin/env bash
# Twelfth session, last call: the other GPU test files on the final tree (0.3.9: D128 ping-pong
# by default), which run the dense sm90 kernel through plans, host launches, CUDA graphs and
# sharded attention.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src
T=$OUT/gpu-tests-h200-s16e.log; : > "$T"
. tools/gpu/_tests.sh
run_tests plans 300 tests/test_plans.py tests/test_host_launch_gpu.py tests/test_triton_kernel.py \
  tests/test_shard_attention.py tests/test_overlap.py tests/test_merge_kernels.py
