#!/usr/bin/env bash
# Fourteenth session: the absorbed-MLA kernel's warpgroup 0 carried a wait ptxas injects (C7517, in
# every prefill and decode build) between its Q K_j^T and the rescale of O for P_{j-1} V_{j-1}.
# Offline, on the PTX: a wgmma.wait_group 0 at warpgroup 0's entry (or the worker dispatch loop's
# header) removes it: ptxas assumes a GMMA may be in flight on the path from the other partitions'
# code through Triton's worker dispatch loop. mla_wait_first.patch waits (a no-op) before each
# consumer's key loop: no C7517 left in any MLA build, same registers and spills. (1) the GPU
# tests of the MLA paths on the patched copy (the Hopper file's and shard attention's MLA tests
# without the 128k case, the DSA tests); (2) A/B against the tree: MLA prefill (16k / 64k C = 1, 4, paged 64) and decode
# (B = 8, 64; L = 4k; q1, q4), two interleaved repeats; ab_ratios.py's verdict. No FA4.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s18h-lines.txt
make_variant /tmp/mw mla_wait_first
T=$OUT/gpu-tests-h200-mw.log; : > "$T"
PYTHONPATH=/tmp/mw/src:tools/gpu run_tests mw 160 "${MLA_TESTS[@]}" | tee -a "$L"
for rep in 1 2; do
  for tree in src /tmp/mw/src; do
    ab "mla rep $rep" $tree --workloads mla,decode --decode-batches 8,64 --decode-lens 4096
    cp $L $OUT/
  done
done
python3 tools/gpu/ab_ratios.py $L src /tmp/mw/src
