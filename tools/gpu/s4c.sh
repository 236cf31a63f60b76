#!/usr/bin/env bash
# Session 4, FA4 call (after `bash .gpu/fa4-1/stage.sh` in the call before): the kernel benchmark
# with FA4 in the same run (issue 14 ratios), short sequences with persistent sm90 programs, then
# the decode benchmark (issue 13).
set -uo pipefail
cd "$(dirname "$0")/../.."
bash .gpu/fa4-2/install.sh > $OUT/fa4-install.log 2>&1 || { tail -5 $OUT/fa4-install.log; exit 1; }
. /opt/fa4site/env.sh
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
python3 -c "import flash_attn.cute as f; print('fa4', getattr(f, '__version__', '?'))"
timeout -s KILL 300 python3 -m cpattn.bench kernel --workloads dense,paged,short,mla,decode --shapes d128,d192 \
  --seqs 16384,65536 --cps 1,2,8 --pages 16,64,256 --mla-seqs 16384,65536 --decode-lens 4096,32768,131072 \
  --backends triton,fa4 --iters 5 --out $OUT/kernel-h200 > $OUT/kernel-h200.log 2>&1
echo "kernel rc $?"; grep -v "^\[" $OUT/kernel-h200.log | tail -75
timeout -s KILL 60 python3 -m cpattn.bench kernel --workloads short --backends triton,fa4 --sm90-options persistent=1 \
  --iters 5 --out $OUT/short-persistent 2>&1 | grep -v "^\[" | tail -8
timeout -s KILL 170 python3 -m cpattn.bench decode --iters 5 --out $OUT/decode-h200 > $OUT/decode-h200.log 2>&1
echo "decode rc $?"; grep -v "^\[" $OUT/decode-h200.log | tail -30
