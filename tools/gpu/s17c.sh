#!/usr/bin/env bash
# Thirteenth session, first of two FA4 calls (carry [".gpu/fa4-1"]): FA4 stage 1 only; s17d.sh
# follows within 30 s.
set -uo pipefail
cd "$(dirname "$0")/../.."
bash .gpu/fa4-1/stage.sh
