#!/usr/bin/env bash
# Session 8, sixth call: the planned-launch, plan and dense kernel GPU tests on the final code
# (per-call trims of plan.run / the triton backend after s9a / s9c ran them).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-s8f.log; : > "$T"
. tools/gpu/_tests.sh
run_tests launch 200 tests/test_host_launch_gpu.py tests/test_plans.py tests/test_merge_kernels.py \
  tests/test_overlap.py tests/test_sharded_distributed.py
run_tests hopper 220 tests/test_triton_hopper_gpu.py tests/test_triton_kernel.py tests/test_dsa_gpu.py
