#!/usr/bin/env bash
# GPU proof: build layerstream for the GPU, run the GPU test subset, then the
# comparison (bench/gpu/compare.py); writes results.json and results.md (and
# build.log, tests.log, compare.log) into OUTDIR. Exits non-zero on any failure
# (build, tests, a system that errors); the speed targets are reported, not
# enforced.
#
#   bash bench/gpu/run.sh [--dry-run] OUTDIR [--seed-impl PATH] [--no-build]
#                         [--stages LIST] [--deadline-s N] [--full-ft-peers LIST]
#                         [-- compare.py args...]
#
# Real run (a machine with CUDA-enabled PyTorch 2.x and nvcc): uses .venv/bin/python
# when present, else python3; configures build-gpu/ against that python's torch
# and builds the _C target (it lands in python/layerstream/), bench_quant and
# the C++ CUDA tests (GoogleTest: installed, or sources in .shared/googletest
# or /usr/src/googletest; without it those tests are reported "not built"):
# bench/gpu/build_lib.sh's gpu_build; or copies that build from .prebuilt/ when
# its stamp matches (bench/gpu/prebuild.sh made it here ahead of the call);
# runs tests/python/test_parity_layers.py with LS_TEST_DEVICE=cuda, the C++
# CUDA tests (CPU-vs-CUDA dequantization bit-identity, backend) and
# bench_quant (device dequant GB/s); bench/bench_moe_decode.py (MoE decoding,
# every expert vs the routed ones; moe_decode.json/.md, appended to
# results.md); bench/bench_disk.py (disk.txt); bench/bench_compile.py and
# bench/bench_activations.py (compile.json, activations.json, appended to
# results.md); bench/bench_full_ft.py (full_ft.json: full fine-tuning with the
# host optimizer against the resident model); bench/bench_llama.py (llama.json: a Llama-3-8B-shaped model,
# resident vs streamed at 8 GiB); bench/gpu/nccl_one_rank.py (nccl.json: the process-group path
# with one NCCL rank); bench/gpu/sanitize.py (sanitize.json/.md: compute-sanitizer
# memcheck, racecheck, synccheck over the C++ CUDA tests and a streamed training
# step of the parity tests); then the comparison at full size (~6.4B params, bf16).
# Skips: on the GPU machine a skipped test fails the run unless its reason is
# one bench/gpu/skip_policy.py lists as right on one GPU (e.g. "needs two CUDA
# devices"); a skip because no device is usable ("no CUDA device visible": a
# driver mismatch) always fails it. pytest and the C++ CUDA tests write JUnit
# XML reports (tests.xml, test_cuda_*.xml) that the policy reads.
# --dry-run: the local .venv and its existing build (tools/setup.sh if the
# module does not import), device "sim", tiny sizes; the parity tests are
# collected and a few of them run on sim under the skip policy (no skip
# allowed there; tools/test.sh runs them all), and the skip policy checks its
# own rules (--self-test); 1.5 to 3.5 minutes on 2 CPU cores (98 s on 2026-12-04, 211 s
# on 2026-12-03 on a loaded machine).
# --seed-impl: the seed's seed_layer.py (never in the repo). When not given,
# .shared/seed_layer.py (an ignored folder of the checkout) is used if present.
# --stages: a comma-separated subset of the stages after the build, run in the order
# listed (default: all, in this order): tests,cpp,compare,llama,full_ft,compile,
# activations,disk,nccl,moe_decode,sanitize. --deadline-s: the whole run's wall time from its start
# (default 540 on the GPU, none in the dry run): each stage gets at most what is
# left, one that cannot start is "not run" (a failure). stages.tsv and the
# "stages" of results.json/results.md record every stage (bench/gpu/stages.py).
# --full-ft-peers: bench_full_ft.py's --peers (a subset: the full_ft stage takes 171 s
# with all seven on an H200, most of it DeepSpeed's).
# bench/gpu/device.sh is the command for the device machine (it packs OUTDIR).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; exit 2; }
ALL_STAGES=(tests cpp compare llama full_ft compile activations disk nccl moe_decode sanitize)
DRY=0; OUTDIR=""; SEED=""; BUILD=1; EXTRA=(); STAGE_LIST=""; DEADLINE=""; FULL_FT_PEERS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --seed-impl) [ $# -ge 2 ] || usage; SEED=$2; shift ;;
    --seed-impl=*) SEED=${1#*=} ;;
    --no-build) BUILD=0 ;;
    --stages) [ $# -ge 2 ] || usage; STAGE_LIST=$2; shift ;;
    --stages=*) STAGE_LIST=${1#*=} ;;
    --deadline-s) [ $# -ge 2 ] || usage; DEADLINE=$2; shift ;;
    --deadline-s=*) DEADLINE=${1#*=} ;;
    --full-ft-peers) [ $# -ge 2 ] || usage; FULL_FT_PEERS=$2; shift ;;
    --full-ft-peers=*) FULL_FT_PEERS=${1#*=} ;;
    -h|--help) usage ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) echo "run.sh: unknown option $1" >&2; usage ;;
    *) [ -z "$OUTDIR" ] || { echo "run.sh: more than one OUTDIR" >&2; usage; }; OUTDIR=$1 ;;
  esac
  shift
