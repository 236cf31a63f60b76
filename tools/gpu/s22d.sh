#!/usr/bin/env bash
# Prepared in the eighteenth session, after split_combine_pdl was adopted (0.3.15) with one change
# the s22a / s22b / s22c runs did not have: every combine program executes griddepcontrol.wait,
# also those of one-split rows that return at once (so the ordinary launch after the combine
# cannot overtake the split kernel's stores). (1) every GPU test on the tree (no FA4 staging: its
# tests skip), TEST_LIMIT s (default 330); (2) the tree's MLA decode B = 1, 8 over 4k / 32k keys
# q1 / q4 (graph replay) and one rank's shard step (ab_layers), once, for the record next to s22a's
# lines. No carry; about 7 minutes with a cold start.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s22d-lines.txt
every_gpu_test s22d src "${TEST_LIMIT:-330}"
AB_LIMIT=120 ab_graph "decode rep 1" src --workloads decode --decode-batches 1,8 --decode-lens 4096,32768 --decode-qlens 1,4
ab_layers "layers rep 1" src
cp "$L" "$OUT/"
