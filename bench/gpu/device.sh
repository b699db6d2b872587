#!/usr/bin/env bash
# The GPU proof's command on the device machine: runs run.sh into a work folder,
# then packs what it wrote into $OUT, which the remote GPU runner returns (at most 8
# files): results.md, results.json, run.log and proof.tgz (every file of the run).
#
#   bash bench/gpu/device.sh [--deadline-s N] [run.sh args...]
#
# N: run.sh's --deadline-s (default 540, for a call of timeout_s 600: the packing
# and a margin fit in the rest); run.sh is stopped at N + 30 s whatever it does,
# and the packing still happens. Other arguments go to run.sh (--stages, --no-build,
# -- compare.py args). OUT unset (not on the device machine): OUT=/tmp/ls-proof-out.
# A call whose run compared systems keeps its results.json in
# build-gpu/proof/last-results.json (ignored, kept on a warm machine; LS_PROOF_KEEP
# names another folder) for the next call's -- --merge.
# The wheels of the peers (.whl), .shared (seed_layer.py, googletest) and .prebuilt
# (the build, made ahead) travel in the call's carry; docs/benchmarks.md, "Running it
# on the GPU machine".
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
N=540; ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --deadline-s) [ $# -ge 2 ] || { echo "device.sh: --deadline-s wants seconds" >&2; exit 2; }; N=$2; shift ;;
    --deadline-s=*) N=${1#*=} ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
[[ "$N" =~ ^[0-9]+$ ]] && [ "$N" -gt 0 ] || { echo "device.sh: --deadline-s wants whole seconds > 0, not $N" >&2; exit 2; }
OUT=${OUT:-/tmp/ls-proof-out}
mkdir -p "$OUT" && WORK=$(mktemp -d /tmp/ls-proof.XXXXXX) || exit 1
rm -f "$OUT/results.md" "$OUT/results.json" "$OUT/run.log" "$OUT/proof.tgz"  # none left from an earlier run
export PYTHONUNBUFFERED=1
timeout -k 10 $(( N + 30 )) bash bench/gpu/run.sh "$WORK" --deadline-s "$N" "${ARGS[@]}" 2>&1 | tee "$WORK/run.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "[gpu-proof] device.sh: run.sh stopped at $(( N + 30 )) s" | tee -a "$WORK/run.log"
for f in results.md results.json run.log; do [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"; done
# A call that ran the comparison leaves its results for the next call on this (warm)
# machine: -- --merge build-gpu/proof/last-results.json (compare.py, --merge).
KEEP=${LS_PROOF_KEEP:-build-gpu/proof}
if [ -f "$WORK/compare.log" ] && [ -f "$WORK/results.json" ]; then
  mkdir -p "$KEEP" && cp "$WORK/results.json" "$KEEP/last-results.json"
fi
tar czf "$OUT/proof.tgz" -C "$WORK" . && rm -rf "$WORK"
echo "[gpu-proof] device.sh: run.sh exit $rc; packed into $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit "$rc"
