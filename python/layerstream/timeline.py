"""Draws a layerstream timeline (Chrome trace JSON) as a PNG with matplotlib."""
from __future__ import annotations

import json
from typing import Optional

_COLORS = {"compute": "#4c72b0", "transfer": "#dd8452", "grad": "#55a868", "stall": "#c44e52",
           "post-copy": "#937860"}


def plot_chrome_trace(trace_json: str, path: str, max_ms: Optional[float] = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(trace_json)
    events = data["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    slices = [e for e in events if e.get("ph") == "X"]
    steps = [e for e in events if e.get("ph") == "i"]
    t0 = min((e["ts"] for e in slices), default=0.0)
    order = sorted(lanes)
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * len(order)))
    for row, tid in enumerate(order):
        lane = lanes[tid]
        bars = [((e["ts"] - t0) / 1000.0, e["dur"] / 1000.0) for e in slices if e["tid"] == tid]
        if max_ms is not None:
            bars = [b for b in bars if b[0] <= max_ms]
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=_COLORS.get(lane, "#8172b3"))
    for e in steps:
        x = (e["ts"] - t0) / 1000.0
        if max_ms is None or x <= max_ms:
            ax.axvline(x, color="black", linewidth=0.5, alpha=0.4)
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([lanes[t] for t in order])
    ax.set_xlabel("time (ms)")
    ax.set_title("layerstream timeline (one lane per stream; vertical lines: step boundaries)")
    if max_ms is not None:
        ax.set_xlim(0, max_ms)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
