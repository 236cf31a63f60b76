#!/usr/bin/env bash
# Session 5, index top-k after the change (chunks that follow the causal triangle, several per
# score launch; default score config (128, 4 warps, 3 stages)): DSA GPU tests, the sweep, the
# sparse benchmark with the autotuner off (as before) and on (the library's default).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-session5-index.log
CPATTN_TRITON_AUTOTUNE=0 timeout -s KILL 170 python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider -rfE \
  tests/test_dsa_gpu.py > $T 2>&1
echo "== dsa (rc $?): $(grep -cE ' PASSED' $T) passed, $(grep -cE ' FAILED| ERROR' $T) failed"
grep -E "^(FAILED|ERROR) |^E  " $T | head -8
CPATTN_TRITON_AUTOTUNE=0 timeout -s KILL 120 python3 tools/gpu/index_topk_sweep.py > $OUT/topk-sweep-final.log 2>&1
echo "sweep rc $?"; grep -E "^S=|ms  " $OUT/topk-sweep-final.log | cut -c1-150
CPATTN_TRITON_AUTOTUNE=0 timeout -s KILL 120 python3 -m cpattn.bench sparse --iters 5 --warmup 2 --families mla \
  --out $OUT/sparse-h200-s5-index > /tmp/sparse.log 2>&1
echo "sparse (autotune off) rc $?"; grep -E "^S=" /tmp/sparse.log | cut -c1-140
timeout -s KILL 200 python3 -m cpattn.bench sparse --iters 5 --warmup 2 --families mla \
  --out $OUT/sparse-h200-s5-autotune > /tmp/sparse2.log 2>&1
echo "sparse (autotune on) rc $?"; grep -E "^S=" /tmp/sparse2.log | cut -c1-140
python3 -c "import json; print(json.load(open('$OUT/sparse-h200-s5-autotune.json'))['tuned_configs'])" 2>&1 | cut -c1-600
