#!/usr/bin/env python3
"""GPU proof: layerstream against a resident model, the seed system, accelerate, RamTorch and
diffusers' group offloading.

A synthetic transformer stack of bf16 Linear layers (default: 32 blocks of
d=4096 with q, k, v, o 4096x4096 and a 4x MLP, about 6.4B parameters, 12.9 GB)
is timed in two regimes (transfer-bound: few tokens per step; compute-bound:
many tokens) and two modes (inference: forward under no_grad; LoRA-style
training: frozen base weights, forward + backward with an input that requires
grad, so activation gradients flow through every layer).

Systems:
  resident     the model on the device (upper bound on speed)
  layerstream  layerstream.offload(model, device=..., budget=~10% of the weight bytes)
  layerstream-all-streamed  layerstream without a budget: every layer streams through its
               slots (nothing kept resident), so it moves the bytes the seed and RamTorch
               move: the engines compared on equal work (issue 27, item 3)
  layerstream-nf4  the same with quantize="nf4": packed weights cross the bus
               (0.28x the bytes) and are dequantized to bf16 on the device, on
               the transfer path; same budget (an extra row, not a target)
  layerstream-lossless  layerstream-all-streamed with quantize="lossless": entropy-coded
               weights (~0.66x the bytes), decoded on the device bit for bit (issue 28:
               transfer-bound step <= 0.72x layerstream-all-streamed's, the same outputs;
               both stream every layer, so the same ops run on the same bits: with a
               budget each would keep another set of layers resident)
  seed         the original system (--seed-impl PATH, imported from that path),
               LinearLayerMemoryManager attached to every Linear
  accelerate   accelerate.cpu_offload(model, execution_device)
  ramtorch     RamTorch 1.11 as its README's quick start shows one-GPU streaming:
               ramtorch.OffloadModel(chunks, device, window=2, pin=0, keep_activations=True),
               the stack's blocks as the chunks (its defaults: a window of 2 slots, nothing
               pinned, so it streams every block, the equal work; keep_activations=True is
               the mode it calls fastest, and layerstream keeps activations too); training
               through its step(x, grad_outputs=...). A parameterless first chunk makes it
               compute block 0's input gradient, which the other systems compute (x.grad)
               and its step() skips for its first chunk. (Its per-Linear
               replace_linear_with_ramtorch is deprecated in 1.11.)
  diffusers-group  diffusers' group offloading, block level, with streams:
               apply_group_offloading(model, onload_device, offload_type="block_level",
               num_blocks_per_group=1, use_stream=True) on the stack (its blocks a ModuleList)
  (RamTorch and diffusers are not dependencies of the library; requirements.txt pins them
  for the tests and the dry run. bench/gpu/fetch_peers.sh puts their wheels in .whl/, and
  run.sh installs them on the GPU machine; a peer that is not importable is a skipped row
  that says so.)
  engine-only  diagnostic, compute-bound rows only: layerstream's engine with one
               slot per layer and cache_across_steps, so after the first step
               nothing is copied; what it loses to `resident` is the engine's
               own per-layer cost (events, waits), not streaming (not judged)

Each system runs in its own subprocess (so its pinned memory, streams and peak
memory never touch another's; `--isolate row` gives every row its own process).
Children print one JSON line per row (prefix LSBENCH_JSON); the parent collects
them, adds the derived columns and target checks, and writes results.json and
results.md into --out.

--merge FILE (repeatable): the rows of systems not run now come from FILE, the
results.json of an earlier call with the same model, tokens and steps (checked), and
are judged with this call's (ratios, "faster than", the reasons where a peer is
ahead); results.md names them. The ten systems take longer than one device call
(~60 s each), so a session runs them in two (docs/benchmarks.md); bench/gpu/device.sh
keeps each call's results.json at build-gpu/proof/last-results.json for the next.

--dry-run: tiny sizes (4 blocks, d=64; 8 / 512 tokens; 3 timed steps), layerstream on
its simulated device "sim", the resident model, the seed's CPU path, RamTorch and
diffusers (without streams: they need a GPU) on the CPU, accelerate skipped. It checks
the script end to end; its timings mean nothing for a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

MARK = "LSBENCH_JSON "
REPO = Path(__file__).resolve().parents[2]
# The order they run in, which a tight --deadline-s cuts from the end: the references and
# the equal-work row first, then the peers not yet measured on a GPU (RamTorch, diffusers),
# the seed, the other layerstream formats, accelerate (the slowest, measured in the first
# proof), and engine-only last (an optional diagnostic).
SYSTEMS = ("resident", "layerstream", "layerstream-all-streamed", "ramtorch", "diffusers-group", "seed",
           "layerstream-lossless", "layerstream-nf4", "accelerate", "engine-only")
# The peers' Python packages (import name, the version the comparison was written against).
PEER_PACKAGES = {"accelerate": ("accelerate", None), "ramtorch": ("ramtorch", "1.11.0"),
                 "diffusers-group": ("diffusers", "0.42.1")}
# Peers whose copies layerstream's rows are compared with ("faster than ...").
PEERS = ("seed", "accelerate", "ramtorch", "diffusers-group")
# Peers that run on the CPU too (RamTorch's OffloadModel: "CPU is supported for tests,
# copies degrade to clones"; diffusers' group offloading, without streams, which need a
# GPU): the dry run runs them when importable, to try their code.
DRY_PEERS = {"ramtorch", "diffusers-group"}
# The rows each system runs (default: all); engine-only is a diagnostic of the
# compute-bound rows and costs GPU time, so it runs only those.
SYSTEM_ROWS = {"engine-only": (("compute", "infer"), ("compute", "train"))}
# Diagnostics: skipped (not a failure) when fewer than OPTIONAL_MIN_LEFT_S
# seconds of --deadline-s are left, and their errors are reported but do not
# make the run fail.
OPTIONAL_SYSTEMS = {"engine-only"}
OPTIONAL_MIN_LEFT_S = 75
REGIMES = ("transfer", "compute")
MODES = ("infer", "train")

# Targets (goals: reported per row, never the exit status).
# The second proof (issue 27) tightened the first's (1.10x, 85%): runs 3 and 4 measured
# 1.00-1.01x resident and 99% of the peak.
T_COMPUTE_VS_RESIDENT = 1.05         # compute-bound, training and inference: layerstream <= 1.05x resident
T_TRANSFER_PCT_OF_PINNED = 0.90      # transfer-bound: >= 90% of measured pinned H2D peak
T_LOSSLESS_VS_PLAIN = 0.72           # transfer-bound: lossless step <= 0.72x layerstream-all-streamed (issue 28)
MEM_TOLERANCE_BYTES = 64 << 20       # allocator / cuBLAS-workspace slack for the memory check


# --------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------
def emit(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def fmt(x, spec=".2f", none="n/a") -> str:
    return none if x is None else format(x, spec)


# --------------------------------------------------------------------------
# child side
# --------------------------------------------------------------------------
def build_model(cfg: dict, device):
    """The synthetic stack, on `device`, weights filled cheaply and frozen."""
    import torch
    import torch.nn as nn

    d, hidden, bias = cfg["dim"], cfg["dim"] * cfg["mlp_mult"], cfg["bias"]

    class Block(nn.Module):
        # Attention's token mixing has no weights to stream; it is replaced by a
        # sum so the block is nothing but its six Linear layers.
        def __init__(self):
            super().__init__()
            kw = dict(bias=bias, dtype=torch.bfloat16, device="meta")
            self.q = nn.Linear(d, d, **kw)
            self.k = nn.Linear(d, d, **kw)
            self.v = nn.Linear(d, d, **kw)
            self.o = nn.Linear(d, d, **kw)
            self.up = nn.Linear(d, hidden, **kw)
            self.down = nn.Linear(hidden, d, **kw)

        def forward(self, x):
            h = x + self.o(self.q(x) + self.k(x) + self.v(x))
            return h + self.down(torch.relu(self.up(h)))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["blocks"]))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    model = Stack().to_empty(device=device)
    params = list(model.parameters())
    # One random pool, copied (at rotating offsets) into every tensor: cheap for
    # 12.9 GB, and every layer still gets its own bytes to stream.
    biggest = max(p.numel() for p in params)
    pool_n = biggest + (1 << 20)
    gen = torch.Generator(device="cpu").manual_seed(1234)
    scale = 0.5 / (d ** 0.5)
    pool = ((torch.rand(pool_n, generator=gen) - 0.5) * (2 * scale)).to(torch.bfloat16).to(device)
    with torch.no_grad():
        for i, p in enumerate(params):
            n = p.numel()
            start = (i * 1_000_003) % (pool_n - n + 1)
            p.copy_(pool[start:start + n].view_as(p))
            p.requires_grad_(False)
    del pool
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    largest = max(m.weight.numel() * 2 + (m.bias.numel() * 2 if m.bias is not None else 0)
                  for m in model.modules() if isinstance(m, nn.Linear))
    return model, weight_bytes, largest


def load_seed(path: str):
    spec = importlib.util.spec_from_file_location("ls_bench_seed_layer", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot import the seed implementation from {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _SeedManager:
    """The stand-in for the seed's MemoryManager: it only needs process_device."""

    def __init__(self, device):
        self.process_device = device


