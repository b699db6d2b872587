"""Per-call overhead of a streamed Linear vs plain nn.Linear on the CPU (sim device).

Tiny shapes (batch 1 x 64 features) so that the time is the per-call cost of
the machinery, not the matmul. Prints time per call and the ratio to plain
nn.Linear, forward only (no_grad) and forward+backward (trainable weights).

    .venv/bin/python bench/bench_overhead.py [--seed-impl PATH] [--json]

--seed-impl: a copy of the original system (seed_layer.py), measured side by
side in the same run on its CPU path (never committed to this repo).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import layerstream  # noqa: E402


def time_per_call(fn, n: int, repeats: int = 5) -> float:
    for _ in range(max(50, n // 10)):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n)
    return statistics.median(runs) * 1e6  # microseconds


def load_seed(path):
    spec = importlib.util.spec_from_file_location("seed_layer_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _SeedManager:
    """The minimal manager object the original layer managers expect."""

    def __init__(self, device):
        self.process_device = torch.device(device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed-impl", help="path to a copy of the original seed_layer.py")
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    f, b = args.features, args.batch
    torch.manual_seed(0)

    systems = {}
    systems["plain nn.Linear"] = nn.Linear(f, f)
    m = nn.Linear(f, f)
    handles = [layerstream.offload(m, device="sim", checker=False)]
    systems["layerstream"] = m
    m2 = nn.Linear(f, f)
    handles.append(layerstream.offload(m2, device="sim", checker=False, cache_across_steps=True))
    systems["layerstream cache_across_steps"] = m2
    if args.seed_impl:
        seed = load_seed(args.seed_impl)
        m3 = nn.Linear(f, f)
        seed.LinearLayerMemoryManager.attach(m3, _SeedManager("cpu"))
        systems["original system (seed)"] = m3

    x = torch.randn(b, f)
    xg = torch.randn(b, f, requires_grad=True)
    rows = []
    for name, mod in systems.items():
        def fwd(mod=mod):
            with torch.no_grad():
                mod(x)

        def fwd_bwd(mod=mod):
            mod(xg).sum().backward()

        rows.append({"system": name,
                     "forward_us": time_per_call(fwd, args.calls),
                     "forward_backward_us": time_per_call(fwd_bwd, args.calls // 4)})
    base = rows[0]
    for r in rows:
        r["forward_ratio"] = r["forward_us"] / base["forward_us"]
        r["forward_backward_ratio"] = r["forward_backward_us"] / base["forward_backward_us"]
    if args.json:
        print(json.dumps({"batch": b, "features": f, "rows": rows}))
        return
    print(f"per-call overhead, Linear {f}->{f}, batch {b}, CPU (sim device), torch {torch.__version__}")
    print(f"{'system':34s} {'fwd us':>9s} {'ratio':>7s} {'fwd+bwd us':>11s} {'ratio':>7s}")
    for r in rows:
        print(f"{r['system']:34s} {r['forward_us']:9.2f} {r['forward_ratio']:7.2f} "
              f"{r['forward_backward_us']:11.2f} {r['forward_backward_ratio']:7.2f}")


if __name__ == "__main__":
    main()