done
[ -n "$OUTDIR" ] || usage
[ -n "$DEADLINE" ] || { [ "$DRY" = 1 ] && DEADLINE=0 || DEADLINE=540; }
[[ "$DEADLINE" =~ ^[0-9]+$ ]] || { echo "run.sh: --deadline-s wants whole seconds (0: none), not $DEADLINE" >&2; exit 2; }
seen=" "
for s in ${STAGE_LIST//,/ }; do
  [[ " ${ALL_STAGES[*]} " == *" $s "* ]] || { echo "run.sh: unknown stage $s (stages: ${ALL_STAGES[*]})" >&2; exit 2; }
  [[ "$seen" == *" $s "* ]] && { echo "run.sh: stage $s listed twice in --stages" >&2; exit 2; }
  seen+="$s "
done
mkdir -p "$OUTDIR" || exit 1
OUTDIR=$(cd "$OUTDIR" && pwd)
T0=$(date +%s)
log() { echo "[gpu-proof] $*"; }
fail=0

if [ -z "$SEED" ]; then
  for cand in "$ROOT/.shared/seed_layer.py"; do
    if [ -f "$cand" ]; then SEED=$cand; break; fi
  done
fi
seed_args=()
if [ -n "$SEED" ]; then
  [ -f "$SEED" ] || { echo "run.sh: --seed-impl $SEED does not exist" >&2; exit 2; }
  SEED="$(cd "$(dirname "$SEED")" && pwd)/$(basename "$SEED")"
  seed_args=(--seed-impl "$SEED")
  log "seed implementation: ${seed_args[1]}"
else
  log "no seed implementation given: the 'seed' system will be skipped"
fi

# ---- python ----------------------------------------------------------------
# Versions of a python with torch (empty when it has none): one import of torch.
py_torch() { "$1" -c 'import torch,sys;print("torch",torch.__version__,"python",sys.version.split()[0])' 2>/dev/null; }
if [ -x .venv/bin/python ] && versions=$(py_torch .venv/bin/python); then
  PY="$ROOT/.venv/bin/python"
elif [ "$DRY" = 1 ]; then
  log "no .venv: running tools/setup.sh"
  bash tools/setup.sh || exit 1
  PY="$ROOT/.venv/bin/python"; versions=$(py_torch "$PY")
elif versions=$(py_torch python3); then
  PY=$(command -v python3)
else
  echo "run.sh: no python with torch (.venv/bin/python or python3)" >&2
  exit 1
fi
log "python: $PY ($versions)"
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
# A process that crashes prints its native stack, then its Python one (core/crash_report.h).
export LS_NATIVE_BACKTRACE=1 PYTHONFAULTHANDLER=1
NO_CUDA=0
if [ "$DRY" = 0 ] && ! "$PY" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  log "ERROR: torch sees no CUDA device (use --dry-run on a machine without a GPU); build and tests not run"
  NO_CUDA=1; fail=1
fi

# ---- build -----------------------------------------------------------------
. bench/gpu/build_lib.sh
build_status=skipped; build_detail=""; build_s=0
tb=$(date +%s)
if [ "$DRY" = 1 ]; then
  if "$PY" -c 'import layerstream' >/dev/null 2>&1; then
    build_status=ok; build_detail="dry run: existing build of the .venv (python/layerstream/_C)"
  else
    log "layerstream does not import: running tools/setup.sh"
    if bash tools/setup.sh >"$OUTDIR/build.log" 2>&1; then
      build_status=ok; build_detail="dry run: tools/setup.sh"
    else
      build_status=failed; build_detail="tools/setup.sh failed (see build.log)"; fail=1
      tail -30 "$OUTDIR/build.log"
    fi
  fi
elif [ "$NO_CUDA" = 1 ]; then
  build_status=skipped; build_detail="not run: no CUDA device"
elif [ "$BUILD" = 0 ]; then
  build_status=skipped; build_detail="--no-build: using the module already in python/layerstream/"
elif gpu_use_prebuilt "$PY" "$OUTDIR/build.log"; then
  build_status=ok; build_detail="prebuilt (bench/gpu/prebuild.sh, carried as .prebuilt/): $(cat .prebuilt/stamp)"
else
  gpu_build "$PY" "$OUTDIR/build.log"
  [ "$build_status" = ok ] || fail=1
fi
build_s=$(( $(date +%s) - tb ))
log "build: $build_status ($build_s s) $build_detail"
[ "$DRY" = 1 ] || [ "$NO_CUDA" = 1 ] || gpu_runtime_path "$PY"  # the C++ binaries, prebuilt or not

"$PY" - "$OUTDIR/build.json" "$build_status" "$build_s" "$build_detail" <<'PYEOF'
import json, sys
json.dump(dict(zip(("status", "seconds", "detail"), sys.argv[2:5])), open(sys.argv[1], "w"), indent=2)
PYEOF

# The peers' wheels (bench/gpu/fetch_peers.sh puts them in .whl/; carry it): the GPU
# machine reaches no package index, so they are installed from there, without their
# dependencies (that machine has torch, numpy, huggingface_hub, ... already).
if [ "$DRY" = 0 ] && compgen -G ".whl/*.whl" >/dev/null; then
  if "$PY" -m pip install --no-deps --no-index .whl/*.whl >"$OUTDIR/peers.log" 2>&1; then
    log "peers installed from .whl: $(cd .whl && ls *.whl | tr '\n' ' ')"
  else
    log "the peers' wheels did not install (see peers.log): their rows will say they are not importable"
  fi
fi

# ---- stages ------------------------------------------------------------------
# Every step after the build is a stage (a function stage_NAME), run in the order
# --stages lists (default ALL_STAGES'), for at most min(its cap, what is left of --deadline-s);
# under MIN_STAGE_S left it is "not run" (a failure). Each is recorded in
# stages.tsv; bench/gpu/stages.py turns the record into results.json/.md.
STAGES_TSV="$OUTDIR/stages.tsv"; : >"$STAGES_TSV"
MIN_STAGE_S=30
selected() { [ -z "$STAGE_LIST" ] || [[ ",$STAGE_LIST," == *",$1,"* ]]; }
left_s() { if [ "$DEADLINE" -gt 0 ]; then echo $(( DEADLINE - ($(date +%s) - T0) )); else echo 100000; fi; }
# within CAP: CAP, or what is left of the deadline when less (at least 1: "timeout 0" never stops).
within() { local l; l=$(left_s); [ "$l" -lt 1 ] && l=1; echo $(( l < $1 ? l : $1 )); }
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$STAGES_TSV"; }
# stage_begin NAME CAP FILE: 0 and STAGE_T (its timeout) when NAME runs now; 1 (recorded) when it does not.
stage_begin() {
  STAGE_NAME=$1; STAGE_FILE=$3; STAGE_START=$(date +%s)
  if ! selected "$1"; then record "$1" "not selected" 0 0 "" ""; return 1; fi
  local left; left=$(left_s)
  if [ "$left" -lt $MIN_STAGE_S ]; then
    record "$1" "not run" 0 0 "$3" "$left s left of --deadline-s $DEADLINE (needs $MIN_STAGE_S)"
    log "stage $1: not run ($left s left of --deadline-s $DEADLINE)"; fail=1; return 1
  fi
  STAGE_T=$(within "$2")
}
# stage_end RC [DETAIL]: records the stage begun last.
stage_end() {
  local status=ok
  case "$1" in 0) ;; 124|137) status="timed out" ;; *) status=failed ;; esac
  if [ "$status" != ok ]; then
    fail=1; log "stage $STAGE_NAME: $status (exit $1, see $STAGE_NAME.log); its last lines:"
    if [ -f "$OUTDIR/$STAGE_NAME.log" ]; then tail -15 "$OUTDIR/$STAGE_NAME.log" | sed 's/^/    /'; fi
  fi
  record "$STAGE_NAME" "$status" $(( $(date +%s) - STAGE_START )) "$STAGE_T" "$STAGE_FILE" "${2:-exit $1}"
}
# bench_stage NAME CAP FILE CMD...: CMD's stdout into FILE, its stderr into NAME.log.
# LS_STAGE_DEADLINE_S (15 s inside the stage's timeout) lets a script that runs
# several peers skip those it cannot finish and still print its rows (bench_full_ft.py).
bench_stage() {
  local name=$1 cap=$2 file=$3; shift 3
  stage_begin "$name" "$cap" "$file" || return 0
  log "stage $name: ${*/#"$PY"/python} (timeout $STAGE_T s)"
  LS_STAGE_DEADLINE_S=$(( STAGE_T > 30 ? STAGE_T - 15 : STAGE_T )) timeout "$STAGE_T" "$@" \
    >"$OUTDIR/$file" 2>"$OUTDIR/$name.log"
  stage_end $?
}

