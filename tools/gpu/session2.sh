#!/usr/bin/env bash
# GPU session 2: all GPU tests of this tree, host work of plan.run (profile), plan bench.
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
PYTHONPATH=src timeout 420 python3 -m pytest -q -m gpu tests/ 2>&1 | tee $OUT/gpu-tests.log | tail -25
PYTHONPATH=src timeout 150 python3 tools/gpu/profile_host.py 2>&1 | tee $OUT/profile.log | grep -v "^ *$" | head -90
PYTHONPATH=src timeout 150 python3 -m cpattn.bench plan --label new --backends triton --out $OUT/plan-new 2>&1 | tail -14
