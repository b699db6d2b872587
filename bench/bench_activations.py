"""Activation offload on the sim device (or CUDA): peak saved-activation bytes on the device and step
time, without and with offload(activations="host").

A training step where activations dominate: blocks of Linear(width) + GELU on a large batch,
trainable weights. Three runs, each in its own process on the same work:

    off     offload() without activation offload (no hooks)
    kept    activations="1TiB": every saved tensor goes through the engine and stays on the
            device (the engine's count of saved-activation bytes, for the baseline peak)
    host    activations="host"
    window  activations=<a quarter of what the step saves>: the newest saved tensors stay on
            the device (backward needs them first), the older ones go to the host

On CUDA each mode also reports torch's peak device memory of one more step (allocated and
reserved, above what was there before it); host / off of those is the GPU row's measure.

    .venv/bin/python bench/bench_activations.py [--device cuda] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from peer_process import StageClock, stage_deadline

MODES = {"off": None, "kept": "1TiB", "host": "host", "window": "quarter"}


def run_mode(args) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import torch
    import torch.nn as nn

    import layerstream

    torch.manual_seed(0)
    blocks = []
    for _ in range(args.layers):
        blocks += [nn.Linear(args.width, args.width), nn.GELU()]
    model = nn.Sequential(*blocks)
    activations = MODES[args.mode]
    if activations == "quarter":  # each block saves its Linear's input and its GELU's input
        activations = 2 * args.layers * args.batch * args.width * 4 // 4
    handle = layerstream.offload(model, device=args.device, checker=False, activations=activations,
                                 **({"sim_link_gbps": args.gbps} if args.device == "sim" else {}))
    device = handle.compute_device
    x = torch.randn(args.batch, args.width, device=device, requires_grad=True)

    def step():
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
        x.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    s = handle.stats()
    row = {"mode": args.mode, "step_ms": statistics.median(times) * 1e3,
           "peak_activation_device_bytes": s["peak_activation_device_bytes"],
           "activation_d2h_bytes": s["activation_d2h_bytes"] // (args.steps + 1)}
    if device.type == "cuda":
        # torch's own count of one more step (not timed): what the step adds to the memory
        # allocated before it, and to the memory its allocator reserves from the device (this
        # one also holds the blocks whose copy to the host is still running).
        torch.cuda.empty_cache()
        alloc0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        step()
        row["peak_step_allocated_bytes"] = torch.cuda.max_memory_allocated() - alloc0
        row["peak_step_reserved_bytes"] = torch.cuda.max_memory_reserved() - reserved0
    return row


def summarize(config: dict, rows: dict) -> dict:
    """The run's record from its modes' rows: the ratios, and on a GPU (rows with torch's
    peaks) issue 26's goal, judged on the memory the device gave (reserved)."""
    failed = {m: r.get("error") or r["skipped"] for m, r in rows.items() if "error" in r or "skipped" in r}
    ok = lambda *ms: not any(m in failed for m in ms)  # noqa: E731
    result = {"config": config, "modes": rows, "failed": failed,
              "peak_host_over_kept": rows["host"]["peak_activation_device_bytes"]
              / max(1, rows["kept"]["peak_activation_device_bytes"]) if ok("host", "kept") else None,
              "step_host_over_off": rows["host"]["step_ms"] / rows["off"]["step_ms"] if ok("host", "off") else None}
    for key in ("allocated", "reserved"):
        col = f"peak_step_{key}_bytes"
        if ok("host", "off") and col in rows["off"]:
            result[f"peak_{key}_host_over_off"] = rows["host"][col] / max(1, rows["off"][col])
    if "peak_reserved_host_over_off" in result:
        met = result["peak_reserved_host_over_off"] <= 0.5 and result["step_host_over_off"] <= 1.10
        result["goal"] = ("met" if met else "missed") + " (host / off: reserved peak <= 0.5, step time <= 1.10x)"
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="sim")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gbps", type=float, default=25.0, help="sim link (both directions), GB/s")
    ap.add_argument("--deadline-s", type=float, default=stage_deadline(),
                    help="the whole run's seconds (default: $LS_STAGE_DEADLINE_S, which bench/gpu/run.sh sets; "
                         "0: none): a mode that cannot start in time is a row that says so")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args)))
        return
    rows, clock = {}, StageClock(args.deadline_s)
    for mode in MODES:
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--device", args.device,
               "--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
               "--steps", str(args.steps), "--gbps", str(args.gbps)]
        rows[mode] = clock.run(cmd, mode)  # a row, or one with its stderr's end / the timeout / no time left
    result = summarize({k: getattr(args, k) for k in ("device", "layers", "width", "batch", "steps", "gbps")}, rows)
    failed = result["failed"]
    if args.json or failed:
        print(json.dumps(result))
        sys.exit(1 if failed else 0)
    print(f"{args.layers} x (Linear({args.width}) + GELU), batch {args.batch}, training step; device {args.device}")
    print(f"{'mode':<6}{'step ms':>10}{'peak saved MiB':>16}{'to host MiB/step':>18}")
    for mode, r in rows.items():
        print(f"{mode:<6}{r['step_ms']:>10.1f}{r['peak_activation_device_bytes'] / 2**20:>16.1f}"
              f"{r['activation_d2h_bytes'] / 2**20:>18.1f}")
    print(f"peak saved activations, host / kept: {result['peak_host_over_kept']:.2f}; "
          f"step time, host / off: {result['step_host_over_off']:.3f}x")
    if "peak_allocated_host_over_off" in result:
        print(f"step's peak device memory (torch), host / off: allocated "
              f"{result['peak_allocated_host_over_off']:.2f}, reserved {result['peak_reserved_host_over_off']:.2f}; "
              f"goal {result['goal']}")


if __name__ == "__main__":
    main()
