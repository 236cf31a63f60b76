#!/usr/bin/env bash
# Next session, first experiment (issue 12): is the slower 128k sparse-attention point after the
# 32k workload an allocator-placement effect? The standard two-size sparse run, then the same with
# the caching allocator emptied before each size, then 128k alone; twice each, alternating.
# (Ran in session 6: no effect; bench sparse --empty-cache was removed after this run.)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
for i in 1 2; do
  for extra in "" "--empty-cache" "--seqs 131072"; do
    timeout -s KILL 100 python3 -m cpattn.bench sparse --iters 10 --warmup 2 --families mla $extra \
      --out /tmp/sparse-$i > /tmp/s.log 2>&1
    echo "run $i [${extra:-two sizes}] rc $?"; grep -E "^S=128k.*sparse" /tmp/s.log | cut -c1-120
  done
done
