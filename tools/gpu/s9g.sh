#!/usr/bin/env bash
# Session 8, seventh call (issue 11), final code, same machine instance as s9e / s9f: host µs per
# plan.run (profile_host.py, with the one-call + sync ratio at 16k C = 8) and in rounds.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
timeout -s KILL 150 python3 tools/gpu/profile_host.py > $OUT/host-h200-s8g.log 2>&1
echo "host rc $?"; sed -n "/^kernel bench/,\$p" $OUT/host-h200-s8g.log | grep -v -i warn | cut -c1-220
timeout -s KILL 80 python3 tools/gpu/host_rounds.py > $OUT/host-rounds-h200-s8g.log 2>&1
echo "rounds rc $?"; tail -6 $OUT/host-rounds-h200-s8g.log | cut -c1-230
