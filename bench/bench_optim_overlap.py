"""Optimizer overlap on the sim device: a transfer-bound full fine-tune step with
layerstream.optim.AdamW stepping each streamed layer during the backward,
against the same step with the optimizer step removed.

A stack of --layers Linear(--width, --width) layers (fp32, all streamed) over a
simulated link of --gbps GB/s each way, small batches, so the step is bound by
the weight copies (forward and backward fetches) and the gradient copies
back. Per variant, the median of --steps steps (after --warmup):

  no optimizer   forward + backward only (the floor)
  step after     forward + backward, then opt.step() (layerstream AdamW)
  overlapped     forward + backward inside opt.overlap(handle), then opt.step()
                 (each layer's gradient consumed in one fused pass, no .grad)
  overlap+grads  the same with keep_grads=True (.grad written, as before fusion)
  torch fused    forward + backward, then torch.optim.AdamW(fused=True).step()

and the ratio to "no optimizer" (goal for "overlapped": <= 1.15). One model
and handle; the variants take turns step by step (the same weights, the same
machine load; the learning rate is small), each with fresh gradients. "where the
rest goes": the time opt.step() still takes after an overlapped backward
(waiting for the last layers' steps, stepping the resident parameters), and
the backward's own time against the floor's.

    .venv/bin/python bench/bench_optim_overlap.py [--layers 12] [--width 1024] [--gbps 2] [--max-grad-norm 1.0]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import layerstream  # noqa: E402


def build(layers, width, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])


VARIANTS = ("no optimizer", "step after", "overlapped", "overlap+grads", "torch fused")


def run(args):
    """One model and handle; every variant in turn, step after step (the machine
    may be shared: interleaving gives every variant the same conditions)."""
    model = build(args.layers, args.width)
    handle = layerstream.offload(model, device="sim", sim_link_gbps=args.gbps, checker=False, prefetch=2)
    ls = layerstream.optim.AdamW(model.parameters(), lr=1e-5, max_grad_norm=args.max_grad_norm)
    fused = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator().manual_seed(1)
    times = {v: {"step": [], "backward": [], "after": []} for v in VARIANTS}
    clipped = {"step after": 0, "overlapped": 0, "overlap+grads": 0}
    for i in range(args.warmup + args.steps):
        for variant in VARIANTS:
            x = torch.randn(args.batch, args.width, generator=gen)
            t0 = time.perf_counter()
            loss = model(x).square().mean()
            t1 = time.perf_counter()
            if variant in ("overlapped", "overlap+grads"):
                with ls.overlap(handle, keep_grads=variant == "overlap+grads"):
                    loss.backward()
            else:
                loss.backward()
                if variant == "torch fused" and args.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            t2 = time.perf_counter()
            if variant in ("step after", "overlapped", "overlap+grads"):
                ls.step()
                if args.max_grad_norm is not None and i >= args.warmup:
                    clipped[variant] += ls.last_grad_norm > args.max_grad_norm
            elif variant == "torch fused":
                fused.step()
            t3 = time.perf_counter()
            ls.zero_grad()
            if i >= args.warmup:
                times[variant]["step"].append(t3 - t0)
                times[variant]["backward"].append(t2 - t1)
                times[variant]["after"].append(t3 - t2)
    handle.detach()
    med = statistics.median
    rows = {v: {k: med(t) for k, t in d.items()} for v, d in times.items()}
    return rows, clipped


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gbps", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-grad-norm", type=float, default=None)
    ap.add_argument("--optim-threads", type=int, default=0, help="layerstream's optimizer threads (0: its default)")
    args = ap.parse_args()
    if args.optim_threads:
        layerstream._C.optim_set_threads(args.optim_threads)
    params = args.layers * (args.width * args.width + args.width)
    print(f"{args.layers} x Linear({args.width}, {args.width}) streamed (sim, {args.gbps:g} GB/s each way), "
          f"{params / 1e6:.1f}M parameters, batch {args.batch}, max_grad_norm {args.max_grad_norm}; "
          f"median of {args.steps} steps per variant, interleaved; optimizer threads {layerstream._C.optim_threads()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    rows, clipped = run(args)
    floor = rows["no optimizer"]["step"]
    print(f"{'variant':<14} {'step ms':>8} {'ratio':>6} {'backward ms':>12} {'after backward ms':>18}")
    for name, r in rows.items():
        print(f"{name:<14} {r['step'] * 1e3:8.1f} {r['step'] / floor:6.3f} {r['backward'] * 1e3:12.1f} "
              f"{r['after'] * 1e3:18.1f}")
    o = rows["overlapped"]
    if args.max_grad_norm is not None:
        print(f"the clip triggered on {clipped['step after']} of {args.steps} 'step after' steps, "
              f"{clipped['overlapped']} 'overlapped' and {clipped['overlap+grads']} 'overlap+grads' steps")
    print(f"overlapped / no optimizer = {o['step'] / floor:.3f} (goal <= 1.15); the rest: "
          f"{o['after'] * 1e3:.1f} ms in step() after the backward, backward "
          f"{(o['backward'] - rows['no optimizer']['backward']) * 1e3:+.1f} ms against the floor's")


if __name__ == "__main__":
    main()
