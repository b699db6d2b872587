"""compute-sanitizer over the C++ CUDA tests and one streamed training step.

The GPU proof's `sanitize` stage (bench/gpu/run.sh; issue 27: "memcheck, racecheck,
synccheck over the C++ CUDA tests and one streamed training step of the parity
tests: zero errors reported, or each finding fixed"). Runs, each under
`compute-sanitizer --tool TOOL --error-exitcode 99`:

* the C++ CUDA tests (test_cuda_dequant, test_cuda_lossless, test_cuda_backend in
  --build-dir/tests/cpp), without the cases too large to run instrumented (the
  >2^31-element dequantizations and the throughput measurement: GTEST_EXCLUDE);
  memcheck with --leak-check full (device memory the tests or the backend leave
  allocated is a finding);
* the streamed training steps of tests/python/test_parity_layers.py named in
  PARITY_STEP (resident and streamed layers in one model, three SGD steps; lossless
  coded trainable weights, re-coded and decoded by the CUDA kernel every step) with
  LS_TEST_DEVICE=cuda. memcheck checks every kernel (torch's read the slots we
  fill), with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so that each torch tensor is an
  allocation of its own (an access past one is seen); racecheck and synccheck
  instrument only layerstream's kernels (--kernel-name kns=layerstream): torch's and
  cuBLAS's own are not ours to judge.

Every run passes --report-api-errors no: the C++ tests make failing CUDA calls on
purpose (an allocation of 2^60 bytes, a device that does not exist) and assert the
errors the backend makes of them, torch and CUDA's libraries probe the driver with calls
that fail by design (public reports of compute-sanitizer under Python show dozens of
cuGetProcAddress errors), and every CUDA call of layerstream's is checked and turned
into an exception (the tests would fail). What the tools judge: device memory accesses,
leaks, shared-memory races, barrier misuse.

A run is "clean" (the tool's summary reports 0 errors and the target exited 0),
"errors" (N reported: the run's log has them), "target failed" (0 reported but the
target exited non-zero: a test failed under the tool), "unexpected skips" (a
test skipped under the tool for a reason bench/gpu/skip_policy.py does not accept on
one GPU, e.g. "no CUDA device": nothing was checked), "unavailable" (the tool
refused the device, e.g. "Device not supported" in a sandboxed container: nothing is
proven, the runs left are not tried), "no report" (no summary line), "timed out" or
"not run" (too little of --deadline-s left). The stage passes only when every run
is clean. A run where the tool "failed to handle a hardware exception" (a kernel
faulted; the tool does not say which) is run once more with CUDA_LAUNCH_BLOCKING=1,
a row of its own, so that its log's traceback names the launch that faulted.

    python bench/gpu/sanitize.py --build-dir build-gpu --logs OUTDIR/sanitize \\
        [--out-md OUTDIR/sanitize.md] [--sanitizer PATH] [--tools memcheck,...] \\
        [--targets cpp,python] [--deadline-s N] [--dry-run]

Writes the JSON record on stdout, one log per run into --logs, a table into
--out-md. --dry-run (the CPU, no compute-sanitizer there): each target runs once
without the tool on the sim device, to check the plumbing; with --sanitizer given
it runs under that program as on the GPU (tests/python/test_gpu_proof_script.py
gives it a stand-in). Exit status 0 when the stage passes.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import shlex
import time
from pathlib import Path

import skip_policy  # bench/gpu/skip_policy.py: which skips a GPU run accepts

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("memcheck", "racecheck", "synccheck")
CPP_TESTS = ("test_cuda_dequant", "test_cuda_lossless", "test_cuda_backend")
GTEST_EXCLUDE = "-*Large*:*Throughput*"
PARITY = "tests/python/test_parity_layers.py"
PARITY_STEP = ("test_resident_and_streamed_layers_in_one_model or "
               "test_trainable_lossless_weights_step_like_plain_ones")
OUR_KERNELS = "kns=layerstream"
ERROR_EXIT = 99
CAP_S = {"cpp": 120, "python": 200}  # one run at most; --deadline-s cuts it shorter
MIN_RUN_S = 10
# "ERROR SUMMARY: 3 errors" (memcheck, synccheck); "RACECHECK SUMMARY: 2 hazards
# displayed (1 error, 1 warning)" (racecheck).
SUMMARY = re.compile(r"(?:ERROR|RACECHECK) SUMMARY:.*?(\d+) errors?")
WARNINGS = re.compile(r"RACECHECK SUMMARY:.*?(\d+) warnings?")
UNSUPPORTED = re.compile(r"not supported|Unable to find injection library|unsupported", re.I)
# What racecheck printed on the H200 (run 5, 2026-12-04) when a kernel faulted under it.
HW_EXCEPTION = re.compile(r"failed to handle a hardware exception")


def find_sanitizer() -> str | None:
    cands = [shutil.which("compute-sanitizer")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cands += [f"{home}/bin/compute-sanitizer", f"{home}/compute-sanitizer/compute-sanitizer"]
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def targets(build_dir: Path, which: list[str], device: str, report: Path) -> list[dict]:
    """What runs under each tool: name, argv (writing a JUnit report to `report`),
    environment, kind ("cpp"/"python")."""
    out = []
    if "cpp" in which:
        for t in CPP_TESTS:
            exe = build_dir / "tests" / "cpp" / t
            out.append({"name": t, "kind": "cpp", "exe": exe, "env": {},
                        "argv": [str(exe), "--gtest_brief=1", f"--gtest_filter={GTEST_EXCLUDE}",
                                 f"--gtest_output=xml:{report}"]})
    if "python" in which:
        out.append({"name": "parity training step", "kind": "python", "exe": None,
                    "argv": [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", PARITY_STEP,
                             f"--junitxml={report}", str(ROOT / PARITY)],
                    "env": {"LS_TEST_DEVICE": device}})
    return out


def unexpected_skips(report: Path) -> list[str]:
    """The skips in a JUnit report that a GPU run may not accept (bench/gpu/skip_policy.py):
    a test that skipped "no CUDA device" under the tool proved nothing."""
    try:
        _, skips = skip_policy.skipped_tests(report.read_text())
    except (OSError, ValueError) as e:  # ET.ParseError is a ValueError
        return [f"no readable test report ({e})"]
    return [f"{name}: {reason}" for name, reason, _ in skip_policy.classify(skips, "gpu")]


def tool_args(tool: str, kind: str) -> list[str]:
    a = ["--tool", tool, "--error-exitcode", str(ERROR_EXIT), "--report-api-errors", "no"]
    if tool == "memcheck" and kind == "cpp":
        a += ["--leak-check", "full"]
    if tool != "memcheck" and kind == "python":
        a += ["--kernel-name", OUR_KERNELS]
    return a


def verdict(rc: int, text: str) -> tuple[str, int | None, int | None]:
    """(status, errors, warnings) of one run under the tool."""
    errors = [int(m) for m in SUMMARY.findall(text)]
    warnings = [int(m) for m in WARNINGS.findall(text)]
    if rc in (124, -9) and not errors:
        return "timed out", None, None
    if not errors:
        return ("unavailable" if UNSUPPORTED.search(text) else "no report"), None, None
    n, w = sum(errors), (sum(warnings) if warnings else None)
    if n > 0:
        return "errors", n, w
    return ("target failed" if rc != 0 else "clean"), 0, w


def run_one(argv: list[str], env: dict, timeout: float, log: Path) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, errors="replace", timeout=timeout)
        rc, text = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        rc, text = 124, (out.decode(errors="replace") if isinstance(out, bytes) else out)
    log.write_text(f"$ {shlex.join(argv)}\n{text}")
    return rc, text, time.monotonic() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", type=Path, required=True, help="holds tests/cpp/test_cuda_*")
    ap.add_argument("--logs", type=Path, required=True, help="folder for one log per run")
    ap.add_argument("--out-md", type=Path, help="the table, for results.md")
    ap.add_argument("--sanitizer", help="compute-sanitizer's path (default: PATH, $CUDA_HOME, /usr/local/cuda)")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--targets", default="cpp,python")
    ap.add_argument("--deadline-s", type=float, default=float(os.environ.get("LS_STAGE_DEADLINE_S") or 0),
                    help="wall time for all runs (0: none; default $LS_STAGE_DEADLINE_S)")
    ap.add_argument("--dry-run", action="store_true", help="the CPU: sim device, targets bare without a sanitizer")
    a = ap.parse_args(argv)
    tools = [t for t in a.tools.split(",") if t]
    bad = [t for t in tools if t not in TOOLS]
    which = [t for t in a.targets.split(",") if t]
    if bad or not set(which) <= {"cpp", "python"}:
        ap.error(f"tools are {', '.join(TOOLS)}; targets are cpp, python")
    a.logs.mkdir(parents=True, exist_ok=True)
    san = a.sanitizer or find_sanitizer()
    bare = san is None and a.dry_run
    rec = {"sanitizer": san, "mode": "bare (dry run: no compute-sanitizer)" if bare else "sanitizer",
           "version": None, "runs": []}
    if san is None and not bare:
        rec.update(status="unavailable", detail="compute-sanitizer not found (PATH, $CUDA_HOME/bin, "
                   "/usr/local/cuda/bin): the CUDA toolkit's compute-sanitizer is needed; pass --sanitizer PATH")
        return finish(rec, a)
    if san:
        try:
            rec["version"] = version_of(san)
        except (OSError, subprocess.SubprocessError) as e:
            rec.update(status="unavailable", detail=f"{san} --version failed: {e}")
            return finish(rec, a)
    rec["runs"], unavailable = run_all(a, san, tools, which)
    conclude(rec, unavailable)
    return finish(rec, a)


def version_of(san: str) -> str | None:
    v = subprocess.run([san, "--version"], capture_output=True, text=True, timeout=30)
    lines = v.stdout.strip().splitlines()
    return next((ln.strip() for ln in lines if "ersion" in ln), lines[-1] if lines else None)


def run_all(a, san: str | None, tools: list, which: list) -> tuple[list, str | None]:
    """Every tool over every target (once, bare, without a sanitizer): the runs, and why
    the tool is unavailable when it refused the device (the runs after are not tried)."""
    t0, bare = time.monotonic(), san is None
    runs, unavailable = [], None
    for tool in ([None] if bare else tools):
        for t in targets(a.build_dir, which, "sim" if a.dry_run else "cuda", a.logs / "report.xml"):
            r = {"tool": tool or "none", "target": t["name"]}
            runs.append(r)
            if t["exe"] is not None and not t["exe"].is_file():
                r.update(status="not built", detail=f"{t['exe']} does not exist (GoogleTest missing at the build?)")
                continue
            if unavailable:
                r.update(status="not run", detail=f"the tool is unavailable here ({unavailable})")
                continue
            env = dict(t["env"])
            if tool == "memcheck" and t["kind"] == "python":
                env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
            text = run_under(a, san, tool, t, env, t0, r)
            if r["status"] == "unavailable":
                unavailable = next((ln.strip("= ").strip() for ln in text.splitlines() if UNSUPPORTED.search(ln)),
                                   "refused")
            if HW_EXCEPTION.search(text):
                # Which kernel faulted, the tool does not say: with every launch waited for,
                # the error surfaces at the launch that faulted, named in the test's traceback.
                r["detail"] = ("the tool failed to handle a hardware exception (an illegal access in a kernel); "
                               "the next row runs it again with CUDA_LAUNCH_BLOCKING=1")
                again = {"tool": tool, "target": f"{t['name']} (CUDA_LAUNCH_BLOCKING=1)"}
                runs.append(again)
                run_under(a, san, tool, t, {**env, "CUDA_LAUNCH_BLOCKING": "1"}, t0, again)
    return runs, unavailable


def run_under(a, san: str | None, tool: str | None, t: dict, env: dict, t0: float, r: dict) -> str:
    """One target under one tool (bare without a sanitizer), if enough of --deadline-s
    (counted from t0) is left: fills the row `r` (status, errors, warnings, rc, seconds,
    log) and returns the run's output ("" when not run)."""
    left = a.deadline_s - (time.monotonic() - t0) if a.deadline_s > 0 else 1e9
    if left < MIN_RUN_S:
        r.update(status="not run", detail=f"{left:.0f} s left of --deadline-s {a.deadline_s:.0f}")
        return ""
    cmd = t["argv"] if san is None else [san, *tool_args(tool, t["kind"]), *t["argv"]]
    blocking = "-launch_blocking" if env.get("CUDA_LAUNCH_BLOCKING") else ""
    log = a.logs / f"{tool or 'bare'}-{t['name'].replace(' ', '_')}{blocking}.log"
    (a.logs / "report.xml").unlink(missing_ok=True)
    rc, text, secs = run_one(cmd, env, min(CAP_S[t["kind"]], left), log)
    r.update(rc=rc, seconds=round(secs, 1), log=log.name)
    if san is None:
        r["status"] = "ran bare" if rc == 0 else ("timed out" if rc == 124 else "target failed")
        return text
    r["status"], r["errors"], r["warnings"] = verdict(rc, text)
    if r["status"] == "clean" and not a.dry_run:
        skipped = unexpected_skips(a.logs / "report.xml")
        if skipped:
            r.update(status="unexpected skips", detail="; ".join(skipped[:3]))
    return text


