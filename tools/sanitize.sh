#!/usr/bin/env bash
# Builds this working tree with AddressSanitizer + UBSan (CMake's LS_SANITIZE; no CUDA
# code: nvcc takes no -fsanitize) and runs the C++ tests and the Python tests under
# them, the sanitizers' runtimes loaded into Python with LD_PRELOAD; and the core
# (scheduler, sim device, thread pools, readers; no LibTorch, whose own code is not
# instrumented) with ThreadSanitizer, its C++ tests. Not part of CI (a
# build of its own: 9.7 minutes with every test from an empty build-sanitize/ on a
# 2-core AMD EPYC VM, 2026-12-05); run it after changing C++ code: a read of freed
# memory that still holds the right bytes passes every ordinary test (2026-12-05:
# C++ offload() read a weight through a pointer into a dict it had already freed).
#
#   bash tools/sanitize.sh [PYTEST ARGS...]     (default: every test in tests/python)
#
# Leaves .venv and build/ alone: everything lives in build-sanitize/ (ignored):
#   src/        a copy of the working tree (the Python extension is written into its
#               python/ folder, so build/'s stays; bench/gpu/build_lib.sh's
#               gpu_sync_tree: later runs rebuild only what changed), src/.venv -> .venv
#   src/build/  the build (-O1 with line tables, for readable reports);
#   src/build-tsan/ the core's
# Leaks are checked in the C++ tests, not under Python (the interpreter's own). The
# install_consumer test is left out: it links a program of its own against the
# installed library without the sanitizers' runtimes. A report stops the process
# (halt_on_error, exit status 1), so its test fails; the report is on stderr. The
# Python tests stop after LS_SANITIZE_TIMEOUT seconds (default 3600). Exit status:
# non-zero when anything failed. Needs .venv (tools/setup.sh makes it).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
. bench/gpu/build_lib.sh  # gpu_sync_tree
[ -x .venv/bin/python ] || { echo "sanitize.sh: no .venv: run tools/setup.sh first" >&2; exit 2; }
DIR="$ROOT/build-sanitize"
gpu_sync_tree "$DIR/src"
ln -sfn "$ROOT/.venv" "$DIR/src/.venv"
cd "$DIR/src"
export PATH="$ROOT/.venv/bin:$PATH"
build() {  # DIR CMAKE_ARGS...: configured once (no CUDA, -O1 with line tables), then built
  local dir=$1; shift
  if [ ! -f "$dir/build.ninja" ]; then
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
      -DLS_WITH_CUDA=OFF "$@" >"$dir.configure.log" 2>&1 || { cat "$dir.configure.log"; exit 1; }
  fi
  cmake --build "$dir" -j "${LS_JOBS:-$(nproc)}"
}
build build -DLS_SANITIZE=ON -DPython3_EXECUTABLE="$ROOT/.venv/bin/python" \
  -DCMAKE_PREFIX_PATH="$(python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
echo "== C++ tests under ASan + UBSan =="
ct_rc=0
ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 ctest --test-dir build --output-on-failure -j 2 -E '^install_consumer$' ||
  ct_rc=$?
echo "== C++ tests of the core (no LibTorch) under ThreadSanitizer =="
build build-tsan -DLS_WITH_TORCH=OFF -DCMAKE_CXX_FLAGS=-fsanitize=thread \
  -DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread
ts_rc=0
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 ctest --test-dir build-tsan --output-on-failure -j 2 || ts_rc=$?
echo "== Python tests under ASan + UBSan =="
# test_gpu_proof_script.py is left out: it checks the GPU scripts against the CUDA
# tests of a build with CUDA, which this one has not.
[ $# -gt 0 ] || set -- -n "${LS_TEST_WORKERS:-2}" --dist loadfile tests/python \
  --ignore=tests/python/test_gpu_proof_script.py
py_rc=0
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
  ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 PYTHONPATH="$PWD/python" \
  timeout "${LS_SANITIZE_TIMEOUT:-3600}" python -m pytest -q -p no:cacheprovider "$@" || py_rc=$?
[ "$ct_rc" = 0 ] || echo "C++ tests failed under the sanitizers (exit $ct_rc)" >&2
[ "$ts_rc" = 0 ] || echo "C++ tests of the core failed under ThreadSanitizer (exit $ts_rc)" >&2
[ "$py_rc" = 0 ] || echo "Python tests failed under the sanitizers (exit $py_rc)" >&2
[ "$ct_rc" = 0 ] && [ "$ts_rc" = 0 ] && [ "$py_rc" = 0 ]
