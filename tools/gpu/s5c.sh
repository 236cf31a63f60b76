#!/usr/bin/env bash
# Session 5, call 3 (FA4 staging part 1 first): GPU tests of this session's changes (radix-select
# index top-k and folded index scale, MLA split target 1 per SM, decode options), then the
# official numbers: sparse bench (issue 12), kernel bench decode table (issue 14), MLA sharded
# decode at 128k / 1M (issue 13: no regression from the split-target change), index top-k sweep.
set -uo pipefail
cd "$(dirname "$0")/../.."
bash .gpu/fa4-1/stage.sh > /tmp/fa4-stage1.log 2>&1; echo "fa4 stage 1 rc $?"
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
T=$OUT/gpu-tests-h200-session5.log
. tools/gpu/_tests.sh
run_tests dsa 150 tests/test_dsa_gpu.py
run_tests shard 120 tests/test_shard_attention.py tests/test_merge_kernels.py tests/test_plans.py
echo "== index_topk sweep"
timeout -s KILL 150 python3 tools/gpu/index_topk_sweep.py > $OUT/topk-sweep.log 2>&1; echo "rc $?"
grep -E "^S=|ms  " $OUT/topk-sweep.log | cut -c1-150
echo "== sparse bench"
timeout -s KILL 150 python3 -m cpattn.bench sparse --iters 5 --warmup 2 --out $OUT/sparse-h200-s5 > /tmp/sparse.log 2>&1
echo "rc $?"; grep -E "^S=|^workload" /tmp/sparse.log | cut -c1-140
echo "== kernel bench decode (MLA split target 1 per SM)"
timeout -s KILL 120 python3 -m cpattn.bench kernel --workloads decode --decode-batches 1,8,64 \
  --decode-lens 4096,32768,131072 --backends triton --iters 10 --out $OUT/kernel-decode-h200-s5 > /tmp/kdec.log 2>&1
echo "rc $?"; grep "^  mla576" /tmp/kdec.log | sed 's/(target at B >= 8: >= 2500 GB\/s or >= 400 TF\/s)//' | cut -c1-140
echo "== sharded MLA decode 128k / 1M"
timeout -s KILL 150 python3 -m cpattn.bench decode --shapes mla --cps 1,8 --batches 1,8,64 --keys 128k,1m \
  --q-lens 1,4 --iters 5 --no-crossover --out $OUT/decode-mla-h200-s5 > /tmp/dec.log 2>&1
echo "rc $?"; grep "^| mla" /tmp/dec.log | cut -c1-160 | head -30