def budget_for(cfg: dict, weight_bytes: int, largest: int) -> int:
    # ~10% of the weight bytes, but never below what the engine needs to run
    # (2 slots of the largest layer; 3 to leave one for prefetch).
    return max(int(cfg["budget_frac"] * weight_bytes), int(3 * (largest + 512)))


def run_child(system: str, cfg: dict, rows: list) -> int:
    import torch

    torch.manual_seed(0)
    dry = cfg["dry_run"]
    threads = cfg.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    if not dry and not torch.cuda.is_available():
        emit({"kind": "fatal", "system": system, "error": "torch.cuda.is_available() is False"})
        return 1
    cuda = not dry
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")

    t0 = time.perf_counter()
    handle = None
    extra = {}
    try:
        if system == "resident":
            model, wbytes, largest = build_model(cfg, dev)
        else:
            model, wbytes, largest = build_model(cfg, torch.device("cpu"))
        if system.startswith("layerstream"):
            sys.path.insert(0, str(REPO / "python"))
            import layerstream

            quantize = {"layerstream-nf4": "nf4", "layerstream-lossless": "lossless"}.get(system)
            budget = (None if system in ("layerstream-all-streamed", "layerstream-lossless") else
                      budget_for(cfg, wbytes, largest))
            handle = layerstream.offload(model, device="cuda" if cuda else "sim", budget=budget,
                                         prefetch=cfg["prefetch"], sim_link_gbps=cfg["sim_link_gbps"],
                                         quantize=quantize)
            extra = {"budget_bytes": budget, "engine_layers": len(handle.layers), "quantize": quantize,
                     "layerstream_file": layerstream.__file__}
        elif system == "engine-only":
            sys.path.insert(0, str(REPO / "python"))
            import layerstream

            n_layers = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
            handle = layerstream.offload(model, device="cuda" if cuda else "sim", slots=n_layers + 1,
                                         prefetch=cfg["prefetch"], sim_link_gbps=cfg["sim_link_gbps"],
                                         cache_across_steps=True)
            extra = {"engine_layers": len(handle.layers), "slots": n_layers + 1,
                     "layerstream_file": layerstream.__file__}
        elif system == "seed":
            seed = load_seed(cfg["seed_impl"])
            mgr = _SeedManager(dev)
            n = 0
            for m in model.modules():
                if isinstance(m, torch.nn.Linear):
                    seed.LinearLayerMemoryManager.attach(m, mgr)
                    n += 1
            extra = {"seed_layers": n, "seed_impl": cfg["seed_impl"]}
        elif system == "accelerate":
            import accelerate

            model = accelerate.cpu_offload(model, execution_device=dev)
            extra = {"accelerate_version": accelerate.__version__}
        elif system == "ramtorch":
            import ramtorch

            class Entry(torch.nn.Module):
                """No weights: its step() computes the input gradient of every chunk but the
                first, so block 0's is computed as the other systems compute x.grad."""

                def forward(self, h):
                    return h * 1

            model = ramtorch.OffloadModel([Entry(), *model.blocks], device=dev, window=2, pin=0,
                                          keep_activations=True)
            extra = {"ramtorch_version": ramtorch.__version__,
                     "ramtorch_api": "OffloadModel(window=2, pin=0, keep_activations=True)"}
        elif system == "diffusers-group":
            import diffusers
            from diffusers.hooks import apply_group_offloading

            # Streams as its users run it on a GPU; diffusers refuses them without one (dry run).
            apply_group_offloading(model, onload_device=dev, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1, use_stream=cuda)
            extra = {"diffusers_version": diffusers.__version__, "use_stream": cuda}
    except Exception as e:  # noqa: BLE001 - reported, the parent decides
        emit({"kind": "fatal", "system": system, "error": f"{type(e).__name__}: {e}",
              "traceback": traceback.format_exc()[-4000:]})
        return 1
    setup_s = time.perf_counter() - t0
    emit({"kind": "meta", "system": system, "weight_bytes": wbytes, "largest_layer_bytes": largest,
          "setup_s": setup_s, **extra})
    log(f"[{system}] set up in {setup_s:.1f}s (weights {fmt_bytes(wbytes)})")

    d = cfg["dim"]
    failed = False
    for regime, mode in rows:
        tokens = cfg["tokens"][regime]
        row = {"kind": "row", "system": system, "regime": regime, "mode": mode, "tokens": tokens}
        try:
            row.update(measure(system, model, handle, dev, cuda, tokens, d, mode, cfg, cfg["steps"][regime]))
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001
            failed = True
            oom = "out of memory" in str(e).lower()
            row.update({"status": "error", "error": f"{type(e).__name__}: {str(e)[:600]}", "oom": oom,
                        "traceback": traceback.format_exc()[-3000:]})
        emit(row)
        log(f"[{system}] {regime}/{mode}: " + (f"{row['step_ms']:.2f} ms/step" if row["status"] == "ok"
                                              else row["error"]))
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if handle is not None:
        try:
            emit({"kind": "final_stats", "system": system, "stats": handle.stats()})
        except Exception:  # noqa: BLE001
            pass
    return 1 if failed else 0