# ---- GPU test subset ---------------------------------------------------------
TESTS_JSON="$OUTDIR/tests.json"
PARITY=tests/python/test_parity_layers.py
write_tests() { # status detail rc env_supported
  "$PY" - "$TESTS_JSON" "$1" "$2" "$3" "$4" "$PARITY" <<'PYEOF'
import json, sys
path, status, detail, rc, env, f = sys.argv[1:7]
json.dump({"status": status, "detail": detail, "rc": int(rc), "file": f,
           "ls_test_device_supported": env == "1"}, open(path, "w"), indent=2)
PYEOF
}
run_tests() {
  if [ "$NO_CUDA" = 1 ]; then
    write_tests "not run" "no CUDA device" 0 0; return 0
  elif [ ! -f "$PARITY" ]; then
    log "tests: $PARITY does not exist yet: recorded as missing"
    write_tests missing "$PARITY does not exist in this checkout" 0 0; return 0
  elif ! "$PY" -c 'import pytest' >/dev/null 2>&1; then
    write_tests failed "pytest is not importable" 1 0; return 1
  fi
  local env_ok=0 rc summary pol spc
  grep -q LS_TEST_DEVICE "$PARITY" && env_ok=1
  if [ "$DRY" = 1 ]; then
    # tools/test.sh already runs the whole Python suite on sim; here check that the
    # file collects (what the real run depends on), the skip policy's own rules, and
    # run a few parity tests on sim through the same report + policy path as the
    # real run (no skip is expected on sim).
    LS_TEST_DEVICE=sim timeout 90 "$PY" -m pytest -q --collect-only -k parity "$PARITY" >"$OUTDIR/tests.log" 2>&1
    rc=$?
    summary=$(grep -v '^[[:space:]]*$' "$OUTDIR/tests.log" | tail -1)
    local prc src ssum
    "$PY" bench/gpu/skip_policy.py --self-test >"$OUTDIR/skip_policy.log" 2>&1; prc=$?
    [ $prc = 0 ] || { log "skip policy self-test FAILED (see skip_policy.log)"; cat "$OUTDIR/skip_policy.log"; }
    LS_TEST_DEVICE=sim timeout 120 "$PY" -m pytest -q -rs --junitxml="$OUTDIR/tests.xml" \
      -k "test_linear_fp32_bit_exact or test_resident_and_streamed_layers_in_one_model" "$PARITY" \
      >>"$OUTDIR/tests.log" 2>&1
    src=$?
    ssum=$(grep -v '^[[:space:]]*$' "$OUTDIR/tests.log" | tail -1)
    "$PY" bench/gpu/skip_policy.py --mode sim "$OUTDIR/tests.xml" >>"$OUTDIR/skip_policy.log" 2>&1; spc=$?
    pol=$(tail -1 "$OUTDIR/skip_policy.log")
    log "tests: $summary; subset: $ssum; $pol"
    if [ $rc = 0 ] && [ $prc = 0 ] && [ $src = 0 ] && [ $spc = 0 ]; then
      write_tests collected "dry run: $summary; subset on sim: $ssum; $pol; skip policy self-test passed" 0 $env_ok
      return 0
    fi
    write_tests failed "dry run: collect rc $rc ($summary); subset on sim rc $src ($ssum); skip policy rc $spc ($pol); self-test rc $prc" 1 $env_ok
    tail -20 "$OUTDIR/tests.log"; cat "$OUTDIR/skip_policy.log"; return 1
  fi
  log "tests: LS_TEST_DEVICE=cuda pytest -k parity $PARITY (timeout $STAGE_T s)"
  LS_TEST_DEVICE=cuda timeout "$STAGE_T" "$PY" -m pytest -q -rs --junitxml="$OUTDIR/tests.xml" -k parity "$PARITY" \
    >"$OUTDIR/tests.log" 2>&1
  rc=$?
  # last non-blank line: the pytest summary, or its "ERROR: ..." usage error
  summary=$(grep -v '^[[:space:]]*$' "$OUTDIR/tests.log" | tail -1)
  log "tests: $summary"
  local note=" (on cuda: LS_TEST_DEVICE=cuda)"
  [ $env_ok = 1 ] || note=" (the file does not read LS_TEST_DEVICE: its own default device was used)"
  # A skipped parity test is not a pass on the GPU machine (bench/gpu/skip_policy.py).
  "$PY" bench/gpu/skip_policy.py --mode gpu "$OUTDIR/tests.xml" >"$OUTDIR/skip_policy.log" 2>&1; spc=$?
  pol=$(tail -1 "$OUTDIR/skip_policy.log")
  if [ $rc = 0 ] && [ $spc = 0 ]; then write_tests passed "$summary$note; $pol" 0 $env_ok; return 0; fi
  if [ $rc = 0 ]; then
    write_tests failed "unexpected skips: $summary$note; $pol" 1 $env_ok; cat "$OUTDIR/skip_policy.log"; return 1
  fi
  write_tests failed "rc $rc: $summary$note; $pol" $rc $env_ok; tail -30 "$OUTDIR/tests.log"; return $rc
}
stage_tests() {
  stage_begin tests 150 tests.json || return 0
  run_tests; trc=$?
  stage_end $trc "$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("detail", ""))' "$TESTS_JSON" 2>/dev/null)"
}

