#!/usr/bin/env bash
# Runs every test: installs/builds what is missing (tools/setup.sh), then the
# C++ tests (ctest), the Python tests (pytest, sim device, ordering checker
# on), and the GPU proof script's CPU dry run.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash tools/setup.sh
export PATH="$ROOT/.venv/bin:$PATH"
BUILD_DIR=${LS_BUILD_DIR:-build}
echo "== C++ tests (ctest) =="
ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2
if [ -d tests/python ] && ls tests/python/test_*.py >/dev/null 2>&1; then
  echo "== Python tests (pytest) =="
  # Two workers (pytest-xdist), each test file on one of them in order; LS_TEST_WORKERS=0: one process.
  PYTHONPATH="$ROOT/python" python -m pytest -q -n "${LS_TEST_WORKERS:-2}" --dist loadfile tests/python
fi
if [ -f bench/gpu/run.sh ]; then
  echo "== GPU proof script, CPU dry run =="
  bash bench/gpu/run.sh --dry-run "$BUILD_DIR/gpu-dry-run"
fi
