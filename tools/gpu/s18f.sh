#!/usr/bin/env bash
# Fourteenth session: the named-barrier ring release (s16a: dense +1.0 to +1.6%, 16k C = 8 +7%, but
# persistent short batches -1.8%, 1024 x 128 -7.5%: dropped at 1.007) only where one program runs
# one work item (named_ring_per_item.patch: the NAMED constexpr; persistent programs keep the
# mbarriers, so the short batches run the tree's code). (1) the Hopper tests on the patched copy;
# (2) ab_dense_paged_short against the tree (dense two repeats, paged and short once) and
# ab_ratios.py's verdict into /tmp/s18-nrp.txt for s18g.sh; (3) FA4 stage 1 (carry .gpu/fa4-1).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s18f-lines.txt
patch_ab_call nrp named_ring_per_item /tmp/s18-nrp.txt
