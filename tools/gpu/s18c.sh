#!/usr/bin/env bash
# Fourteenth session, within 30 s of s18b.sh (carry [".gpu/fa4-2"]): the source s18b chose (the tree
# with L2 sequence groups, or no_seq_groups.patch on it), FA4 install, then issue 14's whole table
# with FA4 in one run (s18b ran the GPU tests on the tree).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
choice=$(cat /tmp/s18-choice.txt 2>/dev/null || echo drop)
if [ "$choice" = keep ]; then make_variant /tmp/final; else make_variant /tmp/final no_seq_groups; fi
echo "source: $choice"
. tools/gpu/_table14.sh
. tools/gpu/_fa4.sh
export PYTHONPATH=/tmp/final/src:$PYTHONPATH
issue14_table kernel14-fa4-h200-s18 360
