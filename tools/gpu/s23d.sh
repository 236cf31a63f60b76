#!/usr/bin/env bash
# Nineteenth session: the dense sm90 kernel's stage releases as per-thread arrivals
# (thread_release.patch). s23c's Nsight Compute showed the consumers stalled on barriers about one
# warp per issued instruction more than FA4's, with the same instructions; Triton puts a
# warpgroup bar.sync before every single-thread mbarrier.arrive (3 per key block). The patch has
# every consumer thread arrive (cp.async.mbarrier.arrive.noinc, count 256) on K- and V-free
# barriers in two allocations: 1 bar.sync per key block left (offline SASS). (1) the Hopper tests
# on the patched copy; (2) ab_dense_paged_short against the tree (dense d128 / d192 16k / 64k
# C = 1..8 two interleaved repeats, paged and short once) and ab_ratios.py's verdict. No carry.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s23d-lines.txt
patch_ab thr thread_release
