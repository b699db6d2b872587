#!/usr/bin/env bash
# Downloads the wheels of the peers the GPU proof runs besides layerstream into .whl/
# (ignored by git), for a GPU machine that reaches no package index: carry .whl there;
# run.sh installs them (--no-deps). Versions pinned: the ones the benchmarks were
# written against.
#   RamTorch, diffusers' group offloading: bench/gpu/compare.py (PEER_PACKAGES).
#   DeepSpeed (ZeRO-Offload, ZeRO-3 offload): bench/bench_full_ft.py's full fine-tune
#   rows. PyPI has its source only: built here into a wheel of Python files (its ops,
#   DeepSpeedCPUAdam among them, compile on the GPU machine at first use; DS_ACCELERATOR
#   names the accelerator it records). The GPU machine's image lacks hjson and pydantic
#   (with pydantic-core, built for its Python 3.12, and pydantic's small dependencies);
#   the rest DeepSpeed imports (ninja, psutil, msgpack, einops, py-cpuinfo, ...) is there
#   (the image's package list as read on 2026-11-17).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl
"$PY" -m pip download --no-deps --only-binary=:all: -d .whl ramtorch==1.11.0 diffusers==0.42.1
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 \
  -d .whl hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0
DS_ACCELERATOR=cuda DS_BUILD_OPS=0 "$PY" -m pip wheel --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
ls -l .whl
