#!/usr/bin/env bash
# Fourteenth session, within 30 s of s18f.sh (carry [".gpu/fa4-2"]), only if s18f kept the patch:
# the tree with named_ring_per_item.patch, FA4 install, issue 14's whole table with FA4 in one run.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
choice=$(cat /tmp/s18-nrp.txt 2>/dev/null || echo drop)
if [ "$choice" = keep ]; then make_variant /tmp/final named_ring_per_item; else make_variant /tmp/final; fi
echo "source: $choice"
. tools/gpu/_table14.sh
. tools/gpu/_fa4.sh
export PYTHONPATH=/tmp/final/src:$PYTHONPATH
issue14_table kernel14-fa4-h200-s18g 360
