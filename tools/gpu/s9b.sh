#!/usr/bin/env bash
# Session 8, second call: host µs per plan.run in interleaved rounds (issue 11), then the other
# GPU tests whose launches go direct (shard / decode, DSA) after the per-call pointer tensors
# became addresses.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-s8b.log; : > "$T"
. tools/gpu/_tests.sh
timeout -s KILL 80 python3 tools/gpu/host_rounds.py > $OUT/host-rounds-h200-s8.log 2>&1
echo "rounds rc $?"; tail -7 $OUT/host-rounds-h200-s8.log | cut -c1-230
run_tests shard 270 tests/test_shard_attention.py
run_tests dsa 210 tests/test_dsa_gpu.py