def measure(system, model, handle, dev, cuda, tokens, d, mode, cfg, n) -> dict:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(tokens)
    x = (torch.randn(tokens, d, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
    gout = None
    if mode == "train":
        x.requires_grad_(True)
        gout = (torch.randn(tokens, d, generator=gen) * 1e-3).to(torch.bfloat16).to(dev)

    def step():
        if mode == "infer":
            with torch.no_grad():
                y = model(x)
            del y
        elif system == "ramtorch":  # its training entry point: forward and backward of its chunks
            model.step(x, grad_outputs=gout)
        else:
            x.grad = None
            y = model(x)
            y.backward(gout)
            del y

    def full_sync():
        if cuda:
            torch.cuda.synchronize()
        if handle is not None:
            handle.synchronize()

    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(cfg["warmup"]):
        step()
    full_sync()
    stats0 = handle.stats() if handle is not None else None

    times_ms = []
    w0 = time.perf_counter()
    if cuda:
        # Events on the compute stream, no host sync between steps: a step's
        # time includes any transfer it waits for, and prefetch that runs into
        # the next step is not serialised by an artificial synchronize.
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        evs[0].record()
        for i in range(n):
            step()
            evs[i + 1].record()
        full_sync()
        times_ms = [evs[i].elapsed_time(evs[i + 1]) for i in range(n)]
    else:
        last = time.perf_counter()
        for _ in range(n):
            step()
            now = time.perf_counter()
            times_ms.append((now - last) * 1e3)
            last = now
        full_sync()
    wall_ms = (time.perf_counter() - w0) * 1e3 / n

    out = {"step_ms": statistics.median(times_ms), "step_ms_all": [round(t, 4) for t in times_ms],
           "wall_mean_ms": wall_ms, "steps": n, "warmup": cfg["warmup"]}
    if cuda:
        out["peak_device_bytes_torch"] = int(torch.cuda.max_memory_allocated())
    else:
        out["peak_device_bytes_torch"] = None
    if handle is not None:
        s1 = handle.stats()
        out["h2d_bytes_per_step"] = (s1["h2d_bytes"] - stats0["h2d_bytes"]) / n
        # peak_device_bytes = the slot arena (streamed_device_bytes, cudaMalloc'd
        # by the engine, outside torch's allocator) + the weights the planner
        # kept resident (resident_bytes: ordinary torch tensors on the device,
        # so torch.cuda.max_memory_allocated already counts them).
        out["peak_device_bytes_engine"] = int(s1.get("peak_device_bytes", 0))
        out["streamed_device_bytes"] = int(s1.get("streamed_device_bytes", s1.get("peak_device_bytes", 0)))
        out["resident_bytes"] = int(s1.get("resident_bytes", 0))
        out["engine"] = {k: s1.get(k) for k in ("slots", "slot_bytes", "budget_bytes", "max_slots_held",
                                                "pinned_bytes", "pageable_bytes", "ordering_errors")}
        for k in ("hits", "misses", "stall_seconds", "d2h_bytes", "deviations", "retraces"):
            if k in s1 and k in stats0:
                out["engine"][k + "_per_step"] = (s1[k] - stats0[k]) / n
    # The outputs (and input gradients) of one more step, for systems that must
    # compute the same bits (layerstream-lossless against layerstream-all-streamed): a digest.
    import hashlib
    x.grad = None
    if system == "ramtorch" and mode == "train":
        y = model.step(x, grad_outputs=gout).output  # its input gradients stay inside its step
    else:
        with torch.no_grad() if mode == "infer" else contextlib.nullcontext():
            y = model(x)
        if mode == "train":
            y.backward(gout)
    h = hashlib.sha1(y.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    if x.grad is not None:
        h.update(x.grad.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    out["out_digest"] = h.hexdigest()
    del x, gout, y
    return out


def time_calls(fn, cuda: bool, n: int = 10) -> float:
    """Median seconds of fn() over n calls after 2 warm-ups (CUDA events on the current
    stream, else perf_counter)."""
    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(n):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def lookup_probe(dry: bool) -> dict:
    """Embedding lookups: a table resident on the device against the same table streamed
    by layerstream (looked up in pinned host memory, only the rows named crossing the
    bus), a 152k x 4096 bf16 vocabulary as in recent language models. A diagnostic: its
    problems are reported, a result that differs from the resident lookup is a failure."""
    import torch
    import torch.nn as nn

    try:
        import layerstream

        vocab, dim, dtype = (5000, 64, torch.float32) if dry else (152064, 4096, torch.bfloat16)
        dev = torch.device("cpu" if dry else "cuda")
        table = torch.empty(vocab, dim, dtype=dtype).uniform_(-1, 1)
        ref = nn.Embedding.from_pretrained(table.to(dev), freeze=True)
        emb = nn.Embedding.from_pretrained(table, freeze=True)
        handle = layerstream.offload(emb, device="sim" if dry else "cuda")
        out = {"vocab": vocab, "dim": dim, "dtype": str(dtype).replace("torch.", ""),
               "table_bytes": table.numel() * table.element_size(), "rows": []}
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n in ((512, 4096) if dry else (4096, 32768)):
                ids = torch.randint(0, vocab, (n,), generator=gen).to(dev)
                exact = torch.equal(emb(ids), ref(ids))
                t_res = time_calls(lambda: ref(ids), not dry)
                t_str = time_calls(lambda: emb(ids), not dry)
                rows = n * dim * table.element_size()
                out["rows"].append({"ids": n, "row_bytes": rows, "resident_ms": t_res * 1e3,
                                    "streamed_ms": t_str * 1e3, "streamed_gbps": rows / t_str / 1e9,
                                    "exact": exact})
        handle.detach()
        return out
    except Exception as e:  # noqa: BLE001 - reported in results.md
        return {"error": f"{type(e).__name__}: {e}"}


def run_probe(cfg: dict) -> int:
    """Machine facts and the measured pinned host->device copy peak."""
    import torch

    info = {"kind": "probe", "torch": torch.__version__, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if cfg["dry_run"]:
        info.update({"device": "sim", "gpu": None,
                     "pinned_peak_gbps": cfg["sim_link_gbps"],
                     "pinned_peak_source": f"sim link model ({cfg['sim_link_gbps']} GB/s, not measured)"})
        info["lookup"] = lookup_probe(dry=True)
        emit(info)
        return 0
    if not torch.cuda.is_available():
        info["error"] = "torch.cuda.is_available() is False: no CUDA device (use --dry-run)"
        emit(info)
        return 1
    props = torch.cuda.get_device_properties(0)
    info.update({"device": "cuda", "gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
                 "gpu_memory_bytes": int(props.total_memory), "sm_count": props.multi_processor_count})
    nbytes = cfg["probe_bytes"]
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    gbps = []
    with torch.cuda.stream(s):
        for i in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            dst.copy_(src, non_blocking=True)
            b.record(s)
            b.synchronize()
            if i >= 2:
                gbps.append(nbytes / (a.elapsed_time(b) * 1e-3) / 1e9)
    # pageable, for reference (accelerate streams from pageable memory)
    pg = torch.empty(nbytes, dtype=torch.uint8)
    pg.fill_(1)
    torch.cuda.synchronize()
    t = time.perf_counter()
    dst.copy_(pg)
    torch.cuda.synchronize()
    info.update({"pinned_peak_gbps": max(gbps), "pinned_median_gbps": statistics.median(gbps),
                 "pinned_probe_bytes": nbytes,
                 "pinned_peak_source": f"measured: pinned CPU tensor of {fmt_bytes(nbytes)} -> cuda, "
                                       f"non_blocking, CUDA events, best of {len(gbps)}",
                 "pageable_gbps": nbytes / (time.perf_counter() - t) / 1e9})
    del src, dst, pg
    info["lookup"] = lookup_probe(dry=False)
    emit(info)
    return 0


# --------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------
def spawn(args_list: list, label: str, timeout_s: float, logf) -> tuple:
    """Runs a child, streams its log, returns (rc, json objects, timed_out)."""
    cmd = [sys.executable, "-u", str(Path(__file__).resolve())] + args_list
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         cwd=str(REPO), start_new_session=True)
    timed_out = threading.Event()

    def kill():
        timed_out.set()
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the child's own process group only
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    objs = []
    try:
        for line in p.stdout:
            if line.startswith(MARK):
                try:
                    objs.append(json.loads(line[len(MARK):]))
                except json.JSONDecodeError:
                    pass
                if logf:
                    logf.write(f"[{label}] {line}")
            else:
                sys.stderr.write(f"[{label}] {line}")
                if logf:
                    logf.write(f"[{label}] {line}")
        rc = p.wait()
    finally:
        timer.cancel()
    return rc, objs, timed_out.is_set()


def peak_total(torch_peak, eng_peak, streamed):
    """Device memory of one row, each byte once: torch's peak (activations,
    and on CUDA the weights the planner kept resident, which are torch
    tensors) + the engine's slot arena, allocated outside torch. Without a
    torch figure (sim/CPU), the engine's peak (slots + resident weights)."""
    if torch_peak is None:
        return eng_peak
    if eng_peak is None:
        return torch_peak
    return torch_peak + (streamed if streamed is not None else eng_peak)


def derive(rows: list, probe: dict, metas: dict, dry: bool) -> None:
    """Adds bytes, bandwidth, ideal, ratios and the target checks to every row."""
    peak_gbps = probe.get("pinned_peak_gbps")
    by = {(r["system"], r["regime"], r["mode"]): r for r in rows}
    for r in rows:
        if r.get("status") != "ok":
            continue
        sysname, mode = r["system"], r["mode"]
        wbytes = metas.get(sysname, {}).get("weight_bytes")
        if sysname.startswith("layerstream") or sysname == "engine-only":
            b, src = r.get("h2d_bytes_per_step"), "measured (engine h2d_bytes delta / steps)"
        elif sysname == "seed":
            passes = 2 if mode == "train" else 1
            b, src = (wbytes * passes if wbytes else None), f"computed ({passes}x weight bytes: " + (
                "forward + backward reload)" if passes == 2 else "forward)")
            if dry:
                b, src = 0, "computed (CPU path: no transfers)"
        elif sysname in ("accelerate", "diffusers-group"):
            b, src = wbytes, "computed (1x weight bytes: forward; autograd keeps the copies for backward)"
        elif sysname == "ramtorch":
            passes = 2 if mode == "train" else 1
            b, src = wbytes * passes if wbytes else None, (
                f"computed ({passes}x weight bytes: forward" + (" + backward's copy; its window keeps the last "
                                                                "2 blocks for the backward, a few % fewer)"
                                                                if passes == 2 else ")"))
        else:
            b, src = 0, "none (weights resident)"
        r["bytes_per_step"], r["bytes_source"] = b, src
        step_s = r["step_ms"] / 1e3
        r["gbps"] = (b / step_s / 1e9) if b else None
        r["pct_pinned_peak"] = (r["gbps"] / peak_gbps) if (r["gbps"] and peak_gbps) else None
        torch_peak, eng_peak = r.get("peak_device_bytes_torch"), r.get("peak_device_bytes_engine")
        r["peak_device_bytes_total"] = peak_total(torch_peak, eng_peak, r.get("streamed_device_bytes"))
        res = by.get(("resident", r["regime"], mode))
        res_ms = res["step_ms"] if res and res.get("status") == "ok" else None
        r["ratio_to_resident"] = (r["step_ms"] / res_ms) if res_ms else None
        xfer_ms = (b / (peak_gbps * 1e9) * 1e3) if (b and peak_gbps) else 0.0
        if res_ms is not None:
            r["ideal_ms"] = max(res_ms, xfer_ms)
            r["ratio_to_ideal"] = r["step_ms"] / r["ideal_ms"]
        else:
            r["ideal_ms"], r["ratio_to_ideal"] = None, None
        if sysname == "resident" and torch_peak is not None and wbytes is not None:
            r["activation_bytes_est"] = max(0, torch_peak - wbytes)

    for r in rows:
        checks = []
        if not r["system"].startswith("layerstream") or r.get("status") != "ok":
            r["checks"], r["verdict"] = checks, ("—" if r.get("status") == "ok" else r.get("status", "?"))
            continue
        regime, mode = r["regime"], r["mode"]
        # A dry run's timings (the sim device on CPU cores) judge nothing: its speed checks are n/a.
        if regime == "compute":
            v = r.get("ratio_to_resident")
            checks.append({"name": f"<= {T_COMPUTE_VS_RESIDENT:.2f}x resident",
                           "value": v, "pass": None if v is None or dry else v <= T_COMPUTE_VS_RESIDENT})
        if regime == "transfer":
            v = r.get("pct_pinned_peak")
            checks.append({"name": f">= {T_TRANSFER_PCT_OF_PINNED:.0%} pinned peak",
                           "value": v, "pass": None if v is None or dry else v >= T_TRANSFER_PCT_OF_PINNED})
        budget = metas.get(r["system"], {}).get("budget_bytes")
        eng = r.get("peak_device_bytes_engine")
        if budget is not None and eng is not None:
            checks.append({"name": "engine peak <= budget", "value": eng, "pass": eng <= budget})
        res = by.get(("resident", regime, mode))
        act = res.get("activation_bytes_est") if res and res.get("status") == "ok" else None
        total = r.get("peak_device_bytes_total")
        if budget is not None and total is not None and (act is not None or dry):
            limit = budget + (act or 0) + (MEM_TOLERANCE_BYTES if act is not None else 0)
            checks.append({"name": "peak <= budget + activations", "value": total, "limit": limit,
                           "pass": total <= limit})
        plain = by.get(("layerstream-all-streamed", regime, mode))
        if r["system"] == "layerstream-lossless" and plain and plain.get("status") == "ok":
            checks.append({"name": "outputs == all-streamed's", "value": r.get("out_digest"),
                           "pass": r.get("out_digest") == plain.get("out_digest")})
            if regime == "transfer":
                v = r["step_ms"] / plain["step_ms"]
                checks.append({"name": f"<= {T_LOSSLESS_VS_PLAIN:.2f}x all-streamed", "value": v,
                               "pass": None if dry else v <= T_LOSSLESS_VS_PLAIN})
        for peer in PEERS:
            other = by.get((peer, regime, mode))
            if other and other.get("status") == "ok":
                # In a dry run the seed takes its CPU path (no transfers at all) while
                # layerstream waits for its modelled link: the comparison means nothing.
                checks.append({"name": f"faster than {peer}", "value": other["step_ms"],
                               "pass": None if dry else r["step_ms"] < other["step_ms"]})
        r["checks"] = checks
        decided = [c["pass"] for c in checks if c["pass"] is not None]
        r["verdict"] = "—" if not decided else ("PASS" if all(decided) else "FAIL")


# layerstream's rows judged against the peers: the plain one (each system uses the budget
# as its users would) and the equal-work one (every layer streams, as the peers do).
JUDGED = ("layerstream", "layerstream-all-streamed")


def not_ahead(rows: list, dry: bool) -> list[dict]:
    """Every (layerstream row, peer) where the peer's step was as fast or faster, with the
    reason the numbers give: the peer moved fewer bytes, or it used the link (transfer-
    bound) or the GPU (compute-bound) better. A first reading for the person who writes
    the statement into docs/benchmarks.md, not a verdict. Empty in a dry run."""
    if dry:
        return []
    by = {(r["system"], r["regime"], r["mode"]): r for r in rows if r.get("status") == "ok"}
    out = []
    for (sysname, regime, mode), r in by.items():
        if sysname not in JUDGED:
            continue
        for peer in PEERS:
            o = by.get((peer, regime, mode))
            if not o or o["step_ms"] > r["step_ms"]:
                continue
            lb, pb = r.get("bytes_per_step"), o.get("bytes_per_step")
            if lb and pb is not None and pb < 0.97 * lb:
                why = (f"{peer} moved fewer bytes per step ({fmt_bytes(pb)} against {fmt_bytes(lb)}): "
                       "not equal work")
            elif regime == "transfer":
                why = (f"as many bytes, but {peer} used the link better ({fmt(o.get('pct_pinned_peak'), '.0%')} "
                       f"of the pinned peak against {fmt(r.get('pct_pinned_peak'), '.0%')}): see the engine line "
                       "(misses, deviations)")
            else:
                why = (f"compute-bound: {peer} at {fmt(o.get('ratio_to_resident'))}x resident against "
                       f"{fmt(r.get('ratio_to_resident'))}x: layerstream's per-layer cost (see engine-only)")
            out.append({"system": sysname, "regime": regime, "mode": mode, "peer": peer,
                        "step_ms": r["step_ms"], "peer_step_ms": o["step_ms"],
                        "ratio": r["step_ms"] / o["step_ms"], "reason": why})
    return out


def cell(text) -> str:
    """Makes text safe for one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")[:300]


def check_str(r) -> str:
    out = []
    for c in r.get("checks", []):
        mark = "n/a" if c["pass"] is None else ("ok" if c["pass"] else "MISS")
        out.append(f"{c['name']}: {mark}")
    return "; ".join(out) if out else ""


def write_md(res: dict, path: Path) -> None:
    p = res["machine"]
    L = []
    title = "GPU proof (bench/gpu) — DRY RUN (sim device, CPU; timings say nothing about a GPU)" \
        if res["dry_run"] else "GPU proof (bench/gpu)"
    L.append(f"# {title}\n")
    L.append(f"- date: {res['date']}")
    L.append(f"- command: `{res['command']}`")
    L.append(f"- device: {p.get('gpu') or p.get('device')}; torch {p.get('torch')}"
             + (f" (CUDA {p['cuda']})" if p.get("cuda") else "") + f"; python {p.get('python')}")
    L.append(f"- CPU: {p.get('cpu', '?')} ({p.get('cpu_count')} logical cores visible)")
    L.append(f"- H2D reference peak: {fmt(p.get('pinned_peak_gbps'))} GB/s — {p.get('pinned_peak_source', '?')}"
             + (f"; pageable {fmt(p.get('pageable_gbps'))} GB/s" if p.get("pageable_gbps") else ""))
    c = res["config"]
    L.append(f"- model: {c['blocks']} blocks, d={c['dim']}, MLP {c['mlp_mult']}x, bf16, bias={c['bias']}: "
             f"{c.get('params', 0)/1e6:,.3f}M params, {fmt_bytes(c.get('weight_bytes'))} of weights")
    L.append(f"- tokens per step: transfer-bound {c['tokens']['transfer']}, compute-bound {c['tokens']['compute']};"
             f" {c['warmup']} warm-up + {c['steps']['transfer']} (transfer-bound) / {c['steps']['compute']}"
             " (compute-bound) timed steps, median reported")
    L.append(f"- layerstream budget: {fmt_bytes(c.get('budget_bytes'))} "
             f"({c['budget_frac']:.0%} of the bf16 weight bytes, at least 3 slots), prefetch {c['prefetch']}; "
             "layerstream-nf4: the same budget, weights packed as nf4 on the host and dequantized to bf16 "
             "on the device (an extra row; the issue's targets are judged on the layerstream rows); "
             "layerstream-lossless: every layer streamed as in layerstream-all-streamed, weights entropy-coded "
             "on the host and decoded bit for bit on the device (judged: outputs equal all-streamed's, "
             f"transfer-bound <= {T_LOSSLESS_VS_PLAIN}x its step); "
             "engine-only (compute-bound rows, diagnostic): one slot per layer and cache_across_steps, "
             "so no copies after the first step: its gap to resident is the engine's own per-layer cost")
    lk = p.get("lookup") or {}
    if lk.get("rows"):
        L.append(f"- embedding lookup ({lk['vocab']}×{lk['dim']} {lk['dtype']} table, "
                 f"{fmt_bytes(lk['table_bytes'])}; random ids, median of 10): "
                 + "; ".join(f"{r['ids']} ids: resident {r['resident_ms']:.3f} ms, layerstream (rows read from "
                             f"pinned host memory) {r['streamed_ms']:.3f} ms = {fmt(r['streamed_gbps'])} GB/s "
                             f"of rows, {'exact' if r['exact'] else 'DIFFERS'}" for r in lk["rows"]))
    b, t = res.get("build", {}), res.get("tests", {})
    L.append(f"- build: {b.get('status', '?')}" + (f" ({b['seconds']} s)" if b.get("seconds") else "")
             + (f" — {b['detail']}" if b.get("detail") else ""))
    L.append(f"- GPU tests: {t.get('status', '?')}" + (f" — {t['detail']}" if t.get("detail") else ""))
    cpp = t.get("cpp") or {}
    if cpp:
        L.append(f"- C++ CUDA tests: {cpp.get('status', '?')}" + (f" — {cpp['detail']}" if cpp.get("detail") else ""))
        dq = cpp.get("dequant_throughput")
        if dq:
            L.append(f"- dequantization to bf16, {dq['rows']}×{dq['cols']} (bench_quant): "
                     + "; ".join(f"{f['format']} device {fmt(f['cuda_gbps'] if f['cuda_gbps'] > 0 else None)} GB/s, "
                                 f"CPU {fmt(f['cpu_gbps'])} GB/s" for f in dq["formats"]))
        ld = cpp.get("lossless_decode")
        if ld:
            # Hidden behind the copy when the decoder writes faster than the link brings coded
            # bytes in, counted as output: pinned peak / coded ratio (issue 28).
            need = (p["pinned_peak_gbps"] / ld["coded_ratio"]) if p.get("pinned_peak_gbps") and ld["coded_ratio"] else None
            L.append(f"- lossless decode on the device (test_cuda_lossless), {ld['rows']}×{ld['cols']} bf16: "
                     f"{ld['ms']:.3f} ms, {fmt(ld['output_gbps'], '.1f')} GB/s of output, coded {ld['coded_ratio']:.3f} "
                     "of raw" + ("" if need is None else
                                 f"; the link delivers {need:.1f} GB/s of output at the pinned peak: decoding "
                                 + ("hidden behind the copy" if ld["output_gbps"] >= need else "NOT hidden (slower)")))
        for shape in sorted({(r["rows"], r["cols"]) for r in cpp.get("lossless_sweep", [])}):
            runs = [r for r in cpp["lossless_sweep"] if (r["rows"], r["cols"]) == shape]
            L.append(f"- lossless decode by block size, {shape[0]}×{shape[1]} bf16: " + "; ".join(
                f"{r['block']}{' (default)' if r['default'] else ''} {r['ms']:.3f} ms ({r['coded_ratio']:.4f} of raw)"
                for r in runs))
    L.append("")
    L.append("| system | regime | mode | tokens | step ms | × resident | × ideal | GB/s | % pinned peak "
             "| peak device mem | verdict | checks |")
    L.append("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in res["rows"]:
        name = r["system"] + (" (earlier call)" if r.get("merged_from") else "")
        if r.get("status") != "ok":
            L.append(f"| {name} | {r.get('regime', '—')} | {r.get('mode', '—')} | {r.get('tokens', '')} "
                     f"| {r.get('status')} | | | | | | {r.get('status')} | {cell(r.get('reason') or r.get('error', ''))} |")
            continue
        pct = r.get("pct_pinned_peak")
        L.append(
            f"| {name} | {r['regime']} | {r['mode']} | {r['tokens']} | {r['step_ms']:.2f} "
            f"| {fmt(r.get('ratio_to_resident'))} | {fmt(r.get('ratio_to_ideal'))} | {fmt(r.get('gbps'), '.3g')} "
            f"| {fmt(None if pct is None else pct * 100, '.0f')}{'%' if pct is not None else ''} "
            f"| {fmt_bytes(r.get('peak_device_bytes_total'))} | {r.get('verdict')} | {check_str(r)} |")
    L.append("")
    L.append("Columns: step ms = median over the timed steps (CUDA events on the compute stream; perf_counter "
             "on CPU/sim); × ideal = step / max(resident step, bytes streamed per step / H2D peak); GB/s = bytes "
             "streamed per step / step time (layerstream: measured h2d bytes; the peers': computed); peak "
             "device mem = torch.cuda.max_memory_allocated + layerstream's slot arena (streamed_device_bytes, "
             "allocated outside torch; the weights its planner keeps resident are torch tensors, counted once). Targets (goals, not the exit status): compute-bound ≤ "
             f"{T_COMPUTE_VS_RESIDENT:.2f}× resident; transfer-bound ≥ {T_TRANSFER_PCT_OF_PINNED:.0%} of the "
             "pinned peak; engine peak ≤ budget; total peak ≤ budget + the resident run's activations "
             f"(+{MEM_TOLERANCE_BYTES >> 20} MiB); faster than each peer that ran (seed, accelerate, RamTorch, "
             "diffusers group offloading).")
    if res.get("regime_check"):
        L.append("")
        L.append("Regime check (resident step vs the time to stream the weights once per pass at the H2D peak):")
        for rc in res["regime_check"]:
            L.append(f"- {rc['regime']}/{rc['mode']}: resident {fmt(rc['resident_ms'])} ms vs transfer "
                     f"{fmt(rc['transfer_ms'])} ms → {rc['bound']}-bound")
    eng_rows = [r for r in res["rows"] if r.get("engine")]
    if eng_rows:
        L.append("")
        L.append("layerstream engine per timed step (fetches that were prefetched or cached / fetched on "
                 "demand / off the traced order; slots):")
        for r in eng_rows:
            e = r["engine"]
            L.append(f"- {r['system']} {r['regime']}/{r['mode']}: hits {fmt(e.get('hits_per_step'), '.1f')}, "
                     f"misses {fmt(e.get('misses_per_step'), '.1f')}, deviations "
                     f"{fmt(e.get('deviations_per_step'), '.1f')}; {e.get('slots')} slots")
    behind = res.get("not_ahead")
    if behind:
        L.append("")
        L.append("Where layerstream is not ahead (the reason the numbers give; the statement in "
                 "docs/benchmarks.md confirms or corrects it):")
        for n in behind:
            L.append(f"- {n['system']} {n['regime']}/{n['mode']}: {n['step_ms']:.2f} ms against {n['peer']} "
                     f"{n['peer_step_ms']:.2f} ms ({n['ratio']:.3f}x): {n['reason']}")
    merged = [f"- {s}: {v['merged_from']}" for s, v in res["systems"].items() if v.get("merged_from")]
    if merged:
        L.append("")
        L.append("Rows measured by an earlier call (--merge; same model and work), judged with this call's:")
        L.extend(merged)
    skipped = [f"- {s}: {v['reason']}" for s, v in res["systems"].items() if v.get("status") == "skipped"]
    if skipped:
        L.append("")
        L.append("Skipped systems:")
        L.extend(skipped)
    if res["failures"]:
        L.append("")
        L.append("Failures:")
        L.extend(f"- {f}" for f in res["failures"])
    if res.get("optional_problems"):
        L.append("")
        L.append("Optional diagnostics not run or failed (not counted as failures):")
        L.extend(f"- {f}" for f in res["optional_problems"])
    path.write_text("\n".join(L) + "\n")


# What must be equal for rows of two calls to be judged together.
SAME_WORK = ("dry_run", "blocks", "dim", "mlp_mult", "bias", "tokens", "steps", "warmup", "budget_frac",
             "prefetch", "weight_bytes", "budget_bytes")


def load_merges(paths: list, cfg: dict) -> list:
    """[(path, its results)] of each --merge FILE, checked (load_merges_from)."""
    read = []
    for p in paths:
        try:
            read.append((p, json.loads(Path(p).read_text())))
        except (OSError, ValueError) as e:
            raise ValueError(f"--merge {p}: cannot read it ({e})") from None
    return load_merges_from(read, cfg)


def load_merges_from(read: list, cfg: dict) -> list:
    """The (path, results) pairs, checked against this call's model and work; raises
    ValueError naming what differs."""
    out = []
    for p, res in read:
        if not res.get("rows") or not res.get("config"):
            raise ValueError(f"--merge {p}: no comparison rows in it (its call did not run the compare stage)")
        diff = [k for k in SAME_WORK if res["config"].get(k) != cfg.get(k)]
        if diff:
            what = ", ".join(f"{k}: {res['config'].get(k)} there, {cfg.get(k)} here" for k in diff)
            raise ValueError(f"--merge {p}: another model or work ({what})")
        out.append((p, res))
    return out


def merge_rows(merges: list, wanted: list, systems: dict, metas: dict, rows: list) -> None:
    """Adds the merged calls' measured rows of the systems not run now (the latest file
    wins); derive() then writes their derived columns again, judged with this call's."""
    taken = set(wanted)
    for path, res in reversed(merges):
        mine = {r["system"] for r in res["rows"] if r.get("status") == "ok"} - taken
        for sname in sorted(mine, key=SYSTEMS.index):
            rows.extend({**r, "merged_from": res.get("date")}
                        for r in res["rows"] if r["system"] == sname and r.get("status") == "ok")
            systems[sname] = {**res["systems"].get(sname, {}), "merged_from": f"{path} ({res.get('date')})"}
            if sname in res.get("metas", {}):
                metas[sname] = res["metas"][sname]
        taken |= mine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for results.json and results.md (parent mode)")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes, sim device, CPU")
    ap.add_argument("--seed-impl", default=None, help="path of the seed's seed_layer.py (optional)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--blocks", type=int)
    ap.add_argument("--dim", type=int)
    ap.add_argument("--mlp-mult", type=int, default=4)
    ap.add_argument("--no-bias", action="store_true", help="Linear layers without bias")
    ap.add_argument("--tokens-transfer", type=int)
    ap.add_argument("--tokens-compute", type=int)
    ap.add_argument("--steps", type=int, help="timed steps per row, both regimes")
    ap.add_argument("--steps-compute", type=int,
                    help="timed steps per compute-bound row (default 9 on a GPU: its steps vary by ~1-3%%)")
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--budget-frac", type=float, default=0.10)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--sim-link-gbps", type=float, default=None,
                    help="sim device link model (dry run; default 0.1 GB/s so the tiny model's "
                         "transfer-bound rows are transfer-bound)")
    ap.add_argument("--probe-bytes", type=int, default=1 << 30)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads in the children")
    ap.add_argument("--isolate", choices=("system", "row"), default="system",
                    help="one subprocess per system (default) or per row")
    ap.add_argument("--child-timeout", type=float, default=None, help="seconds per subprocess")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="wall-clock seconds for the whole comparison; systems that would start after "
                         "it are skipped, a running one is cut at it")
    ap.add_argument("--build-status", default="unknown")
    ap.add_argument("--build-seconds", default=None)
    ap.add_argument("--build-detail", default="")
    ap.add_argument("--tests-json", default=None, help="JSON file from run.sh's test step")
    ap.add_argument("--merge", action="append", default=[], metavar="FILE",
                    help="an earlier call's results.json: its rows of systems not run now join this one's")
    ap.add_argument("--command", default=None, help="the command line to record")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-cfg", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-rows", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.child:
        cfg = json.loads(a.child_cfg)
        if a.child == "probe":
            return run_probe(cfg)
        rows = [tuple(x.split("/")) for x in a.child_rows.split(",")]
        return run_child(a.child, cfg, rows)

    if not a.out:
        ap.error("--out is required")
    dry = a.dry_run
    dflt = dict(blocks=4, dim=64, tt=8, tc=512, steps=3, steps_c=3, warmup=2, timeout=60) if dry else \
        dict(blocks=32, dim=4096, tt=512, tc=32768, steps=5, steps_c=9, warmup=2, timeout=150)
    cfg = {
        "dry_run": dry,
        "blocks": a.blocks or dflt["blocks"], "dim": a.dim or dflt["dim"], "mlp_mult": a.mlp_mult,
        "bias": not a.no_bias,
        "tokens": {"transfer": a.tokens_transfer or dflt["tt"], "compute": a.tokens_compute or dflt["tc"]},
        "steps": {"transfer": a.steps or dflt["steps"],
                  "compute": a.steps_compute or a.steps or dflt["steps_c"]},
        "warmup": a.warmup if a.warmup is not None else dflt["warmup"],
        "budget_frac": a.budget_frac, "prefetch": a.prefetch,
        "sim_link_gbps": a.sim_link_gbps if a.sim_link_gbps is not None else 0.1,
        "probe_bytes": a.probe_bytes, "threads": a.threads,
        "seed_impl": str(Path(a.seed_impl).resolve()) if a.seed_impl else None,
    }
    d, h = cfg["dim"], cfg["dim"] * cfg["mlp_mult"]
    per_block = 4 * d * d + 2 * d * h + ((4 * d + h + d) if cfg["bias"] else 0)
    cfg["params"] = per_block * cfg["blocks"]
    cfg["weight_bytes"] = cfg["params"] * 2
    largest = max(d * h, d * d) * 2 + (max(h, d) * 2 if cfg["bias"] else 0)
    cfg["budget_bytes"] = budget_for(cfg, cfg["weight_bytes"], largest)
    timeout = a.child_timeout or dflt["timeout"]

    def child_timeout() -> float:
        if not a.deadline_s:
            return timeout
        return max(5.0, min(timeout, a.deadline_s - (time.perf_counter() - t_start)))

    try:
        merges = load_merges(a.merge, cfg)
    except ValueError as e:
        ap.error(str(e))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "compare.log", "w")
    t_start = time.perf_counter()
    failures = []
    notes = []  # problems of optional diagnostics: reported, not failures

    # 1. machine probe (and the pinned H2D peak)
    rc, objs, to = spawn(["--child", "probe", "--child-cfg", json.dumps(cfg)], "probe", 120, logf)
    probe = next((o for o in objs if o.get("kind") == "probe"), {})
    if rc != 0 or not probe or probe.get("error"):
        failures.append(f"machine probe failed (rc={rc}{', timed out' if to else ''}): "
                        f"{probe.get('error', 'no output')}")
    lk = probe.get("lookup") or {}
    if lk.get("error"):
        notes.append(f"embedding lookup probe: {lk['error']}")
    for r in lk.get("rows", []):
        if not r["exact"]:
            failures.append(f"embedding lookup probe: the streamed lookup of {r['ids']} ids differs from "
                            f"the resident table's")

    # 2. systems
    wanted = [s.strip() for s in a.systems.split(",") if s.strip()]
    for s in wanted:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r} (choose from {', '.join(SYSTEMS)})")
    systems, metas, rows = {}, {}, []
    all_rows = [(rg, md) for rg in REGIMES for md in MODES]
    for s in wanted:
        reason = None
        if s == "seed" and not cfg["seed_impl"]:
            reason = "--seed-impl not given (the seed is never in the repo; pass the path of seed_layer.py)"
        elif s == "seed" and not Path(cfg["seed_impl"]).is_file():
            reason = f"--seed-impl {cfg['seed_impl']} does not exist"
        elif s in PEER_PACKAGES:
            pkg, version = PEER_PACKAGES[s]
            importable = importlib.util.find_spec(pkg) is not None
            if dry and s not in DRY_PEERS:
                reason = "dry run: no CUDA device, and a peer offloading to the CPU from the CPU streams nothing"
            elif dry and not importable:
                reason = f"dry run: {pkg} is not importable in this python (run.sh installs it on the GPU machine)"
            elif not importable:
                reason = (f"{pkg} is not importable in this python" +
                          (f" (bench/gpu/fetch_peers.sh puts {pkg}=={version}'s wheel in .whl/, which run.sh "
                           f"installs; carry .whl)" if version else ""))
        if not dry and probe.get("device") != "cuda":
            reason = reason or "no CUDA device"
        if reason:
            systems[s] = {"status": "skipped", "reason": reason}
            rows.extend({"system": s, "regime": rg, "mode": md, "tokens": cfg["tokens"][rg],
                         "status": "skipped", "reason": reason} for rg, md in SYSTEM_ROWS.get(s, all_rows))
            log(f"[compare] {s}: skipped — {reason}")
            continue
        optional = s in OPTIONAL_SYSTEMS
        sink = notes if optional else failures  # where this system's problems are reported
        left = (a.deadline_s - (time.perf_counter() - t_start)) if a.deadline_s else None
        if left is not None and left < (OPTIONAL_MIN_LEFT_S if optional else 20):
            reason = (f"time budget: {left:.0f} s of --deadline-s {a.deadline_s:.0f} left"
                      + (f" (an optional diagnostic needs {OPTIONAL_MIN_LEFT_S} s)" if optional else
                         ", reached before it could start"))
            systems[s] = {"status": "skipped", "reason": reason}
            rows.extend({"system": s, "regime": rg, "mode": md, "tokens": cfg["tokens"][rg],
                         "status": "skipped", "reason": reason} for rg, md in SYSTEM_ROWS.get(s, all_rows))
            sink.append(f"{s}: not run ({reason})")
            log(f"[compare] {s}: skipped — {reason}")
            continue
        sys_rows = list(SYSTEM_ROWS.get(s, all_rows))
        groups = [sys_rows] if a.isolate == "system" else [[r] for r in sys_rows]
        systems[s] = {"status": "ok", "setup_s": []}
        for grp in groups:
            label = s if len(groups) == 1 else f"{s}:{grp[0][0]}/{grp[0][1]}"
            log(f"[compare] running {label} ...")
            rc, objs, to = spawn(["--child", s, "--child-cfg", json.dumps(cfg),
                                  "--child-rows", ",".join(f"{rg}/{md}" for rg, md in grp)],
                                 label, child_timeout(), logf)
            got = set()
            for o in objs:
                if o.get("kind") == "meta":
                    metas.setdefault(s, {}).update({k: v for k, v in o.items() if k not in ("kind", "system")})
                    systems[s]["setup_s"].append(round(o["setup_s"], 2))
                elif o.get("kind") == "row":
                    o.pop("kind")
                    rows.append(o)
                    got.add((o["regime"], o["mode"]))
                    if o["status"] != "ok":
                        sink.append(f"{s} {o['regime']}/{o['mode']}: {o.get('error')}")
                elif o.get("kind") == "fatal":
                    systems[s].update({"status": "error", "error": o["error"]})
                    sink.append(f"{s}: {o['error']}")
                elif o.get("kind") == "final_stats":
                    systems[s]["final_stats"] = o["stats"]
            why = "timed out" if to else f"exited with {rc}"
            fatal = next((o["error"] for o in objs if o.get("kind") == "fatal"), None)
            missing = [(rg, md) for rg, md in grp if (rg, md) not in got]
            for rg, md in missing:
                rows.append({"system": s, "regime": rg, "mode": md, "tokens": cfg["tokens"][rg],
                             "status": "error",
                             "error": f"not run: {fatal}" if fatal else f"no result: the subprocess {why}"})
            if missing and not fatal:
                sink.append(f"{s} {', '.join(f'{rg}/{md}' for rg, md in missing)}: no result "
                            f"(subprocess {why})")
            if rc != 0 and systems[s]["status"] == "ok":
                systems[s]["status"] = "error"
                systems[s].setdefault("error", f"subprocess {why}")

    merge_rows(merges, wanted, systems, metas, rows)
    derive(rows, probe, metas, dry)
    order = {s: i for i, s in enumerate(SYSTEMS)}
    rows.sort(key=lambda r: (REGIMES.index(r["regime"]), MODES.index(r["mode"]), order[r["system"]]))

    regime_check = []
    pk = probe.get("pinned_peak_gbps")
    for rg in REGIMES:
        for md in MODES:
            res = next((r for r in rows if r["system"] == "resident" and r["regime"] == rg and r["mode"] == md
                        and r.get("status") == "ok"), None)
            if res and pk:
                passes = 2 if md == "train" else 1
                xfer = cfg["weight_bytes"] * passes / (pk * 1e9) * 1e3
                regime_check.append({"regime": rg, "mode": md, "resident_ms": res["step_ms"], "transfer_ms": xfer,
                                     "passes": passes,
                                     "bound": "compute" if res["step_ms"] > xfer else "transfer"})

    tests = {"status": "not run"}
    if a.tests_json and Path(a.tests_json).is_file():
        try:
            tests = json.loads(Path(a.tests_json).read_text())
        except (OSError, json.JSONDecodeError) as e:
            tests = {"status": "unknown", "detail": f"cannot read {a.tests_json}: {e}"}
    if a.build_status not in ("ok", "skipped", "unknown"):
        failures.append(f"build: {a.build_status} {a.build_detail}".strip())
    if tests.get("status") == "failed":
        failures.append(f"GPU tests failed: {tests.get('detail', '')}")
    if (tests.get("cpp") or {}).get("status") == "failed":
        failures.append(f"C++ CUDA tests failed: {tests['cpp'].get('detail', '')}")

    verdicts = [r["verdict"] for r in rows if r["system"].startswith("layerstream") and r.get("status") == "ok"]
    res = {
        "schema": 1,
        "dry_run": dry,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": a.command or " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "machine": {k: v for k, v in probe.items() if k != "kind"},
        "config": cfg,
        "build": {"status": a.build_status, "seconds": a.build_seconds, "detail": a.build_detail},
        "tests": tests,
        "systems": systems,
        "metas": metas,
        "rows": rows,
        "regime_check": regime_check,
        "not_ahead": not_ahead(rows, dry),
        "targets": {"compute_vs_resident_max": T_COMPUTE_VS_RESIDENT,
                    "transfer_pct_of_pinned_min": T_TRANSFER_PCT_OF_PINNED,
                    "memory_tolerance_bytes": MEM_TOLERANCE_BYTES},
        "summary": {"layerstream_rows": len(verdicts), "pass": verdicts.count("PASS"),
                    "fail": verdicts.count("FAIL"), "compare_seconds": round(time.perf_counter() - t_start, 1)},
        "failures": failures,
        "optional_problems": notes,
    }
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    write_md(res, out / "results.md")
    logf.close()
    sys.stdout.write((out / "results.md").read_text())
    log(f"[compare] wrote {out / 'results.json'} and {out / 'results.md'} "
        f"({res['summary']['compare_seconds']} s); {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
