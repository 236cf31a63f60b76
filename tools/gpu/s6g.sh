#!/usr/bin/env bash
# Session 6, call 8 (issues 13, 14): merge / combine warps along the columns (merge_warps), the
# wider merge_blocks rule, one-pass chunks: GPU tests, the combine sweep's rule lines, the
# decode profile, sharded MLA / GQA decode at 1M and the kernel bench's decode table.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-session6-warps.log
. tools/gpu/_tests.sh
run_tests merge 100 tests/test_merge_kernels.py
timeout -s KILL 60 python3 tools/gpu/decode_profile.py --cases mla:1:1:1m:1,mla:8:1:1m:1,mla:1:8:32k:1,gqa:8:1:1m:1 \
  > $OUT/decode-profile-s6g.log 2>&1; echo "profile rc $?"; grep -v -i warn $OUT/decode-profile-s6g.log | cut -c1-120
timeout -s KILL 150 python3 -m cpattn.bench decode --shapes mla,gqa --cps 1,8 --batches 1,8 --keys 1m --q-lens 1,4 \
  --iters 5 --no-crossover --out $OUT/decode-h200-s6 > /tmp/dec.log 2>&1
echo "decode rc $?"; grep "^| " /tmp/dec.log | cut -c1-170 | head -24
timeout -s KILL 100 python3 -m cpattn.bench kernel --workloads decode --decode-batches 8,64 --decode-lens 4096,32768 \
  --backends triton --iters 10 --out $OUT/kernel-decode-h200-s6 > /tmp/kdec.log 2>&1
echo "kernel rc $?"; grep "^  mla576" /tmp/kdec.log | cut -c1-150
