"""Draws `layerstream bench --json` output as a PNG with matplotlib (the CLI's
``bench --plot FILE`` runs this): the overlap ratio (step time over its ideal)
against the prefetch depth, one line per transfer/compute ratio, and, when
measured, the per-call overhead against plain PyTorch.

    python -m layerstream.bench_plot bench.json out.png

A file that is not that output, or an output path it cannot write, is refused
with one line on stderr and exit status 2.
"""
from __future__ import annotations

import json
import os
import sys

# The lists `layerstream bench --json` writes (tools/cli/cmd_bench.cpp), and
# what this module reads from each row of them.
SECTIONS = ("overlap", "overhead", "quant")
ROW_KEYS = {"overlap": ("transfer_over_compute", "prefetch", "overlap_ratio"),
            "overhead": ("system", "layers", "forward_ratio", "fwd_bwd_ratio")}
FORMATS = (".png", ".pdf", ".svg")  # as `bench --plot` accepts
AGAIN = "pass the unedited output of `layerstream bench --json`"


class InputError(Exception):
    """Bad input or output path: main() prints it as one line and exits 2."""


def load(path: str) -> dict:
    """`layerstream bench --json` output read from `path`, checked for what plot() reads."""
    try:
        with open(path) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        results = json.loads(text)
    except ValueError as e:
        raise InputError(f"{path} is not JSON ({e}); {AGAIN}") from None
    if not isinstance(results, dict) or not any(k in results for k in SECTIONS):
        raise InputError(f"{path} is not `layerstream bench --json` output (it has none of the lists "
                         f"{', '.join(SECTIONS)}); {AGAIN}")
    if not isinstance(results.get("overlap_config", {}), dict):
        raise InputError(f"{path}: overlap_config is not an object; {AGAIN}")
    for section in SECTIONS:
        rows = results.get(section, [])
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise InputError(f"{path}: {section} is not a list of objects; {AGAIN}")
        for i, row in enumerate(rows):
            bad = [k for k in ROW_KEYS.get(section, ()) if not _valid(k, row.get(k))]
            if bad:
                raise InputError(f"{path}: {section}[{i}] has no valid {', '.join(bad)}; {AGAIN}")
    return results


def _valid(key: str, value) -> bool:
    if key == "system":
        return isinstance(value, str)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_out(out: str) -> None:
    """Refuses an `out` matplotlib cannot write, before drawing."""
    if not out.lower().endswith(FORMATS):
        raise InputError(f"{out}: the output must end in {', '.join(FORMATS[:-1])} or {FORMATS[-1]}")
    folder = os.path.dirname(out) or "."
    if not os.path.isdir(folder):
        raise InputError(f"cannot write into {folder}: no such directory")
    if os.path.isdir(out):
        raise InputError(f"{out} is a directory; name a file")


def plot(results: dict, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker below)

    overhead = results.get("overhead") or []
    panels = 1 + bool(overhead)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    by_ratio: dict = {}
    for r in results.get("overlap", []):
        by_ratio.setdefault(r["transfer_over_compute"], []).append((r["prefetch"], r["overlap_ratio"]))
    for ratio, points in sorted(by_ratio.items()):
        points.sort()
        ax.plot([p for p, _ in points], [o for _, o in points], marker="o", label=f"transfer/compute {ratio:g}")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    cfg = results.get("overlap_config", {})
    ax.set_title(f"overlap on the sim device ({cfg.get('layers', '?')} layers, "
                 f"{cfg.get('compute_ms', '?')} ms compute each)")
    ax.set_xlabel("prefetch depth (layers in flight)")
    ax.set_ylabel("step time / max(compute, transfer)")
    if by_ratio:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "overlap not run", ha="center", transform=ax.transAxes)
    if overhead:
        ax = axes[0][1]
        names = [f"{r['system']} ({r['layers']} layers)" for r in overhead]
        ax.barh(names, [r["fwd_bwd_ratio"] for r in overhead], label="forward + backward")
        ax.barh(names, [r["forward_ratio"] for r in overhead], height=0.4, label="forward")
        ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_title("per-call overhead (Linear 64, batch 1, CPU)")
        ax.set_xlabel("time / plain PyTorch")
        ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise InputError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m layerstream.bench_plot BENCH.json OUT.png", file=sys.stderr)
        return 2
    try:
        results = load(argv[0])
        check_out(argv[1])
        plot(results, argv[1])
    except InputError as e:
        print(f"layerstream.bench_plot: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
