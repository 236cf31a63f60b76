#!/usr/bin/env bash
# Session 6, call 7 (issues 13, 14): merge / combine kernels with the one-pass chunk and the new
# merge_blocks rule: GPU tests, the merge probe (one pass vs two, warps) and the combine sweep.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-session6-merge.log
. tools/gpu/_tests.sh
run_tests merge 150 tests/test_merge_kernels.py tests/test_shard_attention.py
timeout -s KILL 150 python3 tools/gpu/merge_probe.py > $OUT/merge-probe.log 2>&1
echo "probe rc $?"; grep -v -i warn $OUT/merge-probe.log | cut -c1-150
timeout -s KILL 200 python3 tools/gpu/combine_sweep.py > $OUT/combine-sweep.log 2>&1
echo "sweep rc $?"; grep -E "rule|splits" $OUT/combine-sweep.log | cut -c1-150
