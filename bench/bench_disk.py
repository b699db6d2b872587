"""The disk tier (docs/design/host-tier.md), measured on this machine's disk.

1. Cold-cache read throughput of layerstream's reader (``_C.read_file_into``: pread
   in 8 MiB chunks on reader threads, core/io/source_file.h) against one plain
   sequential ``read()`` of the same file into a preallocated buffer, the file
   dropped from the page cache (posix_fadvise DONTNEED) before every read. The two
   take turns, --rounds times; medians. Goal: ours >= 0.9x plain.
2. A sim-device inference step of a stack of --layers Linear(--width, --width) fp32
   layers loaded with load_safetensors() and streamed from disk under a host budget
   of a quarter of the weights (the page cache dropped before every step, so every
   read is cold), against the three floors: the same step's compute (the model
   resident), its disk read time (bytes read per step at the reader's cold rate) and
   its link time (bytes copied / --gbps); the disk floor is a cold read of the same
   file with the reader, between steps. Goal: step <= 1.15x max(floors).

    .venv/bin/python bench/bench_disk.py [--mb 512] [--layers 16] [--width 2048] [--gbps 25] [--device sim|cuda]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import layerstream  # noqa: E402
from layerstream import _C  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


def cold_read_plain(path: str, buf: bytearray) -> float:
    _C.drop_page_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buf)
        got = 0
        while got < len(buf):
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return time.perf_counter() - t0


def cold_read_ours(path: str, out: torch.Tensor) -> float:
    _C.drop_page_cache(path)
    t0 = time.perf_counter()
    _C.read_file_into(path, 0, out, "whole file")
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512, help="size of the read-throughput file")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gbps", type=float, default=25.0, help="sim link GB/s")
    ap.add_argument("--device", default="sim", help="sim (default) or cuda: the step's device")
    ap.add_argument("--dir", default=None, help="where to write the files (default: a temp dir)")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(dir=args.dir)
    # 1. Read throughput.
    path = os.path.join(tmp, "blob.bin")
    size = args.mb << 20
    with open(path, "wb") as f:
        chunk = os.urandom(8 << 20)
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    buf = bytearray(size)
    out = torch.empty(size, dtype=torch.uint8)
    plain, ours = [], []
    for _ in range(args.rounds):
        plain.append(cold_read_plain(path, buf))
        ours.append(cold_read_ours(path, out))
    p, o = statistics.median(plain), statistics.median(ours)
    gbs = lambda t: size / t / 1e9  # noqa: E731
    print(f"cold read of {args.mb} MiB ({args.rounds} rounds, medians):")
    print(f"  plain read()          {gbs(p):6.2f} GB/s")
    print(f"  layerstream reader    {gbs(o):6.2f} GB/s   ratio {p / o:.2f}x (goal >= 0.9x)")
    os.remove(path)

    # 2. A step streamed from disk.
    torch.manual_seed(0)
    w = args.width
    ref = nn.Sequential(*[nn.Linear(w, w, bias=False) for _ in range(args.layers)]).requires_grad_(False)
    model_path = os.path.join(tmp, "model.safetensors")
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, model_path)
    with open(model_path, "rb+") as f:
        os.fsync(f.fileno())
    weights = sum(p.numel() * p.element_size() for p in ref.parameters())
    dev = torch.device("cpu") if args.device == "sim" else torch.device(args.device)
    x = torch.randn(4, w, device=dev)

    def timed(step, before=None):
        ts = []
        for i in range(args.steps + 1):
            if before:
                before()
            t0 = time.perf_counter()
            step()
            if i:
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    model_bytes = os.path.getsize(model_path)
    whole = torch.empty(model_bytes, dtype=torch.uint8)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    with torch.no_grad():
        ref.to(dev)
        compute = timed(lambda: (ref(x), sync()))
        ref.to("cpu")
        with torch.device("meta"):
            model = nn.Sequential(*[nn.Linear(w, w, bias=False) for _ in range(args.layers)]).requires_grad_(False)
        layerstream.load_safetensors(model, model_path)
        # A quarter of the weights, but at least the two staging entries the disk tier needs.
        budget = max(weights // 4, 2 * w * w * 4)
        handle = layerstream.offload(model, device=args.device, host_budget=budget, sim_link_gbps=args.gbps,
                                     checker=False)
        model(x)  # the first step records the trace
        handle.synchronize()
        before = handle.stats()
        # The step and a cold read of the same file take turns (the same disk, the same load).
        disk_ts, step_ts = [], []
        for _ in range(args.steps):
            disk_ts.append(cold_read_ours(model_path, whole))
            _C.drop_page_cache(model_path)
            t0 = time.perf_counter()
            model(x)
            handle.synchronize()  # the engine's streams
            sync()  # and the compute stream's last layer
            step_ts.append(time.perf_counter() - t0)
        after = handle.stats()
    step, disk_file = statistics.median(step_ts), statistics.median(disk_ts)
    disk_bytes = (after["disk_read_bytes"] - before["disk_read_bytes"]) / args.steps
    h2d = (after["h2d_bytes"] - before["h2d_bytes"]) / args.steps
    disk_t = disk_file * disk_bytes / model_bytes
    link_t = h2d / (args.gbps * 1e9)  # on cuda: --gbps is the link's measured pinned rate
    floor = max(compute, disk_t, link_t)
    # The disk's speed drifts (a shared virtual disk): each step against the floor with
    # the cold read just before it, the median of those ratios.
    ratio = statistics.median(s / max(compute, d * disk_bytes / model_bytes, link_t) for s, d in zip(step_ts, disk_ts))
    print(f"\n{args.device} step, {args.layers} x Linear({w}, {w}) fp32 = {weights / 2**20:.0f} MiB, host_budget = "
          f"{budget / 2**20:.0f} MiB ({after['staging_entries']} staging entries), page cache dropped before each step; medians of "
          f"{args.steps}:")
    print(f"  compute (resident)    {compute * 1e3:8.1f} ms")
    print(f"  disk read             {disk_t * 1e3:8.1f} ms  ({disk_bytes / 2**20:.0f} MiB/step; a cold read of the "
          f"file between steps: {model_bytes / disk_file / 1e9:.2f} GB/s)")
    print(f"  link                  {link_t * 1e3:8.1f} ms  ({h2d / 2**20:.0f} MiB/step at {args.gbps} GB/s)")
    print(f"  step, disk tier       {step * 1e3:8.1f} ms   = {step / floor:.2f}x max(floors); median of each step "
          f"against the read before it: {ratio:.2f}x (goal <= 1.15x)")
    handle.detach()
    os.remove(model_path)
    os.rmdir(tmp)


if __name__ == "__main__":
    main()
