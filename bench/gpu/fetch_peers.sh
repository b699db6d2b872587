#!/usr/bin/env bash
# Downloads the wheels of the peers bench/gpu/compare.py runs besides layerstream
# (RamTorch, diffusers' group offloading) into .whl/ (ignored by git), for a GPU
# machine that reaches no package index: carry .whl there; run.sh installs them.
# Versions pinned: the ones compare.py was written against (PEER_PACKAGES).
# DeepSpeed is not fetched: it ships here as a source archive whose CPU Adam must be
# built on the GPU machine (issue 27's full fine-tune rows are not in compare.py yet).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl
"$PY" -m pip download --no-deps --only-binary=:all: -d .whl ramtorch==1.11.0 diffusers==0.42.1
ls -l .whl
