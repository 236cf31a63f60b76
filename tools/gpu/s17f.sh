#!/usr/bin/env bash
# Thirteenth session, within 30 s of s17e.sh (carry [".gpu/fa4-2"]): the source s17e chose (the
# tree, or softmax_under_pv.patch on it: s17e ran the Hopper tests on that copy, s16d on the
# tree), FA4 install, then issue 14's whole table with FA4 in one run.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
choice=$(cat /tmp/s17-choice.txt 2>/dev/null || echo drop)
if [ "$choice" = keep ]; then make_variant /tmp/final softmax_under_pv; else make_variant /tmp/final; fi
echo "source: $choice"
. tools/gpu/_table14.sh
. tools/gpu/_fa4.sh
export PYTHONPATH=/tmp/final/src:$PYTHONPATH
issue14_table kernel14-fa4-h200-s17 360
