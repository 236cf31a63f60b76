#!/usr/bin/env bash
# Session 5, tuning aid: index-score kernel configs (the benchmarks ran with the autotuner off,
# i.e. its first config (128, 8 warps, 2 stages)) at 32k and 128k (issue 12).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
timeout -s KILL 200 python3 tools/gpu/index_topk_sweep.py --seqs 32768,32768 > $OUT/topk-slack-sweep.log 2>&1; echo "rc $?"
grep -E "^S=" $OUT/topk-slack-sweep.log | cut -c1-150
