#!/usr/bin/env bash
# Prepared in the sixteenth session: FA4 stage 1 (carry .gpu/fa4-1) first, then every GPU test of
# the suite (pytest -m gpu, 8 workers; 175 passed in 239 s on 0.3.11, s19c) on the tree + the
# patches given as arguments, one hard limit of TEST_LIMIT s (default 420); log
# $OUT/gpu-tests-h200-session21.log, the 25 slowest tests at its end. The table call follows at
# once (within 30 s): STEM=kernel14-fa4-h200-sNNx bash tools/gpu/s20c.sh [the same patches] (carry
# .gpu/fa4-2). Run in the seventeenth session with TEST_LIMIT=240 (a refused start had left 851 s
# of device time for this call and the table's).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s21c-lines.txt
bash .gpu/fa4-1/stage.sh
make_variant /tmp/all "$@"
echo "source: tree${*:+ + $*}"
every_gpu_test session21 /tmp/all/src "${TEST_LIMIT:-420}" 25
