#!/usr/bin/env bash
# Twelfth session, first call after the profile (s15a/s15b): the K/V ring's "slot free" signals as
# named hardware barriers (tools/gpu/patches/named_barrier_release.patch: consumers bar.arrive,
# the loader bar.sync) instead of mbarrier arrives, each of which Triton 3.6 precedes with a
# warpgroup bar.sync (and the next mbarrier wait with another): 3 -> 1 bar.sync per key block
# on the consumers' path (offline SASS). (1) All Hopper GPU tests on a patched copy of src (a
# deadlock shows as the limit); (2) A/B tree vs patched at the defaults: dense d128 / d192 16k /
# 64k C = 1, 2, 4, 8, two interleaved repeats; short batches and paged 16 / 64 once; (3) the
# ratios per group (tools/gpu/ab_ratios.py); (4) FA4 stage 1 for s16b.sh (the next call).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s16a-lines.txt
patch_ab nb named_barrier_release
bash .gpu/fa4-1/stage.sh
