#!/usr/bin/env bash
# Session 6, call 10: shard-attention GPU tests on the final combine geometry / warps.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-session6-shard.log
. tools/gpu/_tests.sh
run_tests shard 170 tests/test_shard_attention.py
