#!/usr/bin/env bash
# Session 5, index top-k positions written by one Triton launch per chunk (was five torch ops):
# DSA GPU tests, then the sparse benchmark (issue 12).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-session5-write.log
. tools/gpu/_tests.sh
run_tests dsa 120 tests/test_dsa_gpu.py
timeout -s KILL 90 python3 -m cpattn.bench sparse --iters 5 --warmup 2 --families mla --out $OUT/sparse-h200-s5-write \
  > /tmp/sparse.log 2>&1
echo "sparse rc $?"; grep -E "^S=" /tmp/sparse.log | cut -c1-140