# ---- C++ CUDA tests and device dequant throughput ----------------------------
# test_cuda_dequant: dequantize_cuda bit-identical to dequantize_cpu (every
# format x output dtype x shape); test_cuda_lossless: the lossless decoder
# bit-identical to its source (every dtype, edge values, block sizes; it prints
# its GB/s); test_cuda_backend: streams, events, copies,
# host functions on the device; bench_quant: pack, CPU and device dequant GB/s.
# The dry run runs the same binaries from the local build (they skip without
# a GPU) to check the plumbing.
CPP_JSON="$OUTDIR/cpp_tests.json"
bdir=build-gpu; [ "$DRY" = 1 ] && bdir=${LS_BUILD_DIR:-build}
run_cpp() {
  : >"$OUTDIR/cpp.log"
  local cpp_results=() cpp_state=ran t exe rc sum qexe qargs
  if [ "$NO_CUDA" = 1 ] || [ "$build_status" = failed ]; then
    cpp_state="not run"
  else
    for t in test_cuda_dequant test_cuda_lossless test_cuda_backend; do
      exe="$bdir/tests/cpp/$t"
      if [ ! -x "$exe" ]; then cpp_results+=("$t|not built|0"); continue; fi
      log "C++: $t"
      rm -f "$OUTDIR/$t.xml"
      timeout "$(within 100)" "$exe" --gtest_brief=1 --gtest_output="xml:$OUTDIR/$t.xml" \
        >"$OUTDIR/$t.log" 2>&1; rc=$?
      cat "$OUTDIR/$t.log" >>"$OUTDIR/cpp.log"
      sum=$(grep -E '^\[ +(PASSED|SKIPPED|FAILED) +\] [0-9]+ test' "$OUTDIR/$t.log" \
            | sed -E 's/^\[ +([A-Z]+) +\] ([0-9]+).*/\2 \1/' | tr 'A-Z\n' 'a-z,' | sed 's/,$//;s/,/, /g')
      # On the GPU machine a skip is a pass only for the reasons skip_policy.py lists
      # (a "no CUDA device" skip of every test would otherwise report success). The
      # dry run has no GPU: its CUDA binaries skip for lack of a device, as they should.
      if [ "$DRY" = 0 ] && [ $rc = 0 ]; then
        "$PY" bench/gpu/skip_policy.py --mode gpu "$OUTDIR/$t.xml" >>"$OUTDIR/skip_policy.log" 2>&1 \
          || { rc=1; sum="${sum:-no summary}, unexpected skips: $(grep -c 'UNEXPECTED SKIP' "$OUTDIR/skip_policy.log")"; \
               grep 'UNEXPECTED SKIP' "$OUTDIR/skip_policy.log" | head -5; }
      fi
      cpp_results+=("$t|${sum:-no summary}|$rc")
      [ $rc = 0 ] || grep -E "FAILED|Failure" "$OUTDIR/$t.log" | head -20
    done
    qexe="$bdir/bench/bench_quant"
    if [ -x "$qexe" ]; then
      qargs=(--json --rows 16384 --cols 4096); [ "$DRY" = 1 ] && qargs=(--json --rows 256 --cols 1024 --reps 1)
      log "C++: bench_quant ${qargs[*]}"
      timeout "$(within 60)" "$qexe" "${qargs[@]}" >"$OUTDIR/bench_quant.json" 2>>"$OUTDIR/cpp.log"; rc=$?
      cpp_results+=("bench_quant|rc $rc|$rc")
    else
      cpp_results+=("bench_quant|not built|0")
    fi
  fi
  "$PY" - "$CPP_JSON" "$TESTS_JSON" "$OUTDIR/bench_quant.json" "$cpp_state" "$DRY" "${cpp_results[@]}" <<'PYEOF'
import json, sys
out, tests_path, quant_path, state, dry = sys.argv[1:6]
entries = []
for item in sys.argv[6:]:
    name, summary, rc = item.split("|")
    entries.append({"name": name, "summary": summary, "rc": int(rc)})
cpp = {"status": state, "binaries": entries}
if state == "ran":
    bad = [e for e in entries if e["rc"] != 0]
    missing = [e for e in entries if e["summary"] == "not built"]
    cpp["status"] = "failed" if bad else ("incomplete" if missing else "passed")
    cpp["detail"] = "; ".join(f"{e['name']}: {e['summary']}" for e in entries)
try:
    q = json.load(open(quant_path))
    cpp["dequant_throughput"] = {"rows": q["rows"], "cols": q["cols"], "formats": [
        {"format": r["format"], "cuda_gbps": r["dequant_cuda_gbps"], "cpu_gbps": r["dequant_cpu_gbps_bf16_out"],
         "pack_gbps_f32_src": r["pack_gbps_f32_src"]} for r in q["results"]]}
    if dry == "0" and any(r["cuda_gbps"] <= 0 for r in cpp["dequant_throughput"]["formats"]):
        cpp["status"] = "failed"
        cpp["detail"] = cpp.get("detail", "") + "; bench_quant measured no device dequantization"
except (OSError, ValueError, KeyError):
    pass
# test_cuda_lossless prints the decoder's speed on a 16384 x 4096 bf16 weight (issue 28).
import os, re
try:
    log = open(os.path.join(os.path.dirname(quant_path), "test_cuda_lossless.log")).read()
    m = re.search(r"\[ lossless \] decode (\d+) x (\d+) bf16 on the device: ([\d.]+) ms, ([\d.]+) GB/s of output "
                  r"\(coded ([\d.]+) of raw\)", log)
    if m:
        cpp["lossless_decode"] = {"rows": int(m[1]), "cols": int(m[2]), "ms": float(m[3]),
                                  "output_gbps": float(m[4]), "coded_ratio": float(m[5])}
    # ... and at each block size (the default block size's rule, lossless::default_block_elems).
    sweep = re.findall(r"\[ lossless sweep \] (\d+) x (\d+) bf16, blocks of (\d+)( \(default\))?: ([\d.]+) ms, "
                       r"([\d.]+) GB/s of output \(coded ([\d.]+) of raw\)", log)
    if sweep:
        cpp["lossless_sweep"] = [{"rows": int(r), "cols": int(c), "block": int(b), "default": bool(d),
                                  "ms": float(ms), "output_gbps": float(g), "coded_ratio": float(q)}
                                 for r, c, b, d, ms, g, q in sweep]
except OSError:
    pass
json.dump(cpp, open(out, "w"), indent=2)
try:
    tests = json.load(open(tests_path))
except (OSError, ValueError):
    tests = {"status": "not run"}
tests["cpp"] = cpp
json.dump(tests, open(tests_path, "w"), indent=2)
print(f"[gpu-proof] C++ CUDA tests: {cpp['status']}" + (f" — {cpp['detail']}" if cpp.get("detail") else ""))
sys.exit(1 if cpp["status"] == "failed" else 0)
PYEOF
}
stage_cpp() {
  stage_begin cpp 360 cpp_tests.json || return 0
  run_cpp; crc=$?
  stage_end $crc "$("$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["status"], "—", d.get("detail", ""))' "$CPP_JSON" 2>/dev/null)"
}

