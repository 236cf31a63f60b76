#!/usr/bin/env bash
# Session 5, last call: GPU tests after the final index-score change (relu keeps NaN) and the
# MLA split target of 1 per SM (DSA, shard / merge, plans), then the sparse benchmark again.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-session5-final.log
. tools/gpu/_tests.sh
run_tests dsa 160 tests/test_dsa_gpu.py
run_tests shard 200 tests/test_shard_attention.py tests/test_merge_kernels.py
run_tests plans 120 tests/test_plans.py tests/test_triton_kernel.py -k "decode or graph or plan"
timeout -s KILL 120 python3 -m cpattn.bench sparse --iters 5 --warmup 2 --families mla --out $OUT/sparse-h200-s5-final > /tmp/sparse.log 2>&1
echo "sparse rc $?"; grep -E "^S=" /tmp/sparse.log | cut -c1-140
