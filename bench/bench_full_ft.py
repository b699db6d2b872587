"""Full fine-tuning with the optimizer step on the host, against the resident model stepped on
the device (issue 21's GPU row; issue 28's lossless weights under training). Runs on CUDA (the
GPU proof, bench/gpu/run.sh) or on the sim device (a dry run: its timings are the CPU's).

A stack of --layers Linear(--width) layers (--dtype, every weight trainable), batch --batch,
loss = mean of the squared output; AdamW (lr 1e-5, weight decay 0.01). Peers, each in its own
process on the same model and inputs:

    resident           the model on the device, torch.optim.AdamW(fused=True) on the device
                       (the reference: what a GPU with room for everything does)
    torch-host         offload(model, train=2 x the dtype's bytes) and torch.optim.AdamW (its
                       default, foreach; states in the weights' dtype) on the host
                       copy after backward (what a user of offloading does without us)
    ls-after           offload(model, train="adamw") and layerstream.optim.AdamW, step() after
                       backward (train=: the budget holds resident weights' gradients and states)
    ls-overlap         the same with the backward inside opt.overlap(handle): each layer
                       stepped on host threads as its gradient lands
    ls-lossless        ls-overlap with quantize="lossless": weights cross the bus
                       entropy-coded and are re-coded right after their step
    ds-zero2-offload   DeepSpeed ZeRO-Offload: ZeRO stage 2 with offload_optimizer to the
                       host (DeepSpeedCPUAdam on fp32 master weights), bf16 weights on the device
    ds-zero3-offload   DeepSpeed ZeRO-3 with offload_param and offload_optimizer to the host:
                       the weights live on the host too, as with layerstream

The DeepSpeed peers import `deepspeed` installed, or from --deepspeed-path (default
build/bench-deps; not a project dependency: bench/bench_optim.py says how to put it there,
bench/gpu/fetch_peers.sh fetches it for the GPU machine); without it their rows are skipped
and say why. DeepSpeedCPUAdam compiles at first use (minutes; torch caches it): a step of its
own builds it before them (--ds-build-timeout; if it fails, they are skipped saying so; one past
its timeout is killed with its compilers, and the lock file torch's loader left in the build folder
is removed, so that a later run builds instead of waiting on it). The build goes to
$TORCH_EXTENSIONS_DIR (default build/torch_extensions, kept between calls on a warm machine). Each runs
as one rank of a process group of one (DeepSpeed needs one), on CUDA, or on DeepSpeed's CPU
accelerator in a sim dry run (its timings are then the CPU's, as the others').

--deadline-s (default $LS_STAGE_DEADLINE_S, set by bench/gpu/run.sh's stages): a peer that cannot
start in time is a row skipped with that reason, so the rows are printed before the stage ends.
--peers: a subset, run in the order above (resident, the reference, always runs).

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
import sys
import time

from peer_process import StageClock, stage_deadline

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PEERS = ("resident", "torch-host", "ls-after", "ls-overlap", "ls-lossless", "ds-zero2-offload", "ds-zero3-offload")
DS_PEERS = ("ds-zero2-offload", "ds-zero3-offload")


def deepspeed_or_reason(path):
    """(deepspeed, None), or (None, why it is not importable)."""
    sys.path.append(path)  # after site-packages: an installed deepspeed wins
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401 - the import is the check
        return deepspeed, None
    except Exception as e:  # noqa: BLE001 - any failure is the row's reason
        return None, f"deepspeed is not importable (installed, or from {path}): {type(e).__name__}: {e}"


def build_deepspeed_adam(args) -> dict:
    """The hidden "ds-build" step: DeepSpeedCPUAdam's op compiled (or loaded from torch's
    extension cache) in a process of its own before the DeepSpeed peers, so that a build
    slower than a peer's timeout skips them with that reason instead of killing one
    mid-build (a killed build leaves torch's lock file, and the next load waits on it)."""
    deepspeed, reason = deepspeed_or_reason(args.deepspeed_path)
    if deepspeed is None:
        return {"peer": "ds-build", "skipped": reason}
    from deepspeed.ops.op_builder import CPUAdamBuilder

    t0 = time.perf_counter()
    CPUAdamBuilder().load()
    return {"peer": "ds-build", "build_seconds": time.perf_counter() - t0}


def run_deepspeed(args, model, xs, device_type) -> dict:
    """A DeepSpeed peer: ZeRO-2 or ZeRO-3, the optimizer (and for ZeRO-3 the weights) on the host."""
    import socket

    import torch

    deepspeed, reason = deepspeed_or_reason(args.deepspeed_path)
    if deepspeed is None:
        return {"peer": args.peer, "skipped": reason}
    with socket.socket() as s:  # a group of one rank: any free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    zero = {"stage": 2 if args.peer == "ds-zero2-offload" else 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": device_type == "cuda"}}
    if zero["stage"] == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": device_type == "cuda"}
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": args.dtype == "bf16"}, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}}}
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    init_seconds = time.perf_counter() - t0
    device = engine.device
    xs = [x.to(device) for x in xs]

    def sync():
        if device_type == "cuda":
            torch.cuda.synchronize(device)

    times = {"step": [], "backward": [], "after": []}
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i, x in enumerate(xs):
        sync()
        t0 = time.perf_counter()
        engine.backward(engine(x).float().square().mean())
        sync()
        t1 = time.perf_counter()
        engine.step()
        sync()
        t2 = time.perf_counter()
        if i:
            times["step"].append(t2 - t0)
            times["backward"].append(t1 - t0)
            times["after"].append(t2 - t1)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params), torch.no_grad():  # ZeRO-3: whole again for the sum
        checksum = sum(float(p.detach().float().double().sum()) for p in params)
    row = {"peer": args.peer, **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()},
           "checksum": checksum, "init_seconds": init_seconds,
           "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device_type == "cuda" else None}
    engine.destroy()
    torch.distributed.destroy_process_group()
    return row


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
    if peer in DS_PEERS:
        gen = torch.Generator().manual_seed(1)
        xs = [torch.randn(args.batch, args.width, generator=gen).to(dtype) for _ in range(args.steps + 1)]
        return run_deepspeed(args, model, xs, "cuda" if args.device == "cuda" else "cpu")
    if peer == "resident":
        device = torch.device("cuda") if args.device == "cuda" else torch.device("cpu")
        model = model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=True)
    else:
        kw = {"sim_link_gbps": args.gbps, "checker": False} if args.device == "sim" else {}
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # The budget holds what resident weights need to train, as a user sizes it: layerstream's
        # AdamW keeps fp32 states; torch's AdamW keeps them in the weight's dtype (2 x its size).
        train = 2 * dtype.itemsize if peer == "torch-host" else "adamw"
        handle = layerstream.offload(model, device=args.device, budget=int(args.budget * weight_bytes),
                                     quantize="lossless" if peer == "ls-lossless" else None, train=train, **kw)
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
        row.update({"h2d_bytes_per_step": s["h2d_bytes"] // len(xs), "recode_seconds": s["recode_seconds"],
                    "resident_layers": s.get("resident_layers", 0), "plan_train_bytes": handle._plan["train_bytes"]})
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
    ap.add_argument("--deepspeed-path", default=os.path.join(REPO, "build", "bench-deps"),
                    help="where the DeepSpeed peers import deepspeed from when it is not installed")
    ap.add_argument("--peer-timeout", type=float, default=900, help="seconds one peer's process may take")
    ap.add_argument("--ds-build-timeout", type=float, default=300,
                    help="seconds DeepSpeedCPUAdam's build may take before the DeepSpeed peers (else they are skipped)")
    ap.add_argument("--deadline-s", type=float, default=stage_deadline(),
                    help="the whole run's seconds (default: $LS_STAGE_DEADLINE_S, which bench/gpu/run.sh sets; "
                         "0: none): a peer that cannot start in time is skipped with that reason")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="comma-separated subset of " + ", ".join(PEERS) + " (resident always runs)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--peer", choices=PEERS + ("ds-build",), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer == "ds-build":
        print(json.dumps(build_deepspeed_adam(args)))
        return
    if args.peer:
        print(json.dumps(run_peer(args)))
        return
    wanted = {p for p in args.peers.split(",") if p}
    unknown = sorted(wanted - set(PEERS))
    if unknown:
        ap.error(f"--peers: unknown {', '.join(unknown)} (peers: {', '.join(PEERS)})")
    peers = [p for p in PEERS if p in wanted or p == "resident"]
    clock = StageClock(args.deadline_s)

    def run(peer, cap):
        # The child gets this command line (its settings) and its peer.
        cmd = [sys.executable, os.path.abspath(__file__), *(a for a in sys.argv[1:] if a != "--json"), "--peer", peer]
        return clock.run(cmd, peer, cap)

    rows, ds_build = {}, None
    # torch's extension loader builds DeepSpeedCPUAdam here (the peers inherit it) and holds
    # NAME/lock in it while it builds.
    ext_dir = os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO, "build", "torch_extensions"))
    for peer in peers:
        if peer in DS_PEERS and ds_build is None:
            ds_build = run("ds-build", args.ds_build_timeout)
            lock = os.path.join(ext_dir, "cpu_adam", "lock")  # CPUAdamBuilder.NAME
            if ds_build.get("timed_out") and os.path.exists(lock):
                os.remove(lock)
                ds_build["error"] += f"; removed the build's lock file {lock}"
        if peer in DS_PEERS and "error" in ds_build:
            rows[peer] = {"peer": peer, "skipped": f"DeepSpeedCPUAdam did not build: {ds_build['error']}"}
            continue
        rows[peer] = run(peer, args.peer_timeout)
    ref = rows["resident"].get("step_ms")
    for r in rows.values():
        if ref and "step_ms" in r:
            r["step_vs_resident"] = r["step_ms"] / ref
    result = {"config": {k: getattr(args, k) for k in ("device", "layers", "width", "batch", "dtype", "steps",
                                                        "budget", "gbps")},
              "params": args.layers * args.width * args.width, "peers": rows, "ds_build": ds_build}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.layers} x Linear({args.width}) {args.dtype}, {result['params'] / 1e6:.1f}M parameters, batch "
              f"{args.batch}, AdamW; device {args.device}; medians of {args.steps} steps")
        print(f"{'peer':<18}{'step ms':>10}{'vs resident':>13}{'backward ms':>13}{'after bwd ms':>14}{'peak MiB':>10}")
        for peer, r in rows.items():
            if "skipped" in r:
                print(f"{peer:<18}  skipped: {r['skipped']}")
                continue
            if "error" in r:
                print(f"{peer:<18}  failed: {r['error'].splitlines()[-1]}")
                continue
            peak = f"{r['peak_device_bytes'] / 2**20:.0f}" if r["peak_device_bytes"] is not None else "-"
            print(f"{peer:<18}{r['step_ms']:>10.1f}{r.get('step_vs_resident', float('nan')):>13.2f}"
                  f"{r['backward_ms']:>13.1f}{r['after_ms']:>14.1f}{peak:>10}")
    if any("error" in r for r in rows.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
