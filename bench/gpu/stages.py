"""The GPU proof's stage record: what ran, how long, what it wrote.

bench/gpu/run.sh runs every step after the build as a *stage* (tests, cpp,
compare, llama, full_ft, ...), each selected by --stages and given at most what
is left of --deadline-s. It appends one line per stage to OUTDIR/stages.tsv:

    name <TAB> status <TAB> seconds <TAB> timeout_s <TAB> file <TAB> detail

status: "ok", "failed" (non-zero exit), "timed out", "not run" (too little time
left: a failure), "not selected" (left out by --stages: not a failure).

`python stages.py OUTDIR --build-json FILE --command CMD` then writes the
record into OUTDIR/results.json ("stages", "build", "tests"; created when
compare.py did not run) and OUTDIR/results.md (created likewise: the build and
test lines, the stage table, then one section per stage that wrote a file).
Exit status 1 when a selected stage did not end "ok".

Tests: tests/python/test_gpu_proof_script.py.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# What each stage measures, for its section title in results.md.
TITLES = {
    "tests": "GPU parity tests (tests/python/test_parity_layers.py)",
    "cpp": "C++ CUDA tests and bench_quant",
    "compare": "The comparison (bench/gpu/compare.py)",
    "llama": "Llama-3-8B shape, LoRA training and greedy decoding (bench/bench_llama.py)",
    "full_ft": "Full fine-tuning, host optimizer vs resident (bench/bench_full_ft.py)",
    "compile": "torch.compile: streamed vs resident (bench/bench_compile.py)",
    "activations": "Activation offload (bench/bench_activations.py)",
    "disk": "The disk tier (bench/bench_disk.py)",
    "nccl": "Process group, one NCCL rank (bench/gpu/nccl_one_rank.py)",
    "moe_decode": "MoE decoding: every expert vs the routed ones, plain and lossless (bench/bench_moe_decode.py)",
    "sanitize": "compute-sanitizer over the C++ CUDA tests and a streamed training step (bench/gpu/sanitize.py)",
}
# Stages whose results are already in results.md (compare.py writes it; the
# tests and cpp lines are in its header).
IN_HEADER = {"tests", "cpp", "compare"}
OK, NOT_SELECTED = "ok", "not selected"


def read_tsv(path: Path) -> list[dict]:
    stages = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        name, status, seconds, timeout, file, detail = (line.split("\t") + [""] * 6)[:6]
        stages.append({"name": name, "status": status, "seconds": int(seconds or 0),
                       "timeout_s": int(timeout or 0), "file": file, "detail": detail})
    return stages


def section(out: Path, st: dict) -> list[str]:
    """One stage's section: the markdown it wrote (e.g. moe_decode.md), else its output file fenced."""
    L = ["", f"## {TITLES.get(st['name'], st['name'])}", ""]
    md = out / f"{st['name']}.md"
    f = out / st["file"] if st["file"] else None
    if st["status"] != OK:
        L.append(f"{st['status']}: {st['detail']}" + (f" (see {st['name']}.log)" if st["status"] != "not run" else ""))
    if md.is_file() and md.stat().st_size:
        L.append(md.read_text().rstrip())
    elif f and f.is_file() and f.stat().st_size:
        L += ["```" + ("json" if f.suffix == ".json" else ""), f.read_text().rstrip(), "```"]
    elif st["status"] == OK:
        L.append(f"(wrote nothing to {st['file']})")
    return L


def summarize(out: Path, build: dict, command: str) -> int:
    stages = read_tsv(out / "stages.tsv") if (out / "stages.tsv").is_file() else []
    bad = [s for s in stages if s["status"] not in (OK, NOT_SELECTED)]
    res_path, md_path = out / "results.json", out / "results.md"
    try:
        res = json.loads(res_path.read_text())
    except (OSError, ValueError):
        res = None
    if res is None:  # compare.py did not run (not selected, out of time, or it crashed)
        try:
            tests = json.loads((out / "tests.json").read_text())
        except (OSError, ValueError):
            tests = {"status": "not run"}
        res = {"schema": 1, "command": command, "build": build, "tests": tests, "rows": [],
               "failures": [f"compare: {s['status']}" for s in stages if s["name"] == "compare"
                            and s["status"] not in (OK, NOT_SELECTED)]}
        cpp = tests.get("cpp") or {}
        md_path.write_text("\n".join([
            "# GPU proof (bench/gpu/run.sh): the comparison did not run", "",
            f"- command: `{command}`",
            f"- build: {build.get('status', '?')} ({build.get('seconds', '?')} s) {build.get('detail', '')}".rstrip(),
            f"- GPU tests: {tests.get('status', '?')}" + (f" — {tests['detail']}" if tests.get("detail") else ""),
            f"- C++ CUDA tests: {cpp.get('status', 'not run')}" + (f" — {cpp['detail']}" if cpp.get("detail") else ""),
        ]) + "\n")
    res["stages"] = stages
    res["stage_failures"] = [f"{s['name']}: {s['status']} {s['detail']}".strip() for s in bad]
    res_path.write_text(json.dumps(res, indent=2) + "\n")
    L = ["", "## Stages (bench/gpu/run.sh)", "", "| stage | status | seconds | timeout s | detail |",
         "|---|---|---:|---:|---|"]
    L += [f"| {s['name']} | {s['status']} | {s['seconds']} | {s['timeout_s']} | {s['detail']} |" for s in stages]
    for s in stages:
        if s["name"] not in IN_HEADER and s["status"] != NOT_SELECTED:
            L += section(out, s)
    with open(md_path, "a") as f:
        f.write("\n".join(L) + "\n")
    for s in bad:
        print(f"[gpu-proof] stage {s['name']}: {s['status']} {s['detail']}".rstrip())
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--build-json", help="the build's status, seconds and detail (run.sh writes build.json)")
    ap.add_argument("--command", default="bench/gpu/run.sh")
    a = ap.parse_args(argv)
    if not a.out:
        ap.error("OUTDIR is required")
    build = {}
    if a.build_json:
        try:
            build = json.loads(Path(a.build_json).read_text())
        except (OSError, ValueError) as e:
            build = {"status": "unknown", "detail": f"cannot read {a.build_json}: {e}"}
    return summarize(Path(a.out), build, a.command)


if __name__ == "__main__":
    sys.exit(main())
