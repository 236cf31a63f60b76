#!/usr/bin/env bash
# GPU session 1 (issue 11): GPU tests of the plan refactor, then host cost and kernel speed of the
# previous release (.old/, commit ad479f8) and of this tree, on the same machine.
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
PYTHONPATH=src timeout 300 python3 -m pytest -q -m gpu -x tests/test_plans.py tests/test_triton_kernel.py 2>&1 | tee $OUT/gpu-tests.log | tail -25
PYTHONPATH=.old/src timeout 120 python3 src/cpattn/bench/plan.py --label old --backends triton --out $OUT/plan-old 2>&1 | tail -12
PYTHONPATH=src timeout 120 python3 -m cpattn.bench plan --label new --backends triton --out $OUT/plan-new 2>&1 | tail -14
PYTHONPATH=.old/src timeout 200 python3 -m cpattn.bench kernel --shapes d128 --backends triton --no-interleave --out $OUT/kernel-old > $OUT/kernel-old.txt 2>&1; tail -16 $OUT/kernel-old.txt
PYTHONPATH=src timeout 200 python3 -m cpattn.bench kernel --shapes d128 --backends triton --no-interleave --out $OUT/kernel-new > $OUT/kernel-new.txt 2>&1; tail -16 $OUT/kernel-new.txt
