"""Full fine-tuning with the optimizer step on the host, against the resident model stepped on
the device (issue 21's GPU row; issue 28's lossless weights under training). Runs on CUDA (the
GPU proof, bench/gpu/run.sh) or on the sim device (a dry run: its timings are the CPU's).

A stack of --layers Linear(--width) layers (--dtype, every weight trainable), batch --batch,
loss = mean of the squared output; AdamW (lr 1e-5, weight decay 0.01). Peers, each in its own
process on the same model and inputs:

    resident           the model on the device, torch.optim.AdamW(fused=True) on the device
                       (the reference: what a GPU with room for everything does)
    torch-host         offload(model) and torch.optim.AdamW (its default, foreach) on the host
                       copy after backward (what a user of offloading does without us)
    ls-after           offload(model) and layerstream.optim.AdamW, step() after backward
    ls-overlap         the same with the backward inside opt.overlap(handle): each layer
                       stepped on host threads as its gradient lands
    ls-lossless        ls-overlap with quantize="lossless": weights cross the bus
                       entropy-coded and are re-coded right after their step

Per peer: the median step (forward + backward + step), the backward, and the optimizer time
visible after the backward (step()'s own time: what overlap hides), peak device memory (CUDA),
the bytes on the link and re-coding time (layerstream), and the sum of the parameters after the
steps (a sanity check, not a comparison: bf16 weights round stochastically on the host and to
nearest on the device).

    .venv/bin/python bench/bench_full_ft.py [--device cuda] [--layers 16] [--width 4096] [--json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

PEERS = ("resident", "torch-host", "ls-after", "ls-overlap", "ls-lossless")


def run_peer(args) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import torch
    import torch.nn as nn

    import layerstream

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    with torch.no_grad():
        for m in model:
            m.weight.normal_(0, args.width ** -0.5)
    model = model.to(dtype)
    peer = args.peer
    handle = None
    if peer == "resident":
        device = torch.device("cuda") if args.device == "cuda" else torch.device("cpu")
        model = model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=True)
    else:
        kw = {"sim_link_gbps": args.gbps, "checker": False} if args.device == "sim" else {}
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        handle = layerstream.offload(model, device=args.device, budget=int(args.budget * weight_bytes),
                                     quantize="lossless" if peer == "ls-lossless" else None, **kw)
        device = handle.compute_device
        if peer == "torch-host":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
        else:
            opt = layerstream.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(args.batch, args.width, generator=gen).to(dtype).to(device) for _ in range(args.steps + 1)]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif handle is not None:
            handle.synchronize()

    overlap = peer in ("ls-overlap", "ls-lossless")
    times = {"step": [], "backward": [], "after": []}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i, x in enumerate(xs):
        sync()
        t0 = time.perf_counter()
        loss = model(x).float().square().mean()
        with opt.overlap(handle) if overlap else contextlib.nullcontext():
            loss.backward()
        sync()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t2 = time.perf_counter()
        if i:  # the first step warms up (allocations, traces)
            times["step"].append(t2 - t0)
            times["backward"].append(t1 - t0)
            times["after"].append(t2 - t1)
    with torch.no_grad():
        checksum = sum(float(p.detach().float().double().sum()) for p in model.parameters())
    row = {"peer": peer, **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()},
           "checksum": checksum,
           "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    if handle is not None:
        s = handle.stats()
        row.update({"h2d_bytes_per_step": s["h2d_bytes"] // len(xs), "recode_seconds": s["recode_seconds"]})
        handle.detach()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="sim")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.6,
                    help="offload()'s device budget for the layerstream peers, as a fraction of the weights' bytes")
    ap.add_argument("--gbps", type=float, default=2.0, help="sim link (both directions), GB/s")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--peer", choices=PEERS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        print(json.dumps(run_peer(args)))
        return
    rows = {}
    for peer in PEERS:
        # The child gets this command line (its settings) and its peer.
        cmd = [sys.executable, os.path.abspath(__file__), *(a for a in sys.argv[1:] if a != "--json"), "--peer", peer]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            rows[peer] = {"peer": peer, "error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1]}
            continue
        rows[peer] = json.loads(done.stdout.strip().splitlines()[-1])
    ref = rows["resident"].get("step_ms")
    for r in rows.values():
        if ref and "step_ms" in r:
            r["step_vs_resident"] = r["step_ms"] / ref
    result = {"config": {k: getattr(args, k) for k in ("device", "layers", "width", "batch", "dtype", "steps",
                                                        "budget", "gbps")},
              "params": args.layers * args.width * args.width, "peers": rows}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.layers} x Linear({args.width}) {args.dtype}, {result['params'] / 1e6:.1f}M parameters, batch "
              f"{args.batch}, AdamW; device {args.device}; medians of {args.steps} steps")
        print(f"{'peer':<12}{'step ms':>10}{'vs resident':>13}{'backward ms':>13}{'after bwd ms':>14}{'peak MiB':>10}")
        for peer, r in rows.items():
            if "error" in r:
                print(f"{peer:<12}  failed: {r['error']}")
                continue
            peak = f"{r['peak_device_bytes'] / 2**20:.0f}" if r["peak_device_bytes"] is not None else "-"
            print(f"{peer:<12}{r['step_ms']:>10.1f}{r.get('step_vs_resident', float('nan')):>13.2f}"
                  f"{r['backward_ms']:>13.1f}{r['after_ms']:>14.1f}{peak:>10}")
    if any("error" in r for r in rows.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
