#!/usr/bin/env bash
# Session 6, call 1: GPU tests of the review refactors (one Hopper eligibility check, the MLA
# latent launcher shared by prefill / decode, the Gluon K/V-row helper), then where a small
# sharded decode step's time goes (issue 13) and host µs with the GPU idle (issue 11).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-session6.log
. tools/gpu/_tests.sh
run_tests hopper 150 tests/test_triton_hopper_gpu.py tests/test_host_launch_gpu.py
run_tests dsa 100 tests/test_dsa_gpu.py
run_tests shard 200 tests/test_shard_attention.py tests/test_merge_kernels.py tests/test_plans.py
echo "== decode profile"
timeout -s KILL 100 python3 tools/gpu/decode_profile.py \
  --cases mla:1:1:1m:1,mla:8:1:1m:1,mla:8:1:1m:4,gqa:1:1:1m:1,gqa:8:1:1m:1 > $OUT/decode-profile.log 2>&1
echo "rc $?"; cat $OUT/decode-profile.log | cut -c1-150 | head -60
echo "== host profile"
timeout -s KILL 120 python3 tools/gpu/profile_host.py > $OUT/host-h200-s6.log 2>&1
echo "rc $?"; grep -E "same K/V|one call|kernel duration|graph replay" $OUT/host-h200-s6.log | cut -c1-220
