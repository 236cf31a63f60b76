#!/usr/bin/env bash
# Session 5, last call: decode-shaped dense plans whose combine also writes the pad rows (no
# zero / fill launches): GPU tests (plans, shard / MLA split) and the kernel bench decode table.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-session5-decode.log
timeout -s KILL 100 python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider -rfE tests/test_plans.py \
  tests/test_triton_kernel.py -k "decode or graph or plan" > $T 2>&1
echo "== plans (rc $?): $(grep -cE ' PASSED' $T) passed, $(grep -cE ' FAILED| ERROR' $T) failed"
timeout -s KILL 110 python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider -rfE tests/test_shard_attention.py \
  -k "mla or ragged" >> $T 2>&1
echo "== shard (rc $?): $(grep -cE ' PASSED' $T) passed in all, $(grep -cE ' FAILED| ERROR' $T) failed"
grep -E "^(FAILED|ERROR) |^E  " $T | head -8
timeout -s KILL 110 python3 -m cpattn.bench kernel --workloads decode --decode-batches 1,8,64 \
  --decode-lens 4096,32768,131072 --backends triton --iters 10 --out $OUT/kernel-decode-h200-s5-final > /tmp/kdec.log 2>&1
echo "rc $?"; grep "^  mla576" /tmp/kdec.log | sed 's/(target at B >= 8: >= 2500 GB\/s or >= 400 TF\/s)//' | cut -c1-140
