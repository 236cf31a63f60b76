#!/usr/bin/env bash
# Eleventh session, fourth call: the tree with the three kept patches (split K/V release, O through
# the Q tile, D192 in OVERLAP_HEAD_DIMS) and the fix for the hang s13c.sh's tests found (the cp.async
# gather loader on 2 stages runs without overlap: triton_sm90.ring_overlap). (1) The four cases that
# did not finish in s13c.sh's group (one hung: D192 page 2 at overlap 2), alone; (2) the whole
# Hopper file; (3) the other single-GPU files that run the dense kernel.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu
T=$OUT/gpu-tests-h200-s14a.log; : > "$T"
. tools/gpu/_tests.sh
F=tests/test_triton_hopper_gpu.py
run_tests unfinished 120 "$F::test_gpu_sm90_paged_vs_torch[2-192-128-16-16--1-True-False]" \
  "$F::test_gpu_static_plan_graph_replay[sm90-192-128-16-16-1-options3]" \
  "$F::test_gpu_sm90_overlap_modes_vs_torch[128-128-32-8-None--1-False-1-False]" \
  "$F::test_gpu_sm90_overlap_modes_vs_torch[128-128-32-8-None--1-False-2-False]"
run_tests hopper 200 $F
run_tests others 150 tests/test_plans.py tests/test_host_launch_gpu.py tests/test_triton_kernel.py \
  tests/test_planned_launch.py
grep -E "passed|failed" /tmp/t-*.log | grep -E " in [0-9.]+s" 
