#!/usr/bin/env bash
# Ninth session, fourth call (within 30 s of s12c.sh): FA4 install, then issue 14's whole kernel
# table with FA4 in one run under the overlap="auto" default, sustained timing, short batches
# 1024x128 / 128x1024 / 64x2048 / 32x4096.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/_fa4.sh
. tools/gpu/_table14.sh
issue14_table kernel14-fa4-h200-s12 500
