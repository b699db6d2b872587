"""quantize="lossless" on a transfer-bound step (issue 28), on the sim device.

A stack of --layers Linear(--width) bf16 layers with weights N(0, 0.02), streamed
over a sim link of --gbps GB/s: the inference step plain (bf16 on the bus) and with
the lossless format (coded on the bus, decoded in the slot on the sim device's
dequant stream, one CPU thread), each in its own process, alternating, medians of
--steps; outputs compared bit for bit. The sim decoder runs at about 1 GB/s of
output on this machine, so the step falls only where the link is slower than that
(the GPU decoder is the one meant to hide behind the copy).

With --train, a full fine-tuning step instead (trainable weights, forward, backward
and torch's SGD): the lossless weights are re-coded after every step (Note
[Trainable coded weights]), before their next copy; the re-coding's host time per
step is reported. With --train --overlap, layerstream.optim.AdamW steps each layer
during the backward (`with opt.overlap(handle)`) and the weight is re-coded right
after its step, behind the rest of the backward.

    .venv/bin/python bench/bench_lossless.py [--layers 8] [--width 2048] [--gbps 0.5] [--steps 5] [--train [--overlap]]
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

HERE = os.path.dirname(os.path.abspath(__file__))


def one(args, fmt):
    """The median step of one configuration, measured in this process."""
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import torch
    import torch.nn as nn
    import layerstream
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    with torch.no_grad():
        for m in model:
            m.weight.normal_(0, 0.02)
    model = model.to(torch.bfloat16).requires_grad_(args.train)
    h = layerstream.offload(model, device="sim", sim_link_gbps=args.gbps, checker=False,
                            quantize=None if fmt == "bf16" else fmt)
    x = torch.randn(4, args.width, dtype=torch.bfloat16)
    if not args.train:
        opt = None
    elif args.overlap:
        opt = layerstream.optim.AdamW(model.parameters(), lr=1e-5)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ts = []
    recode = []
    for i in range(args.steps + 1):
        before = h.stats()["recode_seconds"]
        t0 = time.perf_counter()
        if opt is None:
            with torch.no_grad():
                y = model(x)
        else:
            y = model(x)
            with opt.overlap(h) if args.overlap else contextlib.nullcontext():
                y.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        h.synchronize()
        if i:
            ts.append(time.perf_counter() - t0)
            recode.append(h.stats()["recode_seconds"] - before)
    s = h.stats()
    return {"step_s": statistics.median(ts), "h2d_bytes_per_step": s["h2d_bytes"] / (args.steps + 1),
            "recode_s": statistics.median(recode), "recoded_bytes": s["recoded_bytes"],
            "out": y.float().sum().item(), "out_bits": y.detach().view(torch.int16).long().sum().item()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--gbps", type=float, default=0.5, help="sim link GB/s")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="processes per configuration, alternating")
    ap.add_argument("--train", action="store_true", help="a full fine-tuning step (trainable weights, SGD)")
    ap.add_argument("--overlap", action="store_true",
                    help="with --train: layerstream.optim.AdamW stepping each layer during the backward")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.overlap and not args.train:
        ap.error("--overlap goes with --train")
    if args.one:
        print(json.dumps(one(args, args.one)))
        return
    res = {"bf16": [], "lossless": []}
    for _ in range(args.rounds):
        for fmt in res:
            cmd = [sys.executable, __file__, "--one", fmt, "--layers", str(args.layers), "--width", str(args.width),
                   "--gbps", str(args.gbps), "--steps", str(args.steps)] + (["--train"] if args.train else []) + \
                (["--overlap"] if args.overlap else [])
            res[fmt].append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True)
                                       .stdout.strip().splitlines()[-1]))
    plain, coded = res["bf16"], res["lossless"]
    same = all(a["out_bits"] == b["out_bits"] and a["out"] == b["out"] for a, b in zip(plain, coded))
    p = statistics.median(r["step_s"] for r in plain)
    c = statistics.median(r["step_s"] for r in coded)
    bp, bc = plain[0]["h2d_bytes_per_step"], coded[0]["h2d_bytes_per_step"]
    kind = ("training (forward, backward overlapped with layerstream.optim.AdamW)" if args.overlap else
            "training (forward, backward, SGD)") if args.train else "inference"
    print(f"sim, {args.layers} x Linear({args.width}) bf16, {kind}, link {args.gbps} GB/s, medians of {args.steps} "
          f"steps x {args.rounds} processes each:")
    print(f"  plain bf16    {p * 1e3:8.1f} ms   {bp / 2**20:8.2f} MiB/step on the link")
    print(f"  lossless      {c * 1e3:8.1f} ms   {bc / 2**20:8.2f} MiB/step ({bc / bp:.3f} of bf16)   "
          f"step {c / p:.2f}x of plain{'' if args.train else ' (goal <= 0.75x)'}; outputs "
          f"{'bit-identical' if same else 'DIFFER'}")
    if args.train:
        dense = args.layers * args.width * args.width * 2
        print(f"  re-coding     {statistics.median(r['recode_s'] for r in coded) * 1e3:8.1f} ms/step of host time for "
              f"{dense / 2**20:.0f} MiB of weights ({dense / 1e9 / statistics.median(r['recode_s'] for r in coded):.2f} "
              f"GB/s), {'on the stepping thread during the backward' if args.overlap else 'on the thread that issues the copies'}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
