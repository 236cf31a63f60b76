#!/usr/bin/env bash
# Twentieth session, before issue 14 is closed: every GPU test of the suite (pytest -m gpu, 8
# workers; 175 passed on 0.3.15 in s22d) on the closing tree, no FA4 staging (its tests skip),
# TEST_LIMIT s (default 330); log $OUT/gpu-tests-h200-s24c.log with the 10 slowest tests. No carry.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s24c-lines.txt
every_gpu_test s24c src "${TEST_LIMIT:-330}"