def conclude(rec: dict, unavailable: str | None) -> None:
    """The stage's status and detail from its runs."""
    runs, bare = rec["runs"], rec["sanitizer"] is None
    not_good = [r for r in runs if r["status"] != ("ran bare" if bare else "clean")]
    if unavailable:
        rec["status"], rec["detail"] = "unavailable", f"{rec['sanitizer']}: {unavailable}: nothing proven on this machine"
    elif not_good:
        rec["status"] = "failed"
        rec["detail"] = "; ".join(f"{r['tool']} {r['target']}: {r['status']}"
                                  + (f" ({r['errors']} errors)" if r.get("errors") else "") for r in not_good)
    else:
        rec["status"] = "dry run" if bare else "passed"
        rec["detail"] = (f"{len(runs)} targets ran bare on sim (plumbing only; the tools run on the GPU machine)"
                         if bare else f"{len(runs)} runs, 0 errors")


def finish(rec: dict, a) -> int:
    print(json.dumps(rec, indent=2))
    if a.out_md:
        L = [f"compute-sanitizer: {rec['status']} — {rec.get('detail', '')}",
             f"(tool: {rec['sanitizer'] or 'none'}{'; ' + rec['version'] if rec.get('version') else ''})", ""]
        if rec["runs"]:
            L += ["| tool | target | status | errors | warnings | s |", "|---|---|---|---:|---:|---:|"]
            for r in rec["runs"]:
                L.append(f"| {r['tool']} | {r['target']} | {r['status']}"
                         f"{' — ' + r['detail'] if r.get('detail') else ''} | {r.get('errors', '')} | "
                         f"{'' if r.get('warnings') is None else r['warnings']} | {r.get('seconds', '')} |")
        a.out_md.write_text("\n".join(L) + "\n")
    return 0 if rec["status"] in ("passed", "dry run") else 1


if __name__ == "__main__":
    sys.exit(main())
