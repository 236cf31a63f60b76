#!/usr/bin/env bash
# Fifteenth session, on the tree with mla_wait_first.patch applied (0.3.11): (1) the one MLA GPU test
# s18h's re-run left unfinished at its 160 s limit (48 of 49 passed on the patched copy, none
# failed); (2) s18a.sh (the clock records of softmax_under_pv.patch against the tree, about 4
# minutes); (3) FA4 stage 1 (carry .gpu/fa4-1) for s19b.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s19a-lines.txt
T=$OUT/gpu-tests-h200-s19a.log; : > "$T"
PYTHONPATH=src:tools/gpu run_tests mla-pair3 200 \
  "tests/test_shard_attention.py::test_gpu_mla_pair_mode_merges_two_splits_in_the_kernel[3]" | tee -a "$L"
cp $L $OUT/
bash tools/gpu/s18a.sh
bash .gpu/fa4-1/stage.sh