# ---- the comparison ----------------------------------------------------------
# bench/gpu/compare.py: the synthetic stack in every system (bench/gpu/README.md),
# with what is left of --deadline-s (it skips, as a failure, a system it cannot
# start in time).
cmp_args=(--out "$OUTDIR" "${seed_args[@]}" --build-status "$build_status" --build-seconds "$build_s"
          --build-detail "$build_detail" --tests-json "$TESTS_JSON")
# One torch thread: on 2 shared cores, intra-op threads spin against each other
# and make the tiny bf16 matmuls ~50x slower.
[ "$DRY" = 1 ] && cmp_args+=(--dry-run --threads 1)
cmd_str="bash bench/gpu/run.sh$([ "$DRY" = 1 ] && echo ' --dry-run') OUTDIR${SEED:+ --seed-impl $SEED}${STAGE_LIST:+ --stages $STAGE_LIST}${FULL_FT_PEERS:+ --full-ft-peers $FULL_FT_PEERS}"
stage_compare() {
  stage_begin compare 3600 results.json || return 0
  [ "$DEADLINE" -gt 0 ] && cmp_args+=(--deadline-s $(( STAGE_T - 10 )))
  log "stage compare: compare.py ${cmp_args[*]} ${EXTRA[*]}"
  "$PY" bench/gpu/compare.py "${cmp_args[@]}" --command "$cmd_str" "${EXTRA[@]}"
  rc=$?
  [ -f "$OUTDIR/results.json" ] && [ -f "$OUTDIR/results.md" ] || { log "results.json/results.md missing"; rc=1; }
  stage_end $rc "$("$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); s = d["summary"]
