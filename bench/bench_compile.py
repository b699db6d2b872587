"""torch.compile with streamed layers: compile time and step time, eager vs compiled, resident
vs streamed.

Four peers, each in its own process on the same work (a stack of Linear + GELU blocks, or
with --model attention of nn.MultiheadAttention + Linear blocks, whose attention streams as
a tensor group: the layerstream::group operator; a training step with frozen weights as
under LoRA: forward, backward to the input; with --train full the weights train too and the
step ends with every weight gradient in .grad, on the host for streamed layers):

    resident-eager, resident-compiled, streamed-eager, streamed-compiled

Prints, per peer, the first call (for the compiled ones: Dynamo + AOTAutograd + Inductor),
the median step (median over --rounds rounds of fresh processes), and the streamed/resident
ratio of each mode.

    .venv/bin/python bench/bench_compile.py                       # sim device (CPU)
    .venv/bin/python bench/bench_compile.py --device cuda --width 4096 --layers 16 --batch 4096
    .venv/bin/python bench/bench_compile.py --json               # one JSON object
    .venv/bin/python bench/bench_compile.py --model attention --width 256 --batch 8 --seq 64
    .venv/bin/python bench/bench_compile.py --train full          # full fine-tuning's backward
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from peer_process import StageClock, stage_deadline

PEERS = ["resident-eager", "resident-compiled", "streamed-eager", "streamed-compiled"]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_peer(args) -> dict:
    """One peer, in this process."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    if args.model == "attention":
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.att = nn.MultiheadAttention(args.width, 8, batch_first=True)
                self.fc = nn.Linear(args.width, args.width)

            def forward(self, x):
                return x + self.fc(self.att(x, x, x, need_weights=False)[0])

        model = nn.Sequential(*[Block() for _ in range(args.layers)]).requires_grad_(args.train == "full")
        shape = (args.batch, args.seq, args.width)
    else:
        blocks = []
        for _ in range(args.layers):
            blocks += [nn.Linear(args.width, args.width), nn.GELU()]
        model = nn.Sequential(*blocks).requires_grad_(args.train == "full")
        shape = (args.batch, args.width)
    device = "cpu" if args.device == "sim" else args.device
    streamed = args.peer.startswith("streamed")
    if streamed:
        import layerstream

        layerstream.offload(model, device=args.device, checker=False)
    else:
        model.to(device)
    run = torch.compile(model, fullgraph=True, backend=args.backend) if args.peer.endswith("compiled") else model
    x = torch.randn(*shape, device=device, requires_grad=True)

    def step():
        y = run(x)
        y.sum().backward()  # streamed weights' .grad complete on the host when it returns
        x.grad = None
        model.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    step()
    _sync(args.device)
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        _sync(args.device)
        times.append(time.perf_counter() - t0)
    return {"peer": args.peer, "first_call_s": first, "step_ms": statistics.median(times) * 1e3}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="sim", help="sim (CPU) or cuda[:N]")
    ap.add_argument("--model", choices=["mlp", "attention"], default="mlp")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (--model attention)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--train", choices=["frozen", "full"], default="frozen",
                    help="frozen weights (backward to the input only) or full fine-tuning's backward")
    ap.add_argument("--deadline-s", type=float, default=stage_deadline(),
                    help="the whole run's seconds (default: $LS_STAGE_DEADLINE_S, which bench/gpu/run.sh sets; "
                         "0: none): a peer that cannot start in time is a row that says so")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--peer", choices=PEERS, help=argparse.SUPPRESS)  # a child's one peer
    args = ap.parse_args()
    if args.peer:
        print(json.dumps(run_peer(args)))
        return
    # Rounds of the four peers in turn, each round's peers in fresh processes; per peer the
    # median over rounds (a shared machine's noise moves whole processes).
    runs, failed = {peer: [] for peer in PEERS}, {}
    clock = StageClock(args.deadline_s)
    for _ in range(args.rounds):
        for peer in PEERS:
            cmd = [sys.executable, os.path.abspath(__file__), "--peer", peer, "--device", args.device,
                   "--model", args.model, "--seq", str(args.seq),
                   "--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
                   "--steps", str(args.steps), "--backend", args.backend, "--train", args.train]
            r = clock.run(cmd, peer)
            if "error" in r or "skipped" in r:  # its stderr's end, a timeout, or no time left
                failed.setdefault(peer, r)
            else:
                runs[peer].append(r)
    rows = {peer: ({"peer": peer, "first_call_s": statistics.median(r["first_call_s"] for r in rs),
                    "step_ms": statistics.median(r["step_ms"] for r in rs), "rounds": [r["step_ms"] for r in rs]}
                   if rs else failed[peer]) for peer, rs in runs.items()}

    def ratio(a, b):
        return rows[a]["step_ms"] / rows[b]["step_ms"] if "step_ms" in rows[a] and "step_ms" in rows[b] else None

    result = {
        "config": {k: getattr(args, k)
                   for k in ("device", "model", "layers", "width", "batch", "seq", "steps", "rounds", "backend",
                             "train")},
        "peers": rows,
        "streamed_over_resident_eager": ratio("streamed-eager", "resident-eager"),
        "streamed_over_resident_compiled": ratio("streamed-compiled", "resident-compiled"),
        "failed": {peer: r.get("error") or r.get("skipped") for peer, r in failed.items()},
    }
    if args.json:
        print(json.dumps(result))
        sys.exit(1 if failed else 0)
    what = (f"MultiheadAttention({args.width}, 8) + Linear, batch {args.batch} x {args.seq}"
            if args.model == "attention" else f"Linear({args.width}) + GELU, batch {args.batch}")
    trained = ("frozen weights, forward + backward to the input" if args.train == "frozen" else
               "trainable weights, forward + backward with every weight gradient in .grad")
    print(f"{args.layers} x {what}, {trained}; device {args.device}, backend {args.backend}")
    print(f"{'peer':<20}{'first call s':>14}{'step ms':>10}")
    for peer in PEERS:
        r = rows[peer]
        if peer in failed:
            print(f"{peer:<20}  failed: {result['failed'][peer][-300:]}")
            continue
        print(f"{peer:<20}{r['first_call_s']:>14.2f}{r['step_ms']:>10.2f}")
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}x"  # noqa: E731
    print(f"streamed / resident: eager {fmt(result['streamed_over_resident_eager'])}, "
          f"compiled {fmt(result['streamed_over_resident_compiled'])}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
