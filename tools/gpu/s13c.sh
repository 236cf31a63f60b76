#!/usr/bin/env bash
# Eleventh session, third call, within 30 s of s13b.sh: the tree with the
# patches named in PATCHES (space separated, from tools/gpu/patches/, chosen at call time from
# s13a / s13b: e.g. PATCHES="split_kv_release o_smem_epilogue"; empty: the tree as it is; "auto": tools/gpu/choose_patches.py decides). FA4
# install, all Hopper GPU tests on that source, then issue 14's whole kernel table with FA4 in one
# run (as s12d.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
if [ "${PATCHES:-}" = auto ]; then  # the rule of choose_patches.py over s13a / s13b's saved lines
  PATCHES=$(python3 tools/gpu/choose_patches.py /tmp/s13a-lines.txt /tmp/s13b-lines.txt)
fi
make_variant /tmp/variant ${PATCHES:-}
echo "source: tree + [${PATCHES:-}]"
. tools/gpu/_table14.sh
source_tests_table14 /tmp/variant/src s13c kernel14-fa4-h200-s13
