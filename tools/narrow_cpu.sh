#!/usr/bin/env bash
# Runs every test (tools/test.sh) as on a CPU with fewer vector instructions than
# this one: CI's machines and users' differ (Intel or AMD, with or without
# AVX-512), and nothing may depend on how one of them rounds. Each library that
# picks its kernels by CPU is held to the chosen set:
#
#   bash tools/narrow_cpu.sh [avx2|generic]     # default avx2: a CPU without AVX-512
#
#   ATEN_CPU_CAPABILITY    torch's own vectorized kernels (and Inductor's code)
#   MKL_ENABLE_INSTRUCTIONS MKL, torch's BLAS on x86
#   ONEDNN_MAX_CPU_ISA     oneDNN (torch's CPU convolutions, some matmuls)
#   LS_OPTIM_ISA           layerstream.optim's kernels (docs/design/optim.md)
#
# Inductor compiles into a cache of its own (build dir, emptied first): its
# on-disk cache keys a graph without the vector width it was generated for, so
# code made for AVX-512 in the shared cache (/tmp/torchinductor_$USER) would be
# served to the narrower run (seen on 2026-12-06: a channels_last conv test
# computed garbage from 16-wide code run with 8-wide vectors).
# Exit status: tools/test.sh's. It cannot test a wider set than the CPU has.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
case "${1:-avx2}" in
  avx2) export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 LS_OPTIM_ISA=avx2 ;;
  generic) export ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 \
                  LS_OPTIM_ISA=generic ;;
  *) echo "narrow_cpu.sh: avx2 or generic, not $1" >&2; exit 2 ;;
esac
export TORCHINDUCTOR_CACHE_DIR="$ROOT/${LS_BUILD_DIR:-build}/inductor-cache-${1:-avx2}"
rm -rf "$TORCHINDUCTOR_CACHE_DIR"
echo "narrow_cpu.sh: ATEN_CPU_CAPABILITY=$ATEN_CPU_CAPABILITY MKL_ENABLE_INSTRUCTIONS=$MKL_ENABLE_INSTRUCTIONS" \
     "ONEDNN_MAX_CPU_ISA=$ONEDNN_MAX_CPU_ISA LS_OPTIM_ISA=$LS_OPTIM_ISA"
exec bash tools/test.sh