print("%d/%d layerstream rows PASS, %d failure(s), %s s" % (s["pass"], s["layerstream_rows"], len(d["failures"]), s["compare_seconds"]))' "$OUTDIR/results.json" 2>/dev/null)"
}

# ---- the other rows, each a script in its own process -------------------------
# bench/bench_llama.py: a Llama-3-8B-shaped transformers model with random bf16
# weights, LoRA training step and greedy decoding, resident vs layerstream under an
# 8 GiB budget, each in its own process (issue 27, item 2).
stage_llama() {
  if [ "$DRY" = 1 ]; then
    largs=(--device sim --tiny --seq 64 --steps 1 --new-tokens 4 --budget 400000)
  else
    largs=(--device cuda --seq 1024 --steps 2 --new-tokens 8)
  fi
  bench_stage llama 300 llama.json "$PY" bench/bench_llama.py "${largs[@]}" --json
}

# bench/bench_full_ft.py: resident + torch fused AdamW on the GPU (the reference),
# torch's AdamW on the host copy, layerstream.optim.AdamW after the backward and
# overlapped with it, and overlapped with lossless-coded weights (issues 21, 28);
# DeepSpeed ZeRO-Offload (stage 2) and ZeRO-3 offload when deepspeed installed from
# .whl (its CPU Adam compiles on first use: the first DeepSpeed peer's time);
# step time, backward, the optimizer time visible after the backward, peak memory.
stage_full_ft() {
  if [ "$DRY" = 1 ]; then
    fargs=(--layers 8 --width 128 --batch 8 --steps 2)
  else
    fargs=(--device cuda --layers 16 --width 4096 --batch 2048 --steps 5 --budget 0.3)
  fi
  [ -n "$FULL_FT_PEERS" ] && fargs+=(--peers "$FULL_FT_PEERS")
  bench_stage full_ft 330 full_ft.json "$PY" bench/bench_full_ft.py "${fargs[@]}" --peer-timeout 150 --json
}

