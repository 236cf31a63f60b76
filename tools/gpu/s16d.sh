#!/usr/bin/env bash
# Twelfth session, within 30 s of s16c.sh (carry [".gpu/fa4-2"]): the source choose_s16.py picked
# (the tree, or named_pingpong + pingpong_auto with PINGPONG_HEAD_DIMS as chosen), FA4 install,
# the Hopper GPU tests on it, then issue 14's whole table with FA4 in one run.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
choice=$(cat /tmp/s16-choice.txt 2>/dev/null || echo "()")
if [ "$choice" = "()" ]; then
  make_variant /tmp/final
else
  make_variant /tmp/final named_pingpong pingpong_auto
  sed -i "s/^PINGPONG_HEAD_DIMS = .*/PINGPONG_HEAD_DIMS = $choice/" /tmp/final/src/cpattn/kernels/triton_backend.py
fi
echo "source: tree, PINGPONG_HEAD_DIMS $choice"; grep -n "^PINGPONG_HEAD_DIMS" /tmp/final/src/cpattn/kernels/triton_backend.py
. tools/gpu/_table14.sh
source_tests_table14 /tmp/final/src s16d kernel14-fa4-h200-s16
