#!/usr/bin/env bash
# Ready for the next session (issue 13, B = 1): is the GQA split target (PROGRAMS_PER_SM 12)
# right for a small C = 8 shard (171 items x 768 keys at L = 1M)? The shard at several targets,
# 10 calls per graph, q1 and q4; then the MLA B = 1 step's kernels at its default.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
for pps in 4 6 8 12 16 24; do
  timeout -s KILL 60 python3 -m cpattn.bench decode --shapes gqa --cps 8 --batches 1 --keys 1m --q-lens 1,4 \
    --iters 20 --no-crossover --programs-per-sm $pps --out /tmp/pps-$pps > /tmp/pps.log 2>&1
  echo "programs_per_sm $pps rc $?"; grep -E "^\| gqa" /tmp/pps.log | cut -c1-170
done
timeout -s KILL 60 python3 tools/gpu/decode_profile.py --cases gqa:8:1:1m:1,gqa:8:1:1m:4 \
  --options "programs_per_sm=6;programs_per_sm=12;programs_per_sm=24" 2>&1 | grep -v -i warn | cut -c1-140
