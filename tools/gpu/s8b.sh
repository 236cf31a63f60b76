#!/usr/bin/env bash
# Session 7, second call: the GPU tests s8a's 200 s limit cut off (graph capture, planned launch,
# the MLA shard cases, the sharded extend), then host µs per plan.run on this session's host
# (issue 11).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-s7b.log; : > "$T"
. tools/gpu/_tests.sh
run_tests rest 300 tests/test_plans.py tests/test_host_launch_gpu.py tests/test_sharded_distributed.py \
  "tests/test_shard_attention.py::test_gpu_mla_kernel_shard_attention"
timeout -s KILL 150 python3 tools/gpu/profile_host.py > $OUT/host-h200-s7.log 2>&1
echo "host rc $?"; grep -E "same K/V|one call" $OUT/host-h200-s7.log | cut -c1-220
