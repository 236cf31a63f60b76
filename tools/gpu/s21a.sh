#!/usr/bin/env bash
# Prepared in the sixteenth session: 0.3.13 took two MLA patches that were each measured alone
# against 0.3.12 (s20a, s20b), never together; s20d's single run of the tree had decode B = 64
# over 4k keys q1 at 414 TF/s against 440-486 in s20b's trees. A/B of the tree (0.3.13) against
# 0.3.12 (revert_to_0312_mla.patch), two interleaved repeats: decode B = 8, 64 over 4k / 32k keys
# q1 / q4 (graph replay) and MLA prefill (--workloads mla: 16k / 64k C = 1, 4 and 16k paged 64),
# ab_ratios.py's verdict (the tree is "new" here). No tests (the tree's ran in s20d), no FA4, no
# carry; about 4 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s21a-lines.txt
make_variant /tmp/r12 revert_to_0312_mla
for rep in 1 2; do
  for tree in /tmp/r12/src src; do
    AB_LIMIT=100 ab_graph "decode rep $rep" $tree --workloads decode --decode-batches 8,64 --decode-lens 4096,32768 \
      --decode-qlens 1,4
    ab "mla rep $rep" $tree --workloads mla
  done
done
cp $L $OUT/
python3 tools/gpu/ab_ratios.py $L /tmp/r12/src src
