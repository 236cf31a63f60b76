#!/usr/bin/env bash
# Session 6, call 9 (issue 13): sharded decode at 1M with the "10 calls per graph" column (the
# layers of an engine's step graph) beside the one-call graph.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
timeout -s KILL 200 python3 -m cpattn.bench decode --shapes mla,gqa --cps 1,8 --batches 1,8 --keys 1m --q-lens 1,4 \
  --iters 5 --no-crossover --out $OUT/decode-h200-s6-layers > $OUT/decode-h200-s6-layers.log 2>&1
echo "decode rc $?"; grep -E "^\| |C=8 / C=1|GQA" $OUT/decode-h200-s6-layers.log | cut -c1-200