# bench/bench_compile.py: four peers, each in its own process, on the same
# training step (Linear stack, frozen weights). Goal: the compiled streamed
# compute-bound step within 1.02x of the compiled resident one.
stage_compile() {
  if [ "$DRY" = 1 ]; then
    cargs=(--layers 2 --width 64 --batch 8 --steps 2 --rounds 1 --backend aot_eager)
  else
    cargs=(--device cuda --layers 16 --width 4096 --batch 16384 --steps 5 --rounds 1)
  fi
  bench_stage compile 200 compile.json "$PY" bench/bench_compile.py "${cargs[@]}" --json
}

# bench/bench_activations.py: a training step whose saved activations dwarf the
# weights, without and with offload(activations="host"), each in its own
# process. Goal: >= 50% lower peak activation memory for <= 10% more step time.
stage_activations() {
  if [ "$DRY" = 1 ]; then
    aargs=(--layers 2 --width 256 --batch 256 --steps 1)
  else
    aargs=(--device cuda --layers 8 --width 4096 --batch 32768 --steps 5)
  fi
  bench_stage activations 200 activations.json "$PY" bench/bench_activations.py "${aargs[@]}" --json
}

# bench/bench_disk.py: the reader against a plain read() of the same file (page
# cache dropped), and a step of Linear layers loaded with load_safetensors() and
# streamed from disk under a host budget of a quarter of the weights.
stage_disk() {
  if [ "$DRY" = 1 ]; then
    dargs=(--mb 64 --rounds 1 --layers 8 --width 512 --steps 2)
  else
    dargs=(--device cuda --gbps 50 --mb 2048 --rounds 3 --layers 8 --width 8192 --steps 3)
  fi
  bench_stage disk 120 disk.txt "$PY" bench/bench_disk.py "${dargs[@]}"
}

