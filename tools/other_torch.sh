#!/usr/bin/env bash
# Builds and tests this working tree against another PyTorch release, by default
# the GPU machine's (bench/gpu/build_lib.sh: LS_GPU_TORCH, LS_GPU_TORCHVISION), before a device
# call spends GPU time on an incompatibility: LibTorch API changes break the
# build, Python API and meta-kernel changes break tests (on 2026-12-04, three
# compile tests and a timing-dependent one failed under 2.11 and passed under
# the pinned 2.14.1).
#
#   bash tools/other_torch.sh [--torch VERSION] [--torchvision VERSION]
#
# Leaves .venv and build/ alone: everything lives in build-torch-VERSION/ (ignored):
#   venv/  that torch and torchvision only (pip --no-deps, from the package index);
#          every other package, and the CUDA libraries torch links, come from .venv
#          (a .pth file and a link to its nvidia/ folder), so nothing else downloads;
#   src/   a copy of the working tree (tracked files and untracked ones git does not
#          ignore; bench/gpu/build_lib.sh's gpu_sync_tree, so the build there stays
#          incremental) with .venv pointing at venv/, where tools/test.sh runs: the build
#          (CUDA for sm_90 only, no debug info), ctest, pytest and the GPU proof's dry run.
# Exit status: tools/test.sh's. Needs .venv (tools/setup.sh makes it).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
. bench/gpu/build_lib.sh  # the GPU machine's versions
TORCH=$LS_GPU_TORCH; VISION=$LS_GPU_TORCHVISION
while [ $# -gt 0 ]; do
  case "$1" in
    --torch) TORCH=$2; shift ;;
    --torchvision) VISION=$2; shift ;;
    *) echo "other_torch.sh: unknown argument $1 (--torch VERSION, --torchvision VERSION)" >&2; exit 2 ;;
  esac
  shift
done
[ -x .venv/bin/python ] || { echo "other_torch.sh: no .venv: run tools/setup.sh first" >&2; exit 2; }
DIR="$ROOT/build-torch-$TORCH"
SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -x "$DIR/venv/bin/python" ]; then
  "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv "$DIR/venv"
fi
VSITE=$("$DIR/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
have=$("$DIR/venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
if [ "${have%%+*}" != "$TORCH" ]; then
  echo "[other_torch] pip install --no-deps torch==$TORCH torchvision==$VISION"
  "$DIR/venv/bin/pip" install -q --disable-pip-version-check --no-deps "torch==$TORCH" "torchvision==$VISION"
fi
echo "$SITE" >"$VSITE/zz_layerstream_venv.pth"  # after its own site-packages: its torch wins
[ -e "$VSITE/nvidia" ] || ln -s "$SITE/nvidia" "$VSITE/nvidia"
# The working tree, as a device call would send it.
gpu_sync_tree "$DIR/src"
ln -sfn "$DIR/venv" "$DIR/src/.venv"
# tools/setup.sh installs requirements.txt when its stamp differs: this venv keeps its torch.
sha256sum requirements.txt | cut -d' ' -f1 >"$DIR/venv/.requirements.sha"
echo "[other_torch] $("$DIR/venv/bin/python" -c 'import torch; print("torch", torch.__version__)'): tools/test.sh in $DIR/src"
cd "$DIR/src"
LS_CUDA_ARCHS=${LS_CUDA_ARCHS:-$LS_GPU_CUDA_ARCH} LS_DEBUG_INFO=${LS_DEBUG_INFO:-0} bash tools/test.sh
