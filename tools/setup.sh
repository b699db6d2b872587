#!/usr/bin/env bash
# Installs what is missing (apt packages, the .venv with pinned Python packages)
# and builds layerstream into build/. Idempotent: re-running only does what is
# needed. Used by tools/test.sh and tools/demo.sh; safe to run by hand.
#
# Environment: LS_WERROR=1 builds with -Werror (CI does), LS_DEBUG_INFO=0 builds
# without -g (CI does), LS_UNITY_BUILD=1 compiles core and the LibTorch glue as
# unity sources (CI does: a build from scratch takes less time, a rebuild after
# an edit more), LS_CUDA_ARCHS="80;90"
# (GPU architectures, default 75 80 86 89 90 100 120), LS_WITH_TORCH=OFF
# skips the LibTorch parts (fast core-only build), LS_BUILD_DIR
# (default build), LS_JOBS (default: nproc), LS_TARGETS (build only these
# CMake targets, e.g. "_C test_quant"; default: everything).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUILD_DIR=${LS_BUILD_DIR:-build}
JOBS=${LS_JOBS:-$(nproc)}
log() { echo "[setup] $*"; }

# 1. apt packages (C++ test/bench libraries and compilers).
need_apt=()
for pkg in g++ libgtest-dev libgmock-dev libbenchmark-dev python3-dev valgrind; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "[setup] missing apt packages: ${need_apt[*]} (run as root, or install them)" >&2
    exit 1
  fi
  log "apt-get install ${need_apt[*]}"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_apt[@]}" >/dev/null
fi

# 2. The virtual environment with pinned packages (taken from wheels on disk).
PY=${LS_PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  log "pip install -r requirements.txt (pinned; from local wheels)"
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt
  echo "$want" > "$stamp"
fi
VPY="$ROOT/.venv/bin/python"
export PATH="$ROOT/.venv/bin:$PATH"

# 3. Configure and build.
TORCH_PREFIX=$("$VPY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
# The CUDA settings a CUDA build of torch needs (toolkit, the wheel's libnvrtc,
# architectures) are found by CMake itself: cmake/layerstream_torch.cmake.
cuda_args=()
[ -n "${LS_CUDA_ARCHS:-}" ] && cuda_args+=(-DLS_CUDA_ARCHS="$LS_CUDA_ARCHS")
# LS_DEBUG_INFO=0: the same -O2 code without debug info (CI: about a third less
# compile time; nothing it runs reads the debug info).
[ "${LS_DEBUG_INFO:-1}" = "0" ] && cuda_args+=(-DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -DNDEBUG"
                                               -DCMAKE_CUDA_FLAGS_RELWITHDEBINFO="-O2 -DNDEBUG")
werror=OFF
[ "${LS_WERROR:-0}" = "1" ] && werror=ON
unity=OFF
[ "${LS_UNITY_BUILD:-0}" = "1" ] && unity=ON
config="LS_WERROR=$werror LS_UNITY_BUILD=$unity"
if [ ! -f "$BUILD_DIR/build.ninja" ] || [ "$(cat "$BUILD_DIR/.ls_config" 2>/dev/null)" != "$config" ]; then
  log "configuring $BUILD_DIR ($config)"
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DPython3_EXECUTABLE="$VPY" \
    -DLS_WERROR=$werror -DLS_UNITY_BUILD=$unity -DLS_WITH_TORCH=${LS_WITH_TORCH:-ON} "${cuda_args[@]}" >"$BUILD_DIR.configure.log" 2>&1 || { cat "$BUILD_DIR.configure.log"; exit 1; }
  echo "$config" > "$BUILD_DIR/.ls_config"
fi
targets=()
[ -n "${LS_TARGETS:-}" ] && targets=(--target ${LS_TARGETS})
log "building ($JOBS jobs${LS_TARGETS:+; targets: $LS_TARGETS})"
cmake --build "$BUILD_DIR" -j "$JOBS" "${targets[@]}"
