#!/usr/bin/env python3
"""Mutation audit: do the tests fail when the code is wrong?

Each entry of MUTATIONS (tools/mutations/, the catalogue) plants one plausible
bug: an exact, distinctive source snippet (the anchor) in one file is replaced.
For each mutation the harness copies the working tree into a scratch folder
(once; later runs only copy what changed), applies the mutation there, rebuilds
only what its tests need (one scratch build dir reused across mutations, so only
the changed file recompiles), runs the mutation's own short list of tests,
restores the file, and prints a table:

    caught     some listed test failed (what we want)
    survived   every listed test passed: a hole in the suite
    stale      the anchor is not in the file any more (the code moved: update
               the entry); never counted as caught
    ambiguous  the anchor occurs more than once
    no-build   the mutated tree does not compile (a bad mutation, not a catch)
    baseline   a listed test fails without the mutation (fix that first)

    python3 tools/mutate.py                   # every mutation
    python3 tools/mutate.py --list            # names, files, tests
    python3 tools/mutate.py -k slot -k bf16   # the mutations whose name contains these
    python3 tools/mutate.py --markdown docs/mutation-audit.md   # also write the table

Options: --scratch DIR (default /tmp/layerstream-mutate; keep it between runs:
the first run builds everything there, later ones are incremental),
--jobs N (build jobs), --no-baseline (skip the unmutated run of the tests).
A tool for us, not part of CI. Run from the repository root, after
tools/setup.sh (it uses .venv). Time: docs/mutation-audit.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutations import CONTROL, MUTATIONS, Mutation  # noqa: E402 - the catalogue beside this file

ROOT = Path(__file__).resolve().parents[1]


def sh(cmd, cwd, env=None, timeout=None, log=None):
    t0 = time.time()
    r = subprocess.run(cmd, cwd=cwd, env=env, shell=isinstance(cmd, str), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if log is not None:
        log.write(f"$ {cmd if isinstance(cmd, str) else ' '.join(map(str, cmd))}  ({time.time() - t0:.0f} s, rc {r.returncode})\n")
        log.write(r.stdout[-20000:] + "\n")
        log.flush()
    return r


def sync_tree(tree: Path):
    """Copies the working tree's tracked and untracked-but-not-ignored files into
    `tree`, only those whose bytes differ (unchanged files keep their mtimes, so the
    scratch build stays incremental), and removes files no longer listed: the GPU
    proof's gpu_sync_tree (bench/gpu/build_lib.sh), one copy of the rule."""
    subprocess.run(["bash", "-c", '. bench/gpu/build_lib.sh && gpu_sync_tree "$1"', "sync", str(tree)],
                   cwd=ROOT, check=True)
    venv = tree / ".venv"
    if not venv.exists():
        venv.symlink_to(ROOT / ".venv")


def targets_for(m: Mutation):
    t = set(m.extra_targets)
    for test in m.tests:
        kind, _, rest = test.partition(":")
        if kind == "py":
            t.add("_C")
            if "test_cli" in rest:
                t.add("layerstream")
        elif kind == "gtest":
            t.add(rest.split(":")[0])
    return sorted(t)


