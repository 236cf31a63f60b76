#!/usr/bin/env bash
# Thirteenth session, within 30 s of s17e.sh (carry [".gpu/fa4-2"]): the source s17e chose (the
# tree, or softmax_under_pv.patch on it), FA4 install, the Hopper GPU tests on it, then issue
# 14's whole table with FA4 in one run.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
choice=$(cat /tmp/s17-choice.txt 2>/dev/null || echo drop)
if [ "$choice" = keep ]; then make_variant /tmp/final softmax_under_pv; else make_variant /tmp/final; fi
echo "source: $choice"
. tools/gpu/_table14.sh
source_tests_table14 /tmp/final/src s17f kernel14-fa4-h200-s17
