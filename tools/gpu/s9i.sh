#!/usr/bin/env bash
# Session 8, ninth call: the planned-launch GPU tests after the last change (global scratch
# buffers kept for the launch's lifetime instead of evicted past 4 streams).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-s8i.log; : > "$T"
. tools/gpu/_tests.sh
run_tests launch 150 tests/test_host_launch_gpu.py tests/test_plans.py
