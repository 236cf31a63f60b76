#!/usr/bin/env bash
# Session 9, sixth call: the GPU tests s10e's time limit cut off (pair mode cases 1 and 3, the
# 128k-key split-KV cases), on the final kernel code.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-session9f.log; : > "$T"
. tools/gpu/_tests.sh
run_tests rest 200 tests/test_shard_attention.py -k "pair or 128k or more_than_two or graph"
