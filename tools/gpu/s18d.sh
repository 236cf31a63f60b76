#!/usr/bin/env bash
# Fourteenth session: the L2 budget of the launch order. FA4's varlen scheduler (flash_attn/cute
# tile_scheduler.py, VarlenDecoder) runs one batch at a time and, inside it, sections of 16/8/4/2/1
# query heads whose K/V fits 50 MB: at d128 16k C = 1 that is 4 query heads = one KV head (8 MiB),
# where its TF/s peaks (690 vs 621 at C = 2, whose 4k-row segments get 16-head sections); triton
# plans two thirds of the 60 MiB torch reports (40 MiB: 5 KV heads per section at d128 16k). A/B of
# the tree (2/3) against a third (l2_budget_3th.patch: 2 KV heads at d128 / d192 16k) and an eighth
# (l2_budget_8th.patch: one KV head; smaller sequence groups): dense d128 / d192 16k / 64k C = 1, 2,
# 4, 8 at the defaults, two interleaved repeats; short batches once. Host planning only: same
# kernels (the GPU tests ran in s18b). Rule fixed before the runs: ab_ratios.py --host-only; of
# the budgets that pass, the one with the highest all-points geomean goes to s18e.sh's table
# (/tmp/s18-budget.txt). Then FA4 stage 1 (carry .gpu/fa4-1).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s18d-lines.txt
make_variant /tmp/b3 l2_budget_3th
make_variant /tmp/b8 l2_budget_8th
for rep in 1 2; do
  for tree in src /tmp/b3/src /tmp/b8/src; do
    ab "dense rep $rep" $tree --workloads dense --shapes d128,d192 --seqs 16384,65536 --cps 1,2,4,8 --no-interleave
  done
done
for tree in src /tmp/b3/src /tmp/b8/src; do
  ab "short rep 1" $tree --workloads short --short 1024x128,128x1024,64x2048,32x4096,16x8192,8x16384
done
cp $L $OUT/
best=tree; best_g=0
for b in 3 8; do
  python3 tools/gpu/ab_ratios.py $L src /tmp/b$b/src --host-only | tee /tmp/s18d-r$b.txt
  g=$(sed -n 's/.*all points geomean \([0-9.]*\); verdict: keep/\1/p' /tmp/s18d-r$b.txt)
  if [ -n "$g" ] && python3 -c "import sys; sys.exit(0 if $g > $best_g else 1)"; then best=$b; best_g=$g; fi
done
echo $best > /tmp/s18-budget.txt
echo "budget: $best"
bash .gpu/fa4-1/stage.sh
