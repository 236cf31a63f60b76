#!/usr/bin/env bash
# Session 8, third call (issue 11): host µs per plan.run in interleaved rounds, as s9b, then pinned
# to one CPU, then pinned with the garbage collector off; the host CPU's frequency policy.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 PYTHONPATH=src:tools/gpu${PYTHONPATH:+:$PYTHONPATH}
(lscpu | grep -E "Model name|^CPU\(s\)|MHz"; cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor) 2>&1 | head -6
for opts in "" "--pin 3" "--pin 3 --no-gc"; do
  timeout -s KILL 80 python3 tools/gpu/host_rounds.py $opts > /tmp/r.log 2>&1
  echo "rounds [$opts] rc $?"; tail -6 /tmp/r.log | cut -c1-230; cat /tmp/r.log >> $OUT/host-rounds-h200-s8d.log
done
