#!/usr/bin/env bash
# Session 8, first call (issue 11): GPU tests of the planned launches after two changes (per-call
# pointer tensors passed as addresses; the portable packed kernel's global scratch kept by the
# direct launch), then where plan.run's host time goes (sm90 / portable, packed / paged) and
# host µs per plan.run with the one-call + sync ratio.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-s8a.log; : > "$T"
. tools/gpu/_tests.sh
run_tests launch 240 tests/test_host_launch_gpu.py tests/test_plans.py tests/test_merge_kernels.py \
  tests/test_overlap.py tests/test_sharded_distributed.py
timeout -s KILL 120 python3 tools/gpu/paged_host_probe.py > $OUT/host-probe-h200-s8.log 2>&1
echo "probe rc $?"; cut -c1-230 $OUT/host-probe-h200-s8.log | tail -6
timeout -s KILL 170 python3 tools/gpu/profile_host.py > $OUT/host-h200-s8.log 2>&1
echo "host rc $?"; sed -n "/^kernel bench/,\$p" $OUT/host-h200-s8.log | cut -c1-220
