#!/usr/bin/env bash
# Session 7, first call: GPU tests of this session's changes (direct launches on 3-D grids: merge
# and combine; memoized merge geometry; partial_dtype), then the C = 1 / 8 decode table at L = 1M
# with float32 and with bfloat16 split partials (issue 13, B = 1; the partial_dtype option this ran
# with was removed after it: no gain), then the GQA split target on the
# small C = 8 shard (s7b's sweep, shortened).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-s7.log; : > "$T"
. tools/gpu/_tests.sh
run_tests decode-merge 200 tests/test_shard_attention.py tests/test_merge_kernels.py tests/test_host_launch_gpu.py \
  tests/test_plans.py tests/test_sharded_distributed.py
for pd in float32 bfloat16; do
  timeout -s KILL 150 python3 -m cpattn.bench decode --shapes mla,gqa --cps 1,8 --batches 1,8 --keys 1m \
    --q-lens 1,4 --iters 20 --no-crossover --partial-dtype $pd --out $OUT/decode-1m-$pd > /tmp/d-$pd.log 2>&1
  echo "decode partials $pd rc $?"; grep -E "C=8 / C=1|^\| (mla|gqa)" /tmp/d-$pd.log | cut -c1-200
done
for pps in 6 8 16 24; do
  timeout -s KILL 45 python3 -m cpattn.bench decode --shapes gqa --cps 8 --batches 1 --keys 1m --q-lens 1,4 \
    --iters 20 --no-crossover --programs-per-sm $pps --out /tmp/pps-$pps > /tmp/pps.log 2>&1
  echo "programs_per_sm $pps rc $?"; grep -E "^\| gqa" /tmp/pps.log | cut -c1-200
done
