#!/usr/bin/env bash
# Prepared in the sixteenth session: 0.3.13 took two MLA patches that were each measured alone
# against 0.3.12 (s20a, s20b), never together; s20d's single run of the tree had decode B = 64
# over 4k keys q1 at 414 TF/s against 440-486 in s20b's trees. A/B of the tree (0.3.13) against
# 0.3.12 (revert_to_0312_mla.patch), two interleaved repeats: decode B = 8, 64 over 4k / 32k keys
# q1 / q4 (graph replay) and MLA prefill (--workloads mla: 16k / 64k C = 1, 4 and 16k paged 64),
# ab_ratios.py's ratios (the tree is "new" here; with no test line its verdict reads "drop": the
# question is only whether a point falls below 0.96). No tests (the tree's ran in s20d), no FA4, no
# carry; about 4 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_variant.sh
ab_session /tmp/s21a-lines.txt
make_variant /tmp/r12 revert_to_0312_mla
ab_mla /tmp/r12/src src
