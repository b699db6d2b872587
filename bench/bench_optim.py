"""Host optimizer throughput: layerstream.optim.AdamW vs torch.optim.AdamW vs DeepSpeedCPUAdam,
and layerstream.optim.Adafactor vs transformers' Adafactor.

Every optimizer ("peer") runs in a process of its own on the same work: the
same number of parameters (default 100M, split into --tensors equal tensors,
like a model's layers), random parameters and gradients, one optimizer step
timed --steps times after --warmup steps (median), in --rounds rounds (every
peer once per round, the best round kept: the machine may be shared).
Printed per peer:
seconds per step, Mparam/s, and GB/s of host memory traffic, counted for
every peer with the same model of the bytes an AdamW step must move per
parameter: parameter read + write, gradient read, both states read + write
(fp32: 28 B; bf16 weights + bf16 states: 14 B; 8-bit states: 2 + 2 B + the
block absmax; the count comes from the C++ core, optim_bytes_per_element).
Temporaries a peer makes (torch's foreach path) are not counted. Adafactor
peers (a fixed lr, as trainers set it: ADAFACTOR below) count the parameter
read and written and the gradient read; tensors are matrices of COLS columns
so that Adafactor factors them.

    .venv/bin/python bench/bench_optim.py [--params 100e6] [--tensors 50] [--threads N] [--json]

DeepSpeed's DeepSpeedCPUAdam is measured when `deepspeed` imports from
--deepspeed-path (default build/bench-deps; it is not a project dependency):

    .venv/bin/pip download deepspeed==0.19.8 --no-deps -d /tmp/ds
    .venv/bin/pip install --no-deps --target build/bench-deps /tmp/ds/deepspeed-0.19.8.tar.gz \\
        hjson msgpack py-cpuinfo einops

Its first use compiles its cpu_adam op with the C++ compiler (about 3 minutes
on 2 cores; torch caches it). When it cannot be imported or built, its row
says why. docs/benchmarks.md has the table and the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from peer_process import run_peer_process

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# name: (kind, param dtype, state precision / torch variant, description)
PEERS = {
    "torch-single": ("torch", "float32", "single", "torch.optim.AdamW(foreach=False) (torch's CPU default)"),
    "torch-foreach": ("torch", "float32", "foreach", "torch.optim.AdamW(foreach=True)"),
    "torch-fused": ("torch", "float32", "fused", "torch.optim.AdamW(fused=True)"),
    "deepspeed": ("deepspeed", "float32", "fp32", "deepspeed.ops.adam.DeepSpeedCPUAdam (AdamW mode)"),
    "ls-fp32": ("layerstream", "float32", "fp32", "layerstream AdamW, fp32 weights, fp32 states"),
    "ls-8bit": ("layerstream", "float32", "8bit", "layerstream AdamW, fp32 weights, 8-bit states"),
    "ls-bf16": ("layerstream", "bfloat16", "bf16", "layerstream AdamW, bf16 weights (SR), bf16 states"),
    "ls-bf16-fp32": ("layerstream", "bfloat16", "fp32", "layerstream AdamW, bf16 weights (SR), fp32 states (default)"),
    "ls-bf16-8bit": ("layerstream", "bfloat16", "8bit", "layerstream AdamW, bf16 weights (SR), 8-bit states"),
    "hf-adafactor": ("transformers", "float32", "adafactor", "transformers Adafactor, fp32 weights"),
    "hf-adafactor-bf16": ("transformers", "bfloat16", "adafactor", "transformers Adafactor, bf16 weights (RNE)"),
    "ls-adafactor": ("layerstream", "float32", "adafactor", "layerstream Adafactor, fp32 weights"),
    "ls-adafactor-bf16": ("layerstream", "bfloat16", "adafactor", "layerstream Adafactor, bf16 weights (SR)"),
}
# Adafactor's settings in every Adafactor peer: a fixed learning rate, as
# trainers set it (transformers' defaults would scale it by each step).
ADAFACTOR = dict(lr=1e-4, scale_parameter=False, relative_step=False, warmup_init=False)
# Tensors are matrices of this many columns when their size allows (Adafactor
# factors the second moment of matrices); AdamW does not care.
COLS = 1000


def worker(args):
    """One peer in this process: prints one JSON line."""
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    kind, dtype_name, variant, desc = PEERS[args.worker]
    dtype = getattr(torch, dtype_name)
    out = {"peer": args.worker, "what": desc, "params": args.params, "torch_threads": torch.get_num_threads()}
    if kind == "deepspeed":
        sys.path.insert(0, args.deepspeed_path)
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401 - the import is the check
        except Exception as e:  # noqa: BLE001 - any failure is reported as the row's reason
            out["error"] = f"deepspeed not importable from {args.deepspeed_path}: {type(e).__name__}: {e}"
            print(json.dumps(out))
            return
    per = args.params // args.tensors
    gen = torch.Generator().manual_seed(0)
    params = []
    for _ in range(args.tensors):
        shape = (per // COLS, COLS) if per % COLS == 0 else (per,)
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
        p.grad = (torch.randn(shape, generator=gen) * 1e-2).to(dtype)
        params.append(p)
    import layerstream

    if args.threads:
        layerstream._C.optim_set_threads(args.threads)
    if variant == "adafactor":
        if kind == "transformers":
            from transformers.optimization import Adafactor
        else:
            Adafactor = layerstream.optim.Adafactor
            out["threads"] = layerstream._C.optim_threads()
            out["isa"] = layerstream._C.optim_kernel_isa()
        opt = Adafactor(params, **ADAFACTOR)
    elif kind == "torch":
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=variant == "foreach", fused=variant == "fused" or None)
    elif kind == "deepspeed":
        t0 = time.perf_counter()
        try:
            opt = DeepSpeedCPUAdam(params, lr=1e-4, weight_decay=1e-2, adamw_mode=True)
        except Exception as e:  # noqa: BLE001 - e.g. the op does not compile here
            out["error"] = f"DeepSpeedCPUAdam could not be built: {type(e).__name__}: {e}"
            print(json.dumps(out))
            return
        out["build_seconds"] = time.perf_counter() - t0
    else:
        opt = layerstream.optim.AdamW(params, lr=1e-4, state_precision=variant)
        out["threads"] = layerstream._C.optim_threads()
        out["isa"] = layerstream._C.optim_kernel_isa()
    if variant == "adafactor":
        # The parameter read and written, the gradient read (the factored
        # state is a row and a column per matrix).
        bpp = 3 * params[0].element_size()
    else:
        fmt = "fp32" if kind != "layerstream" else variant
        bpp = layerstream._C.optim_bytes_per_element(dtype_name, dtype_name, fmt)
    for _ in range(args.warmup):
        opt.step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    sec = statistics.median(times)
    n = per * args.tensors
    out.update(seconds_per_step=sec, mparams_per_s=n / sec / 1e6, bytes_per_param=bpp, gb_per_s=n * bpp / sec / 1e9,
               finite=bool(all(torch.isfinite(p).all() for p in params)))
    print(json.dumps(out))


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--tensors", type=int, default=50)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0,
                    help="threads of every peer (torch.set_num_threads and layerstream's pool); 0: their defaults")
    ap.add_argument("--peers", default=",".join(PEERS), help="comma-separated, from: " + ", ".join(PEERS))
    ap.add_argument("--deepspeed-path", default=os.path.join(ROOT, "build", "bench-deps"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.params = int(args.params)
    if args.worker:
        worker(args)
        return
    names = args.peers.split(",")
    for name in names:
        if name not in PEERS:
            ap.error(f"unknown peer {name!r}")
    load_before = os.getloadavg()
    best = {}
    # Rounds: every peer once per round, in turn, best run kept -- on a shared
    # machine the load changes over minutes, and this exposes every peer to
    # the same conditions.
    for rnd in range(args.rounds):
        for name in names:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--params", str(args.params),
                   "--tensors", str(args.tensors), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--deepspeed-path", args.deepspeed_path, "--threads", str(args.threads)]
            row = run_peer_process(cmd, name, what=PEERS[name][3])
            old = best.get(name)
            if old is None or ("error" in old and "error" not in row) or (
                    "error" not in row and row["mparams_per_s"] > old["mparams_per_s"]):
                best[name] = row
            print(f"  round {rnd + 1}: {name}: {row.get('mparams_per_s', row.get('error', ''))}", file=sys.stderr)
    rows = [best[n] for n in names]
    fused = next((r for r in rows if r["peer"] == "torch-fused" and "error" not in r), None)
    for r in rows:
        if fused and "error" not in r:
            r["vs_torch_fused"] = r["mparams_per_s"] / fused["mparams_per_s"]
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "params": args.params, "tensors": args.tensors,
            "steps": args.steps, "rounds": args.rounds, "threads": args.threads, "load_before": load_before, "load_after": os.getloadavg(),
            "rows": rows}
    if args.json:
        print(json.dumps(info, indent=1))
        return
    print(f"Optimizer step, {args.params / 1e6:.0f}M parameters in {args.tensors} tensors, median of {args.steps} steps, "
          f"best of {args.rounds} rounds, threads {args.threads or 'default'}; {info['cpu']}, {info['cores']} cores; load average "
          f"{load_before[0]:.2f} before, {info['load_after'][0]:.2f} after")
    print(f"{'peer':<14} {'s/step':>8} {'Mparam/s':>9} {'GB/s':>6} {'B/param':>8} {'vs fused':>9}  what")
    for r in rows:
        if "error" in r:
            print(f"{r['peer']:<14} {'-':>8} {'-':>9} {'-':>6} {'-':>8} {'-':>9}  {r['what']}: {r['error']}")
            continue
        vs = f"{r['vs_torch_fused']:.2f}x" if "vs_torch_fused" in r else "-"
        print(f"{r['peer']:<14} {r['seconds_per_step']:8.3f} {r['mparams_per_s']:9.0f} {r['gb_per_s']:6.1f} "
              f"{r['bytes_per_param']:8.1f} {vs:>9}  {r['what']}")
    if fused:
        for peer, goal in (("ls-fp32", 1.0), ("ls-bf16", 1.6)):
            r = next((x for x in rows if x["peer"] == peer and "error" not in x), None)
            if r:
                verdict = "met" if r["vs_torch_fused"] >= goal else "NOT met"
                print(f"goal {peer} >= {goal:.1f}x torch fused fp32: {r['vs_torch_fused']:.2f}x ({verdict})")
    for ours, theirs in (("ls-adafactor", "hf-adafactor"), ("ls-adafactor-bf16", "hf-adafactor-bf16")):
        a, b = (next((x for x in rows if x["peer"] == n and "error" not in x), None) for n in (ours, theirs))
        if a and b:
            print(f"{ours}: {a['mparams_per_s'] / b['mparams_per_s']:.2f}x {theirs}")


if __name__ == "__main__":
    main()
