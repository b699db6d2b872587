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
    for _ in range(max(5, n // 20)):
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
    ap.add_argument("--sim-link-gbps", type=float, default=0.0,
                    help="simulated link bandwidth (0 = infinite: measure the machinery, not the link)")
    ap.add_argument("--sim-latency-us", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=9,
                    help="interleaved measurement rounds (ratios are medians over rounds)")
    ap.add_argument("--stack", type=int, default=8,
                    help="layers in the stacked case (cost reported per layer)")
    args = ap.parse_args()
    sim = dict(device="sim", checker=False, sim_link_gbps=args.sim_link_gbps,
               sim_latency_us=args.sim_latency_us)
    torch.set_num_threads(1)
    f, b = args.features, args.batch
    torch.manual_seed(0)

    seed = load_seed(args.seed_impl) if args.seed_impl else None

    def build(system, layers):
        mod = nn.Sequential(*[nn.Linear(f, f) for _ in range(layers)])
        handle = None
        if system == "layerstream":
            handle = layerstream.offload(mod, **sim)
        elif system == "layerstream cache_across_steps":
            handle = layerstream.offload(mod, cache_across_steps=True, **sim)
        elif system == "original system (seed)":
            for lin in mod:
                seed.LinearLayerMemoryManager.attach(lin, _SeedManager("cpu"))
        return mod, handle

    systems = ["plain nn.Linear", "layerstream", "layerstream cache_across_steps"]
    if seed is not None:
        systems.append("original system (seed)")
    x = torch.randn(b, f)
    xg = torch.randn(b, f, requires_grad=True)

    def fwd(mod):
        with torch.no_grad():
            mod(x)

    def fwd_bwd(mod):
        mod(xg).sum().backward()

    # Systems are measured interleaved, round by round, and each ratio is the
    # median over rounds of (system time / plain time in the same round): the
    # machine's drift hits both sides of every ratio alike.
    rows = []
    for layers in (1, args.stack):
        mods = {name: build(name, layers)[0] for name in systems}
        results = {name: {"system": name, "layers": layers} for name in systems}
        for mode, fn, frozen in (("forward", fwd, False), ("fwd_bwd_trainable", fwd_bwd, False),
                                 ("fwd_bwd_frozen", fwd_bwd, True)):
            if frozen:
                for mod in mods.values():
                    for p in mod.parameters():
                        p.requires_grad_(False)
            calls = max(20, args.calls // layers // (1 if mode == "forward" else 4))
            times = {name: [] for name in systems}
            for name in systems:  # warm-up
                time_per_call(lambda: fn(mods[name]), calls, repeats=1)
            for _ in range(args.rounds):
                for name in systems:
                    times[name].append(time_per_call(lambda: fn(mods[name]), calls, repeats=1) / layers)
            for name in systems:
                ratios = [t / p for t, p in zip(times[name], times["plain nn.Linear"])]
                results[name][mode + "_us"] = statistics.median(times[name])
                results[name][mode + "_ratio"] = statistics.median(ratios)
        rows.extend(results[name] for name in systems)
    if args.json:
        print(json.dumps({"batch": b, "features": f, "sim_link_gbps": args.sim_link_gbps,
                          "sim_latency_us": args.sim_latency_us, "rows": rows}))
        return
    print(f"per-call overhead, Linear {f}->{f}, batch {b}, CPU (sim device, link "
          f"{'infinite' if args.sim_link_gbps <= 0 else str(args.sim_link_gbps) + ' GB/s'}, "
          f"latency {args.sim_latency_us} us), torch {torch.__version__}; us per layer call (median of "
          f"{args.rounds} interleaved rounds), ratio to plain (median of per-round ratios)")
    print(f"{'system':32s} {'layers':>6s} {'fwd':>8s} {'ratio':>6s} {'fwd+bwd frozen':>15s} {'ratio':>6s}"
          f" {'fwd+bwd train':>14s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['system']:32s} {r['layers']:6d} {r['forward_us']:8.2f} {r['forward_ratio']:6.2f} "
              f"{r['fwd_bwd_frozen_us']:15.2f} {r['fwd_bwd_frozen_ratio']:6.2f} "
              f"{r['fwd_bwd_trainable_us']:14.2f} {r['fwd_bwd_trainable_ratio']:6.2f}")


if __name__ == "__main__":
    main()
