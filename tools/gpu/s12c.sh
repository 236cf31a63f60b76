#!/usr/bin/env bash
# Ninth session, third call: overlap="auto" (overlap=2 at D128 unless persistent) is the sm90
# default now: the Hopper GPU tests (the two paged overlap=2 cases unskipped, overlap 0 and
# "auto" added), the other single-GPU tests that plan dense D128 attention, then FA4 part 1
# staged for s12d.sh (the next call, within 30 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0
T=$OUT/gpu-tests-h200-session11.log; : > "$T"
. tools/gpu/_tests.sh
PYTHONPATH=src:tools/gpu run_tests hopper 300 tests/test_triton_hopper_gpu.py
PYTHONPATH=src:tools/gpu run_tests single 200 tests/test_plans.py tests/test_triton_kernel.py \
  tests/test_host_launch_gpu.py tests/test_shard_attention.py tests/test_dsa_gpu.py tests/test_merge_kernels.py
bash .gpu/fa4-1/stage.sh
