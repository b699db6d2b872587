#!/usr/bin/env bash
# Prepares this checkout for the GPU proof's device calls (run it here, where pip reaches
# PyPI; the GPU machine reaches nothing):
#
#   bash bench/gpu/prepare.sh --seed-impl PATH/seed_layer.py [--python PATH] [--no-fetch]
#
# puts the peers' wheels into .whl/ (bench/gpu/fetch_peers.sh; --no-fetch keeps what is
# there), the seed's file into .shared/seed_layer.py and GoogleTest's sources (from
# /usr/src/googletest, for the C++ CUDA tests) into .shared/googletest; with --python (a
# Python of the GPU machine's minor version), the build for that machine into .prebuilt/
# (bench/gpu/prebuild.sh; a call then needs no build). The three folders are ignored by
# git. Checks that what a device call sends stays under the runner's 64 MiB, and prints
# the calls (docs/benchmarks.md, "Running it on the GPU machine").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
SEED=""; FETCH=1; PREBUILD_PY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --seed-impl) [ $# -ge 2 ] || { echo "prepare.sh: --seed-impl needs a path" >&2; exit 2; }; SEED=$2; shift ;;
    --python) [ $# -ge 2 ] || { echo "prepare.sh: --python needs a path" >&2; exit 2; }; PREBUILD_PY=$2; shift ;;
    --no-fetch) FETCH=0 ;;
    *) echo "prepare.sh: unknown argument $1 (--seed-impl PATH, --python PATH, --no-fetch)" >&2; exit 2 ;;
  esac
  shift
done
[ -z "$SEED" ] || [ -f "$SEED" ] || { echo "prepare.sh: $SEED does not exist" >&2; exit 2; }
mkdir -p .shared
[ -z "$SEED" ] || cp "$SEED" .shared/seed_layer.py
[ -f .shared/seed_layer.py ] || echo "prepare.sh: no .shared/seed_layer.py: the 'seed' rows will be skipped (give --seed-impl)"
if [ ! -f .shared/googletest/CMakeLists.txt ]; then
  if [ -f /usr/src/googletest/CMakeLists.txt ]; then
    rm -rf .shared/googletest && cp -r /usr/src/googletest .shared/googletest
  else
    echo "prepare.sh: no /usr/src/googletest (apt-get install googletest): the C++ CUDA tests will be 'not built'"
  fi
fi
[ "$FETCH" = 0 ] || bash bench/gpu/fetch_peers.sh >/dev/null
if [ -n "$PREBUILD_PY" ]; then
  bash bench/gpu/prebuild.sh --python "$PREBUILD_PY" | grep '^\[prebuild\]'
elif [ -f .prebuilt/stamp ]; then
  . bench/gpu/build_lib.sh
  if [ -x build-prebuilt/venv/bin/python ] && [ "$(gpu_build_stamp build-prebuilt/venv/bin/python)" = "$(cat .prebuilt/stamp)" ]; then
    echo "prepare.sh: .prebuilt/ matches this checkout: $(cat .prebuilt/stamp)"
  else
    echo "prepare.sh: .prebuilt/ is stale (a C++ source or build_lib.sh changed since): a call would build; give --python PATH"
  fi
fi
carry='".whl", ".shared"'; [ -d .prebuilt ] && carry='".whl", ".shared", ".prebuilt"'
# What a call sends: tracked files, untracked files git does not ignore, the carried folders.
sent=$( { git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1;
          du -sb .whl .shared .prebuilt 2>/dev/null | cut -f1; } | awk '{ s += $1 } END { print s + 0 }')
echo "what a device call sends: $(( sent / 1048576 )) MiB of the 64 MiB allowed"
[ "$sent" -lt $(( 64 * 1048576 )) ] || { echo "prepare.sh: over the remote GPU runner's 64 MiB a call" >&2; exit 1; }
echo "device calls (carry: [$carry]), LEFT = device time left - 60 s, the second call of a"
cat <<'CALLS'
session at once while the machine is warm; one session per pair (docs/benchmarks.md):
  A1 timeout_s 600:  bash bench/gpu/device.sh --stages tests,cpp,activations,compare -- --systems resident,layerstream-all-streamed,layerstream-lossless
  A2 timeout_s LEFT: bash bench/gpu/device.sh --deadline-s LEFT --no-build --stages full_ft,sanitize,llama --full-ft-peers ls-overlap,ls-lossless
  B1 timeout_s 600:  bash bench/gpu/device.sh --stages compare -- --systems resident,layerstream,layerstream-all-streamed,ramtorch,diffusers-group,seed
  B2 timeout_s LEFT: bash bench/gpu/device.sh --deadline-s LEFT --no-build --stages compare -- --systems layerstream-lossless,layerstream-nf4,accelerate --merge build-gpu/proof/last-results.json
  C: --stages moe_decode, and the stages the records (results.md, "Stages") show "not run", without --no-build.
CALLS
