#!/usr/bin/env bash
# Prepared in the fifteenth session, run in the sixteenth (kept: 0.3.13; a record now, its patch is
# in the tree). s19g measured decode's loop
# order (0.3.12) in every MLA mode: packed prefill 0.993-1.003, paged 64 prefill +3.4% in both
# repeats (550, 552 -> 570, 570). Paged loads wait on page-table reads before their TMAs, so the
# stage-first order may pay there only. mla_pv_first_paged.patch takes it for PAGE_SIZE > 0.
# (1) the Hopper file's MLA GPU tests on the patched copy; (2) A/B against the tree: MLA prefill
# C = 1 at 16k and 64k, packed and over pages of 16 / 64 / 256 keys (--mla-pages), two
# interleaved repeats, ab_ratios.py's verdict. No FA4, no carry; about 5 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s20a-lines.txt
variant_tests pfp 100 mla_pv_first_paged -- tests/test_triton_hopper_gpu.py -k mla
for rep in 1 2; do
  for tree in src /tmp/pfp/src; do
    ab "p16k rep $rep" $tree --workloads mla --mla-seqs 16384 --mla-cps 1 --mla-pages 16,64,256
    AB_LIMIT=150 ab "p64k rep $rep" $tree --workloads mla --mla-seqs 65536 --mla-cps 1 --mla-pages 16,64,256
  done
done
cp $L $OUT/
python3 tools/gpu/ab_ratios.py $L src /tmp/pfp/src