# bench/gpu/nccl_one_rank.py: offload(process_group=world of one NCCL rank),
# every streamed gradient through the engine's all-reduce, full fine-tuning
# steps against the resident model (docs/design/distributed.md).
stage_nccl() {
  if [ "$DRY" = 1 ]; then
    nargs=(--device sim --backend gloo --layers 2 --width 64)
  else
    nargs=(--device cuda --backend nccl --layers 8 --width 4096 --batch 4096)
  fi
  bench_stage nccl 120 nccl.json "$PY" bench/gpu/nccl_one_rank.py "${nargs[@]}"
}

# bench/bench_moe_decode.py: greedy decoding of a small Qwen3-MoE (128 experts,
# 8 per token) with offload(experts="all"), experts="routed" and routed with
# quantize="lossless" (a third system since 2026-12-05: 200 s, was 150); fails
# when a system's logits differ from the resident model's by more than 0.05.
stage_moe_decode() {
  if [ "$DRY" = 1 ]; then
    margs=(--tokens 4)
  else
    margs=(--device cuda --layers 4 --hidden 1024 --expert-inter 512 --tokens 16)
  fi
  bench_stage moe_decode 200 moe_decode.json "$PY" bench/bench_moe_decode.py "${margs[@]}" --json --out-md "$OUTDIR/moe_decode.md"
}

# bench/gpu/sanitize.py: compute-sanitizer (memcheck, racecheck, synccheck) over the
# C++ CUDA tests and a streamed training step of the parity tests; every run must
# report 0 errors (issue 27). The dry run has no compute-sanitizer: the targets run
# bare on sim (plumbing).
stage_sanitize() {
  sargs=(--build-dir "$bdir" --logs "$OUTDIR/sanitize" --out-md "$OUTDIR/sanitize.md")
  [ "$DRY" = 1 ] && sargs+=(--dry-run)
  bench_stage sanitize 300 sanitize.json "$PY" bench/gpu/sanitize.py "${sargs[@]}"
}

# ---- the run: the stages --stages lists, in its order (default: ALL_STAGES'), then
# the others, which stage_begin records "not selected".
order=()
for st in ${STAGE_LIST//,/ }; do order+=("$st"); done
[ ${#order[@]} -gt 0 ] || order=("${ALL_STAGES[@]}")
for st in "${ALL_STAGES[@]}"; do [[ " ${order[*]} " == *" $st "* ]] || order+=("$st"); done
for st in "${order[@]}"; do "stage_$st"; done

# ---- the record ---------------------------------------------------------------
"$PY" bench/gpu/stages.py "$OUTDIR" --build-json "$OUTDIR/build.json" --command "$cmd_str" || fail=1
log "done in $(( $(date +%s) - T0 )) s: $OUTDIR/results.md ($([ $fail = 0 ] && echo OK || echo FAILED))"
exit $fail
