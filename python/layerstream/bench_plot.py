"""Draws `layerstream bench --json` output as a PNG with matplotlib (the CLI's
``bench --plot FILE`` runs this): the overlap ratio (step time over its ideal)
against the prefetch depth, one line per transfer/compute ratio, and, when
measured, the per-call overhead against plain PyTorch.

    python -m layerstream.bench_plot bench.json out.png
"""
from __future__ import annotations

import json
import sys


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
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m layerstream.bench_plot BENCH.json OUT.png", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        plot(json.load(f), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