def run_tests(m: Mutation, tree: Path, build: Path, log, timeout: int) -> bool:
    """True when every listed test passes."""
    # Inductor's on-disk cache keys a graph by its code, not by what our operators'
    # fake kernels said of their outputs (strides): shared with other runs, a mutated
    # fake kernel's compiled graph could serve a later unmutated run (or the reverse,
    # hiding the mutation). So every run compiles into a cache of its own, emptied first.
    cache = tree.parent / "inductor-cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(tree / "python"), LS_BUILD_DIR=str(build),
               PATH=f"{tree / '.venv' / 'bin'}:{os.environ['PATH']}", TORCHINDUCTOR_CACHE_DIR=str(cache))
    py = [t.partition(":")[2] for t in m.tests if t.startswith("py:")]
    ok = True
    if py:
        r = sh([str(tree / ".venv/bin/python"), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *py],
               tree, env, timeout, log)
        ok &= r.returncode == 0
    for t in m.tests:
        kind, _, rest = t.partition(":")
        if kind == "gtest":
            binary, _, flt = rest.partition(":")
            r = sh([str(build / "tests/cpp" / binary), f"--gtest_filter={flt or '*'}", "--gtest_brief=1"],
                   tree, env, timeout, log)
            ok &= r.returncode == 0
        elif kind == "cmd":
            r = sh(rest, tree, env, timeout, log)
            ok &= r.returncode == 0
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", action="append", default=[], help="only mutations whose name contains this")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--scratch", default="/tmp/layerstream-mutate")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per build or test command")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--markdown", help="also write the result table (markdown) to this file")
    args = ap.parse_args()
    chosen = [m for m in MUTATIONS if not args.k or any(k in m.name for k in args.k)]
    if args.list:
        for m in chosen:
            print(f"{m.name:36} {m.file:36} {', '.join(m.tests)}")
        return 0
    scratch = Path(args.scratch).resolve()
    tree, build = scratch / "tree", scratch / "build"
    log = open(scratch.mkdir(parents=True, exist_ok=True) or scratch / "mutate.log", "a")
    t_start = time.time()
    print(f"[mutate] scratch {scratch} (log: {scratch / 'mutate.log'})", flush=True)
    sync_tree(tree)
    # Group the mutations by file (each C++ file then recompiles once per mutation,
    # and its restore is rebuilt by whichever later mutation needs it).
    chosen.sort(key=lambda m: (m.file, MUTATIONS.index(m)))
    all_targets = sorted({t for m in chosen for t in targets_for(m)})
    # One file recompiles per mutation: a unity build (CI's) would recompile half the library.
    env = dict(os.environ, LS_BUILD_DIR=str(build), LS_JOBS=str(args.jobs), LS_TARGETS=" ".join(all_targets),
               LS_UNITY_BUILD="0")
    t0 = time.time()
    r = sh(["bash", "tools/setup.sh"], tree, env, None, log)
    if r.returncode != 0:
        print(r.stdout[-3000:])
        print("[mutate] the unmutated scratch tree does not build", file=sys.stderr)
        return 2
    print(f"[mutate] scratch build ready ({time.time() - t0:.0f} s)", flush=True)
    baseline_bad = set()
    if not args.no_baseline:
        t0 = time.time()
        for m in chosen:
            if not run_tests(m, tree, build, log, args.timeout):
                baseline_bad.add(m.name)
        print(f"[mutate] baseline: {len(chosen) - len(baseline_bad)}/{len(chosen)} test lists pass unmutated "
              f"({time.time() - t0:.0f} s)", flush=True)
    rows = []
    for m in chosen:
        t0 = time.time()
        path = tree / m.file
        original = path.read_text()
        count = original.count(m.anchor)
        if m.name in baseline_bad:
            result = "baseline"
        elif count == 0:
            result = "stale"
        elif count > 1:
            result = "ambiguous"
        else:
            path.write_text(original.replace(m.anchor, m.replacement))
            try:
                targets = targets_for(m)
                b = sh(["cmake", "--build", str(build), "-j", str(args.jobs), "--target", *targets], tree,
                       None, args.timeout, log) if targets else None
                if b is not None and b.returncode != 0:
                    result = "no-build"
                else:
                    passed = run_tests(m, tree, build, log, args.timeout)
                    result = "survived" if passed else "caught"
            except subprocess.TimeoutExpired:
                result = "caught (timeout)"
            finally:
                path.write_text(original)  # a new mtime: the next build of its targets recompiles it
        secs = time.time() - t0
        rows.append((m, result, secs))
        print(f"[mutate] {m.name:36} {result:9} ({secs:.0f} s)", flush=True)
    total = time.time() - t_start
    lines = ["| mutation | file | planted bug | survived the issue-29 audit | result | tests run | s |",
             "|---|---|---|---|---|---|---:|"]
    for m, result, secs in rows:
        shown = result + (" (control: must survive)" if m.name in CONTROL else "")
        lines.append(f"| `{m.name}` | `{m.file}` | {m.why} | {'yes' if m.survived_before else 'no'} | "
                     f"{shown} | {'<br>'.join(f'`{t}`' for t in m.tests)} | {secs:.0f} |")
    good = all((r == "survived") if m.name in CONTROL else r.startswith("caught") for m, r, _ in rows)
    summary = (f"{sum(r.startswith('caught') for m, r, _ in rows if m.name not in CONTROL)} caught of "
               f"{sum(m.name not in CONTROL for m, _, _ in rows)} mutations (plus {len(CONTROL & {m.name for m, _, _ in rows})} "
               f"control); total {total / 60:.1f} min")
    print("\n".join(lines))
    print(summary)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n\n" + summary + "\n")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
