#!/usr/bin/env bash
# Thirteenth session: softmax_j's EX2s under P_{j-1} V_{j-1} (overlap=2), for real this time.
# ptxas hoists the wait for P_{j-1} V_{j-1} to the top of its basic block, i.e. right after the
# wait for S_j, so the loop ran each block's softmax after its own P V (offline SASS, 0.3.9: the
# 66 EX2s after WARPGROUP.DEPBAR.LE gsb0, 0x0). tools/gpu/patches/softmax_under_pv.patch ends the
# basic block after the row sum (a never-taken sleeping loop on l_i == -1), which keeps the wait
# after every EX2 in all overlap=2 builds (D128 ping-pong, D192, persistent, paged; no spills
# added). (1) All Hopper GPU tests on the patched copy; (2) A/B at the defaults: dense d128 /
# d192 16k / 64k C = 1, 2, 4, 8, two interleaved repeats; paged 16 / 64 and short batches once;
# (3) ab_ratios.py's verdict into /tmp/s17-choice.txt for s17f.sh; (4) FA4 stage 1.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s17e-lines.txt
variant_hopper_tests spv softmax_under_pv
ab_dense_paged_short /tmp/spv/src | tee /tmp/s17e-ratios.txt
grep -q "verdict: keep" /tmp/s17e-ratios.txt && echo keep > /tmp/s17-choice.txt || echo drop > /tmp/s17-choice.txt
echo "choice: $(cat /tmp/s17-choice.txt)"
bash .gpu/fa4-1/stage.sh
