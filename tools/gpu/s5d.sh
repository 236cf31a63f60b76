#!/usr/bin/env bash
# Session 5, call 4 (within 30 s of s5c.sh): FA4 install, then the kernel benchmark's dense 16k /
# 64k zigzag points and short sequences with triton, the persistent sm90 schedule and FA4 in one
# run (issue 14: is the persistent schedule the way to the FA4 ratios at 16k and 64 x 2048?).
set -uo pipefail
cd "$(dirname "$0")/../.."
bash .gpu/fa4-2/install.sh > /tmp/fa4-install.log 2>&1 || { echo "fa4 install failed"; tail -5 /tmp/fa4-install.log; exit 1; }
. /opt/fa4site/env.sh
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
timeout -s KILL 300 python3 -m cpattn.bench kernel --workloads dense,short --shapes d128,d192 \
  --seqs 16384,65536 --cps 1,2,4,8 --no-interleave --no-paged --backends triton,triton-persistent,fa4 --iters 5 \
  --out $OUT/kernel-persistent-fa4-h200 > $OUT/kernel-persistent-fa4-h200.log 2>&1
echo "kernel rc $?"
grep -A24 "^| workload" $OUT/kernel-persistent-fa4-h200.log | head -26
