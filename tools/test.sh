#!/usr/bin/env bash
# Runs every test: installs/builds what is missing (tools/setup.sh), then the
# C++ tests (ctest), the Python tests (pytest, sim device, ordering checker
# on), and the GPU proof script's CPU dry run. The dry run (one process at a
# time, mostly one core) runs beside ctest and pytest; its output follows theirs.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash tools/setup.sh
export PATH="$ROOT/.venv/bin:$PATH"
BUILD_DIR=${LS_BUILD_DIR:-build}
dry_pid=""
kill_tree() {  # PID: the process and everything it started (read from /proc: no procps needed)
  local f s child
  for f in /proc/[0-9]*/stat; do
    s=$(cat "$f" 2>/dev/null) || continue
    set -- "$1" ${s##*) }  # after the command name: state, parent, ...
    [ "${3:-}" = "$1" ] && child=${f#/proc/} && kill_tree "${child%/stat}"
  done
  kill "$1" 2>/dev/null || true
}
stop_dry() { [ -z "$dry_pid" ] || kill_tree "$dry_pid"; dry_pid=""; }
trap stop_dry EXIT
trap 'stop_dry; exit 130' INT TERM
if [ -f bench/gpu/run.sh ]; then
  bash bench/gpu/run.sh --dry-run "$BUILD_DIR/gpu-dry-run" >"$BUILD_DIR/gpu-dry-run.log" 2>&1 &
  dry_pid=$!
fi

echo "== C++ tests (ctest) =="
ct_rc=0
ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2 || ct_rc=$?

py_rc=0
if [ -d tests/python ] && ls tests/python/test_*.py >/dev/null 2>&1; then
  echo "== Python tests (pytest) =="
  # Two workers (pytest-xdist), each test file on one of them in order; LS_TEST_WORKERS=0: one process.
  PYTHONPATH="$ROOT/python" python -m pytest -q -n "${LS_TEST_WORKERS:-2}" --dist loadfile tests/python || py_rc=$?
fi
dry_rc=0
if [ -n "$dry_pid" ]; then
  wait "$dry_pid" || dry_rc=$?
  dry_pid=""
  echo "== GPU proof script, CPU dry run (ran beside ctest and pytest; $BUILD_DIR/gpu-dry-run.log) =="
  cat "$BUILD_DIR/gpu-dry-run.log"
fi
[ "$ct_rc" = 0 ] || echo "ctest failed (exit $ct_rc)" >&2
[ "$py_rc" = 0 ] || echo "pytest failed (exit $py_rc)" >&2
[ "$dry_rc" = 0 ] || echo "the GPU proof script's dry run failed (exit $dry_rc)" >&2
[ "$ct_rc" = 0 ] && [ "$py_rc" = 0 ] && [ "$dry_rc" = 0 ]
