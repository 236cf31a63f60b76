#!/usr/bin/env bash
# Session 6, call 6 (issue 13): why the fused cross-rank merge reads at ~400 GB/s.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
timeout -s KILL 200 python3 tools/gpu/merge_probe.py > $OUT/merge-probe.log 2>&1
echo "rc $?"; grep -v -i warn $OUT/merge-probe.log | cut -c1-150
