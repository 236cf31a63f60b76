# Sourced by the GPU session scripts: run_tests NAME LIMIT PYTEST-ARGS... runs one group of GPU
# tests (pytest-xdist, 8 workers) under a hard time limit, appends its log to $T and prints one
# summary line plus the first failures.
run_tests() {
  local name=$1 limit=$2; shift 2
  echo "=== $name" >> "$T"
  timeout -s KILL "$limit" python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider -rfE "$@" > /tmp/t-$name.log 2>&1
  local rc=$?
  cat /tmp/t-$name.log >> "$T"
  echo "== $name (rc $rc): $(grep -cE ' PASSED' /tmp/t-$name.log) passed, $(grep -cE ' FAILED| ERROR' /tmp/t-$name.log) failed"
  grep -E "^(FAILED|ERROR) |^E  " /tmp/t-$name.log | head -8
}
