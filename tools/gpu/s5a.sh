#!/usr/bin/env bash
# Session 5, call 1 (FA4 staging part 1 first, then tuning aids that need no FA4): where
# index_topk's time goes and which chunking options shorten it (issue 12); the split target of
# the absorbed-MLA decode family for decode-shaped dense plans, eager and graph replay (issue 14);
# host work per plan.run with cProfile (issue 11).
set -uo pipefail
cd "$(dirname "$0")/../.."
bash .gpu/fa4-1/stage.sh > $OUT/fa4-stage1.log 2>&1; echo "fa4 stage 1 rc $?"; tail -2 $OUT/fa4-stage1.log
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
echo "== index_topk sweep"
timeout -s KILL 170 python3 tools/gpu/index_topk_sweep.py > $OUT/topk-sweep.log 2>&1; echo "rc $?"
cat $OUT/topk-sweep.log | grep -v Warning | tail -40
echo "== MLA decode split target"
for pps in 1 2 4; do
  timeout -s KILL 70 python3 -m cpattn.bench kernel --workloads decode --decode-batches 1,8,64 \
    --decode-lens 4096,32768 --backends triton --iters 10 --decode-options programs_per_sm=$pps \
    --out /tmp/dec-pps$pps > $OUT/dec-pps$pps.log 2>&1
  echo "programs_per_sm=$pps rc $?"; grep "TF/s" $OUT/dec-pps$pps.log | grep "^\[" | sed 's/^\[[^]]*\] //' | cut -c1-170
done
echo "== host work"
timeout -s KILL 120 python3 tools/gpu/profile_host.py > $OUT/host.log 2>&1; echo "rc $?"
grep -A12 "^summary\|^kernel bench\|^kernel duration\|^graph replay" $OUT/host.log
