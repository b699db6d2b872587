"""The GPU proof's plumbing on the CPU: stages, the deadline, the record, the packing.

bench/gpu/run.sh runs its steps as stages under a deadline, bench/gpu/stages.py
writes the record, bench/gpu/device.sh packs a run for the remote GPU runner (which
returns at most 8 files). tools/test.sh runs the whole dry run; these tests pin
the behaviour a GPU session depends on and a dry run that succeeds cannot show:
a stage out of time is a failure that is recorded, not a silent omission.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"


def load_stages():
    spec = importlib.util.spec_from_file_location("ls_gpu_stages", GPU / "stages.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_sh(script, *args, env=None, timeout=240):
    e = dict(os.environ, PYTHONPATH=str(ROOT / "python"), **(env or {}))
    return subprocess.run(["bash", str(GPU / script), *map(str, args)], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=timeout)


def test_record_without_the_comparison(tmp_path):
    stages = load_stages()
    (tmp_path / "stages.tsv").write_text(
        "tests\tok\t10\t150\ttests.json\t3 passed\n"
        "compare\tnot selected\t0\t0\t\t\n"
        "full_ft\tok\t5\t100\tfull_ft.json\texit 0\n"
        "disk\ttimed out\t60\t60\tdisk.txt\texit 124\n"
        "nccl\tnot run\t0\t0\tnccl.json\t12 s left of --deadline-s 540 (needs 30)\n")
    (tmp_path / "full_ft.json").write_text('{"rows": [1]}\n')
    (tmp_path / "disk.txt").write_text("partial output\n")
    (tmp_path / "tests.json").write_text('{"status": "passed", "detail": "3 passed"}\n')
    rc = stages.summarize(tmp_path, {"status": "ok", "seconds": "3", "detail": "x"}, "run.sh OUT")
    assert rc == 1  # a stage that timed out or could not start fails the run
    res = json.loads((tmp_path / "results.json").read_text())
    assert [s["name"] for s in res["stages"]] == ["tests", "compare", "full_ft", "disk", "nccl"]
    assert [f.split(":")[0] for f in res["stage_failures"]] == ["disk", "nccl"]
    assert res["build"]["status"] == "ok" and res["tests"]["status"] == "passed"
    md = (tmp_path / "results.md").read_text()
    assert md.startswith("# GPU proof (bench/gpu/run.sh): the comparison did not run")
    assert "- GPU tests: passed — 3 passed" in md
    assert "| nccl | not run | 0 | 0 | 12 s left of --deadline-s 540 (needs 30) |" in md
    assert '{"rows": [1]}' in md and "partial output" in md  # each stage's output in its section
    assert "timed out: exit 124 (see disk.log)" in md
    assert stages.TITLES["compare"] not in md  # a stage not selected has no section


def test_record_appends_to_the_comparisons_results(tmp_path):
    stages = load_stages()
    (tmp_path / "results.json").write_text('{"schema": 1, "rows": [{"system": "resident"}], "failures": []}\n')
    (tmp_path / "results.md").write_text("# compare.py's table\n")
    (tmp_path / "stages.tsv").write_text("compare\tok\t20\t500\tresults.json\t8/8\n"
                                         "llama\tok\t30\t300\tllama.json\texit 0\n")
    (tmp_path / "llama.json").write_text('{"lora_step_ms": 1.0}\n')
    assert stages.summarize(tmp_path, {}, "c") == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["rows"] == [{"system": "resident"}] and res["stage_failures"] == []
    md = (tmp_path / "results.md").read_text()
    assert md.startswith("# compare.py's table\n") and '"lora_step_ms": 1.0' in md


def test_unknown_stage_is_refused_before_anything_runs(tmp_path):
    p = run_sh("run.sh", "--dry-run", tmp_path / "o", "--stages", "tests,nope")
    assert p.returncode == 2 and "unknown stage nope" in p.stderr
    p = run_sh("run.sh", "--dry-run", tmp_path / "o", "--stages", "nccl,tests,nccl")
    assert p.returncode == 2 and "stage nccl listed twice" in p.stderr
    assert not (tmp_path / "o").exists()
    assert not (tmp_path / "o" / "build.log").exists()


def test_a_stage_past_the_deadline_is_not_run_and_fails_the_run(tmp_path):
    out = tmp_path / "o"
    p = run_sh("run.sh", "--dry-run", out, "--stages", "nccl,disk", "--deadline-s", "1")
    assert p.returncode == 1, p.stdout + p.stderr
    rows = [line.split("\t") for line in (out / "stages.tsv").read_text().splitlines()]
    by = {r[0]: r for r in rows}
    # --stages' order first (the cheaper stages of a lease can go first), then the others
    assert [r[0] for r in rows] == ["nccl", "disk", "tests", "cpp", "compare", "llama", "full_ft", "compile",
                                    "activations", "moe_decode", "sanitize"]
    assert by["tests"][1] == "not selected" and by["compare"][1] == "not selected"
    assert by["nccl"][1] == "not run" and "--deadline-s 1" in by["nccl"][5]
    assert by["disk"][1] == "not run"
    assert not (out / "nccl.json").exists()


def test_device_script_packs_the_run_into_four_files(tmp_path):
    out = tmp_path / "OUT"
    p = run_sh("device.sh", "--deadline-s", "120", "--dry-run", "--stages", "nccl", env={"OUT": str(out)})
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(os.listdir(out)) == ["proof.tgz", "results.json", "results.md", "run.log"]
    with tarfile.open(out / "proof.tgz") as t:
        names = {Path(n).name for n in t.getnames()}
        tsv = t.extractfile(next(m for m in t.getmembers() if m.name.endswith("stages.tsv"))).read().decode()
    assert {"nccl.json", "nccl.log", "stages.tsv", "build.json", "run.log"} <= names
    assert "nccl\tok\t" in tsv
    res = json.loads((out / "results.json").read_text())
    nccl = next(s for s in res["stages"] if s["name"] == "nccl")
    assert nccl["status"] == "ok" and nccl["timeout_s"] <= 120
    assert res["stage_failures"] == []


def test_device_script_returns_no_results_of_an_earlier_run(tmp_path):
    """run.sh stops before writing results (here a bad --stages): OUT holds its log and
    the packed folder, not the results an earlier run left there."""
    out = tmp_path / "OUT"
    out.mkdir()
    for name in ("results.md", "results.json"):
        (out / name).write_text("from an earlier run\n")
    p = run_sh("device.sh", "--dry-run", "--stages", "nope", env={"OUT": str(out)})
    assert p.returncode == 2
    assert sorted(os.listdir(out)) == ["proof.tgz", "run.log"]
    assert "unknown stage nope" in (out / "run.log").read_text()


@pytest.mark.parametrize("bad", ["0", "ten"])
def test_device_script_wants_a_positive_deadline(tmp_path, bad):
    p = run_sh("device.sh", "--deadline-s", bad, env={"OUT": str(tmp_path)})
    assert p.returncode == 2 and "whole seconds" in p.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args,message", [(["--seed"], "unknown argument --seed"),
                                          (["--seed-impl", "/nonexistent/seed_layer.py"], "does not exist")])
def test_prepare_script_refuses_bad_arguments_before_changing_anything(args, message):
    before = sorted(os.listdir(ROOT))
    p = run_sh("prepare.sh", *args, "--no-fetch")
    assert p.returncode == 2 and message in p.stderr
    assert sorted(os.listdir(ROOT)) == before


def test_full_ft_skips_peers_past_the_stage_deadline_and_still_prints_its_rows():
    """bench/gpu/run.sh gives a stage's script LS_STAGE_DEADLINE_S: bench_full_ft.py
    skips the peers it cannot start in time, with that reason, and prints every row
    (killed by the stage's timeout instead, it would print none)."""
    e = dict(os.environ, PYTHONPATH=str(ROOT / "python"), LS_STAGE_DEADLINE_S="5")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_full_ft.py"), "--json"], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)["peers"]
    assert list(rows) == ["resident", "torch-host", "ls-after", "ls-overlap", "ls-lossless", "ds-zero2-offload",
                          "ds-zero3-offload"]
    assert all(r["skipped"] == "no time left of --deadline-s 5" for r in rows.values())


def test_full_ft_runs_the_peers_asked_for_with_the_reference(tmp_path):
    """run.sh --full-ft-peers LIST: bench_full_ft.py runs those and the resident reference
    (a session short of device time skips DeepSpeed's 100 s); an unknown peer is refused."""
    out = tmp_path / "o"
    p = run_sh("run.sh", "--dry-run", out, "--stages", "full_ft", "--full-ft-peers", "ls-after")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads((out / "full_ft.json").read_text())["peers"]
    assert list(rows) == ["resident", "ls-after"] and all("step_ms" in r for r in rows.values())
    assert "--full-ft-peers ls-after" in (out / "results.md").read_text()
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_full_ft.py"), "--peers", "ls-after,zero9"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--peers: unknown zero9" in p.stderr


# A stand-in for compute-sanitizer: records its arguments and environment, runs the
# target, then reports as FAKE_SAN tells it (the GPU machine's tool prints the same
# summary lines).
FAKE_SANITIZER = r"""#!/usr/bin/env bash
[ "$1" = --version ] && { echo "NVIDIA (R) Compute Sanitizer"; echo "Version 2099.1.0 (fake)"; exit 0; }
tool=""; args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tool) tool=$2; args+=("$1" "$2"); shift 2 ;;
    --error-exitcode|--leak-check|--kernel-name|--report-api-errors) args+=("$1" "$2"); shift 2 ;;
    *) break ;;
  esac
done
echo "${args[*]} | nocache=${PYTORCH_NO_CUDA_MEMORY_CACHING:-} | $1 | blocking=${CUDA_LAUNCH_BLOCKING:-}" >>"$FAKE_SAN_CALLS"
if [ "$FAKE_SAN" = unsupported ]; then echo "========= Error: Device not supported"; exit 1; fi
"$@"; rc=$?
n=0; [ "$FAKE_SAN" = errors ] && [ "$tool" = memcheck ] && { echo "========= Invalid __global__ read of size 4 bytes"; n=2; }
# hwexc: racecheck meets a kernel fault in the Python step, unless every launch is waited for.
if [ "$FAKE_SAN" = hwexc ] && [ "$tool" = racecheck ] && [ "$1" != "${1%python*}" ] && [ -z "${CUDA_LAUNCH_BLOCKING:-}" ]; then
  echo "========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception."; n=1
fi
if [ "$tool" = racecheck ]; then echo "========= RACECHECK SUMMARY: $n hazards displayed ($n errors, 0 warnings)"
else echo "========= ERROR SUMMARY: $n errors"; fi
[ $n -gt 0 ] && exit 99
exit $rc
"""


def sanitize(tmp_path, mode, *args):
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    e = dict(os.environ, PYTHONPATH=str(ROOT / "python"), FAKE_SAN=mode, FAKE_SAN_CALLS=str(calls))
    p = subprocess.run([sys.executable, str(GPU / "sanitize.py"), "--build-dir", str(ROOT / "build"),
                        "--logs", str(tmp_path / "logs"), "--out-md", str(tmp_path / "s.md"),
                        "--sanitizer", str(fake), *args], cwd=ROOT, env=e, capture_output=True, text=True,
                       timeout=180)
    rec = json.loads(p.stdout) if p.stdout.strip() else None
    lines = calls.read_text().splitlines() if calls.exists() else []
    return p, rec, lines


def test_sanitize_runs_every_tool_over_every_target_with_its_options(tmp_path):
    """Each tool over the C++ CUDA tests and the parity training step (on sim in a dry
    run): memcheck leak-checks the C++ tests and sees torch's allocations one by one;
    racecheck and synccheck look at layerstream's kernels in the Python step."""
    p, rec, calls = sanitize(tmp_path, "clean", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert rec["status"] == "passed" and rec["version"] == "Version 2099.1.0 (fake)"
    assert [(r["tool"], r["status"]) for r in rec["runs"]] == [
        (t, "clean") for t in ("memcheck", "racecheck", "synccheck") for _ in range(4)]
    assert len(calls) == 12
    mem_cpp, mem_py = calls[0], calls[3]
    assert "--leak-check full" in mem_cpp and "test_cuda_dequant" in mem_cpp
    assert all("--report-api-errors no" in c for c in calls)  # calls that fail on purpose (docstring)
    assert "nocache=1" in mem_py and "--kernel-name" not in mem_py
    assert all("--kernel-name kns=layerstream" in c and "nocache= " in c for c in (calls[7], calls[11]))
    assert all("--error-exitcode 99" in c for c in calls)
    assert "| synccheck | parity training step | clean | 0 |" in (tmp_path / "s.md").read_text()


def test_sanitize_reports_errors_and_fails(tmp_path):
    p, rec, _ = sanitize(tmp_path, "errors", "--dry-run", "--targets", "cpp", "--tools", "memcheck,synccheck")
    assert p.returncode == 1
    assert rec["status"] == "failed"
    assert [r["errors"] for r in rec["runs"]] == [2, 2, 2, 0, 0, 0]
    assert "memcheck test_cuda_dequant: errors (2 errors)" in rec["detail"]
    assert "Invalid __global__ read" in (tmp_path / "logs" / "memcheck-test_cuda_dequant.log").read_text()


def test_sanitize_runs_a_faulting_target_again_with_blocking_launches(tmp_path):
    """racecheck "failed to handle a hardware exception" in the Python step (as on the
    H200, run 5): the step runs once more under racecheck with CUDA_LAUNCH_BLOCKING=1, a
    row of its own; the first row stays an error, so the stage still fails."""
    p, rec, calls = sanitize(tmp_path, "hwexc", "--dry-run", "--targets", "python", "--tools", "racecheck")
    assert p.returncode == 1, p.stderr
    assert [(r["target"], r["status"]) for r in rec["runs"]] == [
        ("parity training step", "errors"), ("parity training step (CUDA_LAUNCH_BLOCKING=1)", "clean")]
    assert "hardware exception" in rec["runs"][0]["detail"]
    assert [c.rsplit("| blocking=", 1)[1] for c in calls] == ["", "1"]
    assert rec["runs"][1]["log"] == "racecheck-parity_training_step-launch_blocking.log"
    assert (tmp_path / "logs" / rec["runs"][1]["log"]).is_file()
    assert rec["detail"] == "racecheck parity training step: errors (1 errors)"


def test_sanitize_starts_no_run_past_its_deadline(tmp_path):
    """Less of --deadline-s left than a run needs: each run is "not run" (a failure), and
    the tool is never started."""
    p, rec, calls = sanitize(tmp_path, "clean", "--dry-run", "--targets", "cpp", "--tools", "memcheck",
                             "--deadline-s", "5")
    assert p.returncode == 1 and calls == []
    assert [r["status"] for r in rec["runs"]] == ["not run"] * 3
    assert rec["runs"][0]["detail"].endswith("s left of --deadline-s 5")


def test_sanitize_on_a_device_the_tool_refuses_proves_nothing_and_says_so(tmp_path):
    p, rec, calls = sanitize(tmp_path, "unsupported", "--dry-run", "--targets", "cpp")
    assert p.returncode == 1 and len(calls) == 1  # the runs after the first refusal are not tried
    assert rec["status"] == "unavailable" and "Device not supported" in rec["detail"]
    assert [r["status"] for r in rec["runs"]][:2] == ["unavailable", "not run"]


def test_sanitize_counts_a_test_skipped_under_the_tool_as_a_failure(tmp_path):
    """Not a dry run: the C++ CUDA tests skip here ("no CUDA device available"), as they
    would if the tool hid the GPU: a clean report over skipped tests proves nothing."""
    p, rec, _ = sanitize(tmp_path, "clean", "--targets", "cpp", "--tools", "memcheck")
    assert p.returncode == 1
    assert {r["status"] for r in rec["runs"]} == {"unexpected skips"}
    assert "no CUDA device" in rec["runs"][0]["detail"]


def test_sanitize_without_the_tool_on_the_gpu_machine_fails_clearly(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(GPU))
    spec = importlib.util.spec_from_file_location("ls_gpu_sanitize", GPU / "sanitize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "find_sanitizer", lambda: None)  # whatever this machine has
    rc = mod.main(["--build-dir", str(ROOT / "build"), "--logs", str(tmp_path / "logs")])
    rec = json.loads(capsys.readouterr().out)
    assert rc == 1 and rec["status"] == "unavailable" and rec["runs"] == []
    assert "compute-sanitizer not found" in rec["detail"] and "--sanitizer PATH" in rec["detail"]

def load_compare():
    spec = importlib.util.spec_from_file_location("ls_gpu_compare", GPU / "compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(system, regime, mode, ms, **kw):
    return {"system": system, "regime": regime, "mode": mode, "tokens": 512, "status": "ok", "step_ms": ms, **kw}


def test_results_md_shows_the_lossless_decode_by_block_size(tmp_path):
    """run.sh's cpp stage reads test_cuda_lossless's "[ lossless sweep ]" lines (the
    decoder's time per block size, checking lossless::default_block_elems' rule on a
    GPU); results.md shows them per weight shape. On run 4's record (which has none)."""
    cmp = load_compare()
    res = json.loads((GPU / "results" / "2026-11-30-h200-run4" / "results.json").read_text())
    cpp = res["tests"]["cpp"]
    cpp["lossless_sweep"] = [
        {"rows": 4096, "cols": 4096, "block": 512, "default": True, "ms": 0.2, "output_gbps": 168.0,
         "coded_ratio": 0.672},
        {"rows": 4096, "cols": 4096, "block": 4096, "default": False, "ms": 1.3, "output_gbps": 25.8,
         "coded_ratio": 0.6635}]
    cmp.write_md(res, tmp_path / "r.md")
    md = (tmp_path / "r.md").read_text()
    assert ("- lossless decode by block size, 4096×4096 bf16: 512 (default) 0.200 ms (0.6720 of raw); "
            "4096 1.300 ms (0.6635 of raw)") in md
    del cpp["lossless_sweep"]
    cmp.write_md(res, tmp_path / "r.md")
    assert "by block size" not in (tmp_path / "r.md").read_text()


def test_compare_judges_rows_by_the_second_proofs_targets_and_names_the_peers_ahead():
    """Issue 27: compute-bound <= 1.05x resident (training and inference), transfer-bound
    >= 90% of the pinned peak, and for every peer as fast or faster a reason from the
    numbers: fewer bytes moved, or the link used better."""
    cmp = load_compare()
    W = 10 << 30  # weight bytes
    rows = [_row("resident", "compute", "infer", 100.0), _row("layerstream", "compute", "infer", 104.0,
                                                               h2d_bytes_per_step=W),
            _row("resident", "compute", "train", 200.0), _row("layerstream", "compute", "train", 212.0,
                                                               h2d_bytes_per_step=2 * W),
            _row("resident", "transfer", "train", 10.0),
            _row("layerstream", "transfer", "train", 500.0, h2d_bytes_per_step=2 * W),   # 2W in 0.5 s
            _row("layerstream-all-streamed", "transfer", "train", 520.0, h2d_bytes_per_step=2 * W),
            _row("ramtorch", "transfer", "train", 505.0),     # 2W: as many bytes, a little slower
            _row("seed", "transfer", "train", 450.0),         # 2W: as many bytes, faster
            _row("diffusers-group", "transfer", "train", 300.0)]  # 1W: fewer bytes
    metas = {s: {"weight_bytes": W} for s in ("ramtorch", "seed", "diffusers-group")}
    peak = 2 * W / 0.5 / 1e9 / 0.92  # layerstream at 92% of the peak
    cmp.derive(rows, {"pinned_peak_gbps": peak}, metas, dry=False)
    by = {(r["system"], r["regime"], r["mode"]): r for r in rows}
    checks = {k: {c["name"]: c["pass"] for c in r["checks"]} for k, r in by.items() if r["system"] == "layerstream"}
    assert checks[("layerstream", "compute", "infer")]["<= 1.05x resident"] is True
    assert checks[("layerstream", "compute", "train")]["<= 1.05x resident"] is False  # 1.06x
    assert checks[("layerstream", "transfer", "train")][">= 90% pinned peak"] is True
    assert checks[("layerstream", "transfer", "train")]["faster than ramtorch"] is True
    behind = {(n["system"], n["peer"]): n["reason"] for n in cmp.not_ahead(rows, dry=False)}
    assert set(behind) == {("layerstream", "seed"), ("layerstream", "diffusers-group"),
                           ("layerstream-all-streamed", "seed"), ("layerstream-all-streamed", "diffusers-group"),
                           ("layerstream-all-streamed", "ramtorch")}
    assert "fewer bytes" in behind[("layerstream", "diffusers-group")]
    assert "used the link better" in behind[("layerstream", "seed")]
    assert cmp.not_ahead(rows, dry=True) == []  # a dry run's timings compare nothing
    cmp.derive(rows, {"pinned_peak_gbps": peak}, metas, dry=True)
    assert {c["pass"] for r in rows if r["system"] == "layerstream" for c in r["checks"]
            if "resident" in c["name"] or "peak" in c["name"] or "faster" in c["name"]} == {None}


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    """pid has ended (or is a zombie waiting for init to reap it) within wait_s."""
    for _ in range(int(wait_s * 10)):
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z":
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.1)
    return False


def _hanging_peer(pidfile) -> str:
    """A peer that starts a child (a compiler, say), records its pid and hangs."""
    return ("import subprocess, time\n"
            f"p = subprocess.Popen(['sleep', '60']); open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(60)\n")


def test_a_peer_past_its_timeout_is_killed_with_the_processes_it_started(tmp_path):
    """bench/peer_process.py: a peer that started a compiler (here a sleep standing in for
    it) and hangs is killed with it, so that nothing it left holds a lock or a core."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from peer_process import run_peer_process
    finally:
        sys.path.pop(0)
    pidfile = tmp_path / "child.pid"
    row = run_peer_process([sys.executable, "-c", _hanging_peer(pidfile)], "hang", timeout=3)
    assert row == {"peer": "hang", "error": "did not finish in 3 s", "timed_out": True}
    assert _gone(int(pidfile.read_text())), "the peer's child is still running"
    assert run_peer_process([sys.executable, "-c", "import json; print(json.dumps({'x': 1}))"], "ok") == {"x": 1}


def test_a_peer_that_crashes_says_where_in_its_error_row(tmp_path, capsys):
    """A peer killed by SIGSEGV: its error row quotes the Python stack faulthandler printed
    (the file and line of the call that crashed), not only the exit status; the benchmark's
    stderr (its stage's log) has the whole of the peer's, with the native stack that
    layerstream's module printed first (core/crash_report.h: LS_NATIVE_BACKTRACE=1)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from peer_process import run_peer_process
    finally:
        sys.path.pop(0)
    script = tmp_path / "crashing_peer.py"
    script.write_text("import ctypes\nimport layerstream\n\ndef crash():\n    ctypes.string_at(0)\n\ncrash()\n")
    row = run_peer_process([sys.executable, str(script)], "crash")
    assert row["peer"] == "crash" and row["error"].startswith("exit -11: "), row
    assert "Segmentation fault" in row["error"] and f'File "{script}", line 5 in crash' in row["error"], row
    err = capsys.readouterr().err
    native = err.index("layerstream: fatal signal 11 (SIGSEGV) at address 0x0; native stack")
    assert native < err.index("Fatal Python error: Segmentation fault"), err
    assert re.search(r"^  #\d+ \S*libc\.so\.6\+0x[0-9a-f]+", err, re.M), err  # a frame of the crash


def test_a_benchmark_stopped_by_sigterm_takes_its_running_peers_with_it(tmp_path):
    """A peer runs in a session of its own, so a stage timeout's SIGTERM to the benchmark
    does not reach it: the benchmark kills its running peers' sessions before it ends."""
    pidfile = tmp_path / "child.pid"
    bench = (f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r})\n"
             "from peer_process import run_peer_process\n"
             f"run_peer_process([sys.executable, '-c', {_hanging_peer(pidfile)!r}], 'hang', timeout=60)\n")
    parent = subprocess.Popen([sys.executable, "-c", bench])
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.1)
    parent.terminate()
    assert parent.wait(timeout=20) == -15
    assert _gone(int(pidfile.read_text())), "the peer's child outlived the benchmark"


def test_compare_judges_an_earlier_calls_rows_with_this_ones():
    """--merge: the comparison over two device calls. Rows of systems not run now come
    from the earlier call's results (the same model and work, else a clear error) and
    are judged again with this call's: layerstream measured in the first call against
    the seed measured in the second."""
    cmp = load_compare()
    cfg = {k: 1 for k in cmp.SAME_WORK}
    first = {"date": "d1", "config": dict(cfg), "metas": {"layerstream": {"budget_bytes": None}},
             "systems": {"resident": {"status": "ok"}, "layerstream": {"status": "ok"}},
             "rows": [_row("resident", "transfer", "train", 10.0, verdict="old"),
                      _row("layerstream", "transfer", "train", 500.0, h2d_bytes_per_step=2 << 30, checks=["old"]),
                      {"system": "ramtorch", "regime": "transfer", "mode": "train", "status": "skipped"}]}
    with pytest.raises(ValueError, match="another model or work \\(dim: 2 there, 1 here\\)"):
        cmp.load_merges_from([("f.json", {**first, "config": {**cfg, "dim": 2}})], cfg)
    with pytest.raises(ValueError, match="no comparison rows"):
        cmp.load_merges_from([("f.json", {"stages": []})], cfg)
    merges = cmp.load_merges_from([("f.json", first)], cfg)
    systems, metas = {"seed": {"status": "ok"}}, {"seed": {"weight_bytes": 1 << 30}}
    rows = [_row("seed", "transfer", "train", 600.0)]
    cmp.merge_rows(merges, ["seed"], systems, metas, rows)
    assert [r["system"] for r in rows] == ["seed", "resident", "layerstream"]  # not the skipped ramtorch
    assert systems["layerstream"]["merged_from"] == "f.json (d1)" and "budget_bytes" in metas["layerstream"]
    cmp.derive(rows, {"pinned_peak_gbps": 5.0}, metas, dry=False)
    ls = rows[2]
    assert ls["merged_from"] == "d1" and "old" not in ls["checks"]
    assert {c["name"]: c["pass"] for c in ls["checks"]}["faster than seed"] is True
    assert rows[1]["verdict"] == "—"  # judged again, not the earlier call's


def test_device_script_keeps_a_comparing_calls_results_for_the_next(tmp_path):
    out, keep = tmp_path / "OUT", tmp_path / "keep"
    p = run_sh("device.sh", "--deadline-s", "200", "--dry-run", "--stages", "compare", "--", "--systems",
               "resident", env={"OUT": str(out), "LS_PROOF_KEEP": str(keep)})
    assert p.returncode == 0, p.stdout + p.stderr
    kept = json.loads((keep / "last-results.json").read_text())
    assert kept == json.loads((out / "results.json").read_text())
    assert {r["system"] for r in kept["rows"]} == {"resident"}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def _checkout_copy(dest: Path) -> Path:
    """What the build stamp reads and the module needs, copied without build outputs (the
    checkout may be a copy without git, as tools/other_torch.sh makes)."""
    skip = shutil.ignore_patterns("__pycache__", "_C*.so", "_build_info.py", "results")
    for name in ("CMakeLists.txt", "cmake", "csrc", "bench", "tests/cpp", "tools/cli", "examples", "python"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=skip)
        else:
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def _build_lib(tree: Path, script: str, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(["bash", "-c", f". bench/gpu/build_lib.sh && {script}", "build_lib", *map(str, args)],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def test_a_prebuilt_build_serves_only_the_sources_and_python_it_was_made_for(tmp_path):
    """bench/gpu/prebuild.sh packs a build into .prebuilt/ with a stamp; run.sh uses it
    (gpu_use_prebuilt) only when the checkout's C++ sources, the Python minor version and
    torch are the ones it was made for, and leaves nothing of it in place otherwise."""
    import torch

    tree = _checkout_copy(tmp_path / "tree")
    py = sys.executable
    outs = _build_lib(tree, 'gpu_build_outputs "$1"', py).stdout.split()
    assert f"python/layerstream/_C{sysconfig.get_config_var('EXT_SUFFIX')}" in outs
    assert "build-gpu/tests/cpp/test_cuda_backend" in outs
    pre = tree / ".prebuilt"
    for o in outs:
        (pre / o).parent.mkdir(parents=True, exist_ok=True)
        if o.startswith("python/"):  # the module this checkout built, for this python and torch
            shutil.copy2(ROOT / o, pre / o)
        else:  # stands in for a C++ binary (it only has to start)
            (pre / o).write_text("#!/bin/sh\nexit 0\n")
            (pre / o).chmod(0o755)
    stamp = _build_lib(tree, 'gpu_build_stamp "$1"', py).stdout.strip()
    assert stamp.endswith(f"python {sys.version_info[0]}.{sys.version_info[1]}; torch {torch.__version__}; "
                          f"CUDA arch 90"), stamp
    (pre / "stamp").write_text(stamp + "\n")

    def use():
        p = _build_lib(tree, 'gpu_use_prebuilt "$1" "$2"', py, tmp_path / "build.log")
        placed = [o for o in outs if (tree / o).exists()]
        for o in placed:
            (tree / o).unlink()
        return p, placed

    p, placed = use()
    assert p.returncode == 0 and placed == outs, p.stdout + p.stderr
    # Python files are not compiled: the same build serves.
    for name in ("python/layerstream/_offload.py", "bench/bench_full_ft.py"):
        (tree / name).write_text((tree / name).read_text() + "#\n")
    p, placed = use()
    assert p.returncode == 0 and placed == outs, p.stdout + p.stderr
    # A C++ source changed since: the stamp differs, nothing is placed, the run builds.
    planner = tree / "csrc/core/planner.cpp"
    planner.write_text(planner.read_text() + "// changed\n")
    p, placed = use()
    assert p.returncode == 1 and "prebuilt not used: it was made for" in p.stdout and placed == []
    shutil.copy2(ROOT / "csrc/core/planner.cpp", planner)
    # A module that does not load: taken out again.
    (pre / outs[0]).write_bytes(b"not a shared object")
    p, placed = use()
    assert p.returncode == 1 and "does not load here" in p.stdout and placed == [], p.stdout


def test_prebuild_wants_the_gpu_machines_python(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 3.9\n")
    fake.chmod(0o755)
    p = run_sh("prebuild.sh", "--python", fake)
    assert p.returncode == 2 and "is Python 3.9; the GPU machine runs 3.12" in p.stderr, p.stderr
    assert not (ROOT / ".prebuilt.new").exists()


def test_the_tree_copy_remakes_what_changed_even_to_an_older_version(tmp_path):
    """gpu_sync_tree (prebuild.sh, tools/other_torch.sh): DEST keeps its build between runs,
    so a file whose content changed must look newer than the build, also when it went back
    to older content with an older time; a file gone from the tree goes from DEST."""
    repo, dest = tmp_path / "repo", tmp_path / "dest"
    (repo / "csrc").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "csrc" / "a.cpp").write_text("int a = 1;\n")
    (repo / "csrc" / "b.cpp").write_text("int b = 1;\n")
    (repo / ".gitignore").write_text("/build/\n")
    (repo / "build").mkdir()
    (repo / "build" / "out.o").write_text("ignored\n")
    sync = [str(Path(GPU / "build_lib.sh")), str(dest)]

    def run():
        subprocess.run(["bash", "-c", '. "$1" && gpu_sync_tree "$2"', "sync", *sync], cwd=repo, check=True,
                       timeout=60)

    run()
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == [
        ".gitignore", ".tree-files", "csrc/a.cpp", "csrc/b.cpp"]
    built = time.time()
    (repo / "csrc" / "a.cpp").write_text("int a = 0;\n")  # back to "an older version" ...
    os.utime(repo / "csrc" / "a.cpp", (built - 1000, built - 1000))  # ... with its older time
    (repo / "csrc" / "b.cpp").unlink()
    run()
    assert (dest / "csrc" / "a.cpp").read_text() == "int a = 0;\n"
    assert (dest / "csrc" / "a.cpp").stat().st_mtime >= built - 1  # newer than what was built from it
    assert not (dest / "csrc" / "b.cpp").exists()
