"""Two builds of layerstream side by side, in one run: the per-call overhead
(bench/bench_overhead.py) and the sim overlap benchmark (`layerstream bench
--only overlap`), each build in its own processes, old and new alternating
round by round so that the machine's drift hits both alike.

    .venv/bin/python bench/compare_builds.py --old-python OLD/python --old-cli OLD/build/layerstream
        [--rounds 3] [--calls 2000] [--json]

--old-python: the python/ folder of the other build (its layerstream package
with its _C extension); --old-cli: that build's `layerstream` executable
(a core-only build is enough: the overlap benchmark needs no LibTorch).
Prints, per row, old and new medians over the rounds and new / old.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def overhead(python_dir: str, calls: int) -> dict:
    # The package under python_dir is imported first; bench_overhead.py's own
    # `import layerstream` then finds it in sys.modules.
    code = ("import sys, runpy; sys.path.insert(0, sys.argv[1]); import layerstream; "
            "sys.argv = [sys.argv[2], '--json', '--calls', sys.argv[3], '--rounds', '5']; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code, python_dir, os.path.join(ROOT, "bench", "bench_overhead.py"),
                          str(calls)], check=True, capture_output=True, text=True).stdout
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    return {f"overhead {r['system']} x{r['layers']} {mode}": r[mode]
            for r in rows if r["system"] == "layerstream"
            for mode in ("forward_us", "fwd_bwd_frozen_us", "fwd_bwd_trainable_us")}


def overlap(cli: str) -> dict:
    out = subprocess.run([cli, "bench", "--only", "overlap", "--json"], check=True, capture_output=True,
                         text=True).stdout
    return {f"overlap t/c={r['transfer_over_compute']} prefetch={r['prefetch']} ratio": r["overlap_ratio"]
            for r in json.loads(out)["overlap"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-python", required=True)
    ap.add_argument("--old-cli", required=True)
    ap.add_argument("--new-python", default=os.path.join(ROOT, "python"))
    ap.add_argument("--new-cli", default=os.path.join(ROOT, "build", "layerstream"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    runs = {"old": [], "new": []}
    for i in range(args.rounds):
        order = ("old", "new") if i % 2 == 0 else ("new", "old")
        for which in order:
            py, cli = (args.old_python, args.old_cli) if which == "old" else (args.new_python, args.new_cli)
            m = overhead(py, args.calls)
            m.update(overlap(cli))
            runs[which].append(m)
            print(f"round {i + 1}/{args.rounds}: {which} done", file=sys.stderr)
    keys = list(runs["new"][0])
    table = []
    for k in keys:
        old = statistics.median(r[k] for r in runs["old"])
        new = statistics.median(r[k] for r in runs["new"])
        table.append({"row": k, "old": old, "new": new, "new_over_old": new / old if old else float("nan")})
    if args.json:
        print(json.dumps({"rounds": args.rounds, "rows": table}))
        return
    print(f"{'row':58s} {'old':>9s} {'new':>9s} {'new/old':>8s}   (median of {args.rounds} alternating rounds)")
    for t in table:
        print(f"{t['row']:58s} {t['old']:9.3f} {t['new']:9.3f} {t['new_over_old']:8.2f}")


if __name__ == "__main__":
    main()
