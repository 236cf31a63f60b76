#!/usr/bin/env bash
# Session 5, call 2 (within 30 s of s5a.sh, which ran `bash .gpu/fa4-1/stage.sh`): FA4 install,
# the FA4 GPU tests, then the kernel benchmark with FA4 in the same run (issue 14's ratios).
set -uo pipefail
cd "$(dirname "$0")/../.."
bash .gpu/fa4-2/install.sh > $OUT/fa4-install.log 2>&1 || { echo "fa4 install failed"; tail -5 $OUT/fa4-install.log; exit 1; }
. /opt/fa4site/env.sh
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import flash_attn.cute; print('fa4 importable')" 2>&1 | tail -1
timeout -s KILL 150 python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider -rfE -k "fa4" tests/test_triton_kernel.py \
  tests/test_plans.py > $OUT/t-fa4.log 2>&1
echo "== fa4 tests (rc $?): $(grep -cE ' PASSED' $OUT/t-fa4.log) passed, $(grep -cE ' FAILED| ERROR' $OUT/t-fa4.log) failed"
grep -E "^(FAILED|ERROR) |^E  " $OUT/t-fa4.log | head -10
timeout -s KILL 330 python3 -m cpattn.bench kernel --workloads dense,paged,short --shapes d128,d192 \
  --seqs 16384,65536,131072 --cps 1,2,4,8 --pages 16,64,256 --no-interleave --backends triton,fa4 --iters 5 \
  --out $OUT/kernel-fa4-h200 > $OUT/kernel-fa4-h200.log 2>&1
echo "kernel rc $?"
grep -A80 "^| workload" $OUT/kernel-fa4-h200.log | head -90 || true
grep -q "^| workload" $OUT/kernel-fa4-h200.log || grep "TF/s" $OUT/kernel-fa4-h200.log | sed 's/^\[[^]]*\] //' | cut -c1-120
