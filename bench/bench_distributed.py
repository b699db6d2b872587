"""offload() in 1, 2 and 4 processes (torch.distributed, gloo, the sim device): per-rank step
time, host optimizer CPU time, host store bytes (private and shared) and gradient bytes averaged.

Each rank runs the same per-rank work (weak scaling): blocks of Linear(width) + GELU, fp32,
batch rows per rank. Two modes, each in its own set of processes:

    lora    the streamed weights frozen, a resident trainable adapter (Linear(width, 8) then
            Linear(8, width)) per block, averaged by DistributedDataParallel; the store is one
            copy per node
    full    every streamed weight trainable, stepped on the host by layerstream.optim.AdamW;
            the engine averages their gradients over the ranks before the copy to the host;
            one store copy per process, every rank stepping every layer
    sharded as full with share_host_store="all": one store copy per node, each rank stepping
            its shard of every layer (the "opt ms" and optimizer-state columns split)

The sum of the ranks' Pss over the shared store's mapping shows the bytes the node holds.
On a 2-core machine 4 ranks share 2 cores: their step times show the contention, not a GPU
node; the optimizer column is CPU time (one optimizer thread per rank), the work itself.

    .venv/bin/python bench/bench_distributed.py [--ranks 1 2 4] [--json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def worker(args) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import layerstream
    import layerstream.optim
    from layerstream._distributed import store_pss

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # One optimizer thread per rank: its CPU time is then the rank's host work, whatever the rank count.
    layerstream._C.optim_set_threads(1)
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, width, adapter):
            super().__init__()
            self.linear = nn.Linear(width, width)
            self.adapter = nn.Sequential(nn.Linear(width, 8), nn.Linear(8, width)) if adapter else None

        def forward(self, x):
            y = self.linear(x)
            if self.adapter is not None:
                y = y + self.adapter(x)
            return nn.functional.gelu(y)

    lora = args.mode == "lora"
    share = "all" if args.mode == "sharded" else None
    model = nn.Sequential(*[Block(args.width, lora) for _ in range(args.layers)])
    if lora:
        for b in model:
            b.linear.requires_grad_(False)
    handle = layerstream.offload(model, device="sim", checker=False, exclude=["*adapter*"],
                                 sim_link_gbps=args.gbps, share_host_store=share)
    if lora:
        net = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    else:
        net = model
        opt = layerstream.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.batch, args.width, generator=g)
    times, opt_times = [], []
    for step in range(args.steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        net(x).square().mean().backward()
        dist.barrier()  # the step's own barrier (sharded) then waits for no one
        c1 = time.thread_time()  # this thread's CPU time (the only optimizer thread): the work, not waits
        opt.step()
        c2 = time.thread_time()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if step:  # the first step warms up
            times.append(t2 - t0)
            opt_times.append(c2 - c1)
    s = handle.stats()
    result = {"rank": rank, "world": world, "mode": args.mode, "step_ms": statistics.median(times) * 1e3,
              "opt_ms": statistics.median(opt_times) * 1e3,
              "private_store_bytes": s["pinned_bytes"] + s["pageable_bytes"] - s["shared_bytes"],
              "shared_store_bytes": s["shared_bytes"], "store_pss": store_pss(),
              "averaged_bytes_per_step": (s["averaged_bytes"] // (args.steps + 1)),
              "state_bytes": sum(t.numel() * t.element_size() for st in opt.state.values()
                                 for k, t in st.items() if k != "step" and torch.is_tensor(t))}
    dist.barrier()  # every rank measured its Pss while the others still map the store
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # DDP holds the group: gone first, destroying the group joins gloo's threads now, not
    # in the interpreter's shutdown (docs/design/distributed.md, "The group is torch's").
    del net
    gc.collect()
    dist.destroy_process_group()


def run(mode: str, ranks: int, args) -> list:
    with tempfile.TemporaryDirectory() as out:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(ranks),
                   OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // ranks)))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode, "--out", out,
               "--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
               "--steps", str(args.steps), "--gbps", str(args.gbps)]
        procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r))) for r in range(ranks)]
        try:
            for p in procs:
                if p.wait(timeout=600) != 0:
                    raise SystemExit(f"a rank of {mode} x{ranks} failed ({p.returncode})")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(ranks)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--modes", nargs="+", default=["lora", "full", "sharded"], choices=["lora", "full", "sharded"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gbps", type=float, default=25.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    for mode in args.modes:
        for ranks in args.ranks:
            t0 = time.perf_counter()
            res = run(mode, ranks, args)
            rows.append({"mode": mode, "ranks": ranks,
                         "step_ms": statistics.mean(r["step_ms"] for r in res),
                         "opt_ms": statistics.mean(r["opt_ms"] for r in res),
                         "private_mib_per_rank": res[0]["private_store_bytes"] / 2**20,
                         "shared_mib": res[0]["shared_store_bytes"] / 2**20,
                         "node_store_mib": (sum(r["private_store_bytes"] for r in res)
                                            + sum(r["store_pss"] for r in res)) / 2**20,
                         "averaged_mib_per_step": res[0]["averaged_bytes_per_step"] / 2**20,
                         "state_mib_per_rank": res[0]["state_bytes"] / 2**20,
                         "wall_s": time.perf_counter() - t0})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{args.layers} x Linear({args.width}) fp32, batch {args.batch} per rank, sim link {args.gbps} GB/s, "
          f"median of {args.steps} steps")
    print("| mode | ranks | step ms | optimizer step CPU ms per rank | optimizer states MiB per rank | private store MiB per rank "
          "| shared store MiB | node store MiB (private + Pss) | grads averaged MiB per step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['ranks']} | {r['step_ms']:.1f} | {r['opt_ms']:.1f} | {r['state_mib_per_rank']:.1f} | "
              f"{r['private_mib_per_rank']:.1f} | {r['shared_mib']:.1f} | {r['node_store_mib']:.1f} | "
              f"{r['averaged_mib_per_step']:.1f} |")


if __name__ == "__main__":
    main()
