#!/usr/bin/env bash
# Fifteenth session: s19e's Nsight Compute profile showed the MLA decode kernel's warps waiting
# (long scoreboard 12.3 per issue against prefill's 8.8; tensor pipe 44% active against 63%) with
# its latent read from DRAM once (1.77 TB/s): with two stages, block j + 2's load starts only when
# the other warpgroup has added P_j V_j, late in its next iteration. mla_decode_pv_first.patch gives
# decode the sparse mode's order (the other warpgroup's P_{j-1} V_{j-1} before waiting for block
# j), which frees a stage one Q K^T earlier. (1) the MLA / DSA GPU tests on the patched copy
# (without the 128k case); (2) A/B against the tree: MLA decode B = 8, 64 over 4k / 32k keys,
# q1 / q4, graph-replay TF/s, two interleaved repeats; MLA prefill is the same code (DECODE = 0).
# (Rewritten onto _variant.sh's variant_tests / ab_graph after the run, same commands; the run's
# own loop printed the workload names without their 'mla576 ' prefix, as in s19f-lines.txt.)
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s19f-lines.txt
variant_tests pvf 230 mla_decode_pv_first -- "${MLA_TESTS[@]}"
for rep in 1 2; do
  for tree in src /tmp/pvf/src; do
    AB_LIMIT=100 ab_graph "decode rep $rep" $tree --workloads decode --decode-batches 8,64 --decode-lens 4096,32768 \
      --decode-qlens 1,4
  done
done
cp $L $OUT/
python3 tools/gpu/ab_ratios.py $L src /tmp/pvf/src
