#!/usr/bin/env bash
# Session 6, call 4 (issues 13, 14): the split-KV combine kernel's geometry on decode shapes.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
timeout -s KILL 400 python3 tools/gpu/combine_sweep.py > $OUT/combine-sweep.log 2>&1
echo "rc $?"; cut -c1-160 $OUT/combine-sweep.log | grep -v Warn | tail -50
