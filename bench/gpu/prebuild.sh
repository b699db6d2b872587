#!/usr/bin/env bash
# Makes here, ahead of a device call, the build bench/gpu/run.sh would make on the GPU
# machine (bench/gpu/build_lib.sh, gpu_build), for that machine's Python and torch
# (LS_GPU_* there), and packs it into .prebuilt/ (ignored; carry it). A call whose
# checkout and python match its stamp uses it instead of building: about 100 s of the
# 15 minutes of device time (run 5's build: 104 s).
#
#   bash bench/gpu/prebuild.sh --python PATH
#
# PATH: a Python LS_GPU_PYTHON interpreter with its headers (any patch release; the
# module's ABI is the minor version's). Everything else lives in build-prebuilt/ (ignored):
#   venv/  torch==LS_GPU_TORCH (pip --no-deps) and its pure-Python dependencies at the
#          versions .venv has; the CUDA libraries torch loads come from .venv (a link
#          to its nvidia/ folder), so nothing large downloads twice;
#   src/   a copy of the working tree (as a device call sends it; gpu_sync_tree, so the
#          build there stays incremental), where gpu_build runs.
# .prebuilt/ then holds the outputs at their paths in the checkout (gpu_build_outputs)
# and the stamp. Checked here: the module imports with that torch, the C++ test
# binaries start. A change to a C++ source (or to build_lib.sh) afterwards changes the
# stamp: the call builds as before (run.sh says why), so a stale .prebuilt/ costs time,
# never results.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
. bench/gpu/build_lib.sh
BASE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --python) [ $# -ge 2 ] || { echo "prebuild.sh: --python needs a path" >&2; exit 2; }; BASE=$2; shift ;;
    *) echo "prebuild.sh: unknown argument $1 (--python PATH)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$BASE" ] || { echo "prebuild.sh: give --python PATH, a Python $LS_GPU_PYTHON (the GPU machine's)" >&2; exit 2; }
have=$("$BASE" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")') \
  || { echo "prebuild.sh: $BASE does not run" >&2; exit 2; }
[ "$have" = "$LS_GPU_PYTHON" ] || { echo "prebuild.sh: $BASE is Python $have; the GPU machine runs $LS_GPU_PYTHON" >&2; exit 2; }
[ -x .venv/bin/python ] || { echo "prebuild.sh: no .venv: run tools/setup.sh first" >&2; exit 2; }
DIR="$ROOT/build-prebuilt"
VPY="$DIR/venv/bin/python"
[ -x "$VPY" ] || "$BASE" -m venv "$DIR/venv"
if [ "$("$VPY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)" != "$LS_GPU_TORCH" ]; then
  # torch's own pure-Python dependencies (and pybind11, which the build uses) at .venv's versions.
  deps=$(.venv/bin/python - <<'EOF'
import importlib.metadata as m
print(" ".join(f"{p}=={m.version(p)}" for p in
               ("typing_extensions", "sympy", "mpmath", "networkx", "jinja2", "MarkupSafe", "fsspec",
                "filelock", "numpy", "pybind11", "setuptools")))
EOF
)
  echo "[prebuild] pip install torch==$LS_GPU_TORCH (--no-deps) $deps"
  "$DIR/venv/bin/pip" install -q --disable-pip-version-check --no-deps "torch==$LS_GPU_TORCH" $deps
fi
SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
VSITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -e "$VSITE/nvidia" ] || ln -s "$SITE/nvidia" "$VSITE/nvidia"
export PATH="$ROOT/.venv/bin:$PATH"  # cmake, ninja
gpu_sync_tree "$DIR/src"
if [ -f .shared/googletest/CMakeLists.txt ] && [ ! -f "$DIR/src/.shared/googletest/CMakeLists.txt" ]; then
  mkdir -p "$DIR/src/.shared" && cp -rp .shared/googletest "$DIR/src/.shared/"
fi
cd "$DIR/src"
echo "[prebuild] $("$VPY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'): gpu_build in $DIR/src"
t0=$(date +%s)
gpu_build "$VPY" "$DIR/build.log"
[ "$build_status" = ok ] || { echo "prebuild.sh: the build failed: $build_detail ($DIR/build.log)" >&2; exit 1; }
[ "$cpp_tests_built" = 1 ] || { echo "prebuild.sh: built without the C++ CUDA tests (no GoogleTest): run bench/gpu/prepare.sh first" >&2; exit 1; }
echo "[prebuild] built in $(( $(date +%s) - t0 )) s"
for t in test_cuda_dequant test_cuda_lossless test_cuda_backend; do
  build-gpu/tests/cpp/$t --gtest_list_tests >/dev/null || { echo "prebuild.sh: build-gpu/tests/cpp/$t does not start" >&2; exit 1; }
done
stamp=$(gpu_build_stamp "$VPY")
rm -rf "$ROOT/.prebuilt.new"
for f in $(gpu_build_outputs "$VPY"); do
  mkdir -p "$ROOT/.prebuilt.new/$(dirname "$f")" && cp -p "$f" "$ROOT/.prebuilt.new/$f"
done
echo "$stamp" >"$ROOT/.prebuilt.new/stamp"
rm -rf "$ROOT/.prebuilt" && mv "$ROOT/.prebuilt.new" "$ROOT/.prebuilt"
echo "[prebuild] .prebuilt/ ($(du -sh "$ROOT/.prebuilt" | cut -f1)): $stamp"
