"""Decoding a mixture-of-experts model: every expert vs only the routed ones (sim device).

A transformers Qwen3-MoE shaped like Qwen3-30B-A3B in miniature (bf16, 128
experts, 8 per token: 1/16 of the experts read per token), every layer
streamed with layerstream on the sim device over a modelled PCIe link. The same
greedy decode runs with offload(experts="all") (each step moves every expert
of every layer), experts="routed" (only the experts the router chose) and
routed with quantize="lossless" (the chosen experts' coded pieces, decoded bit
for bit on the device), side by side in one run; prints bytes moved and time
per generated token, and checks the logits against the resident model's, every
system fed the resident model's greedy tokens (exit status 1 beyond
--tolerance). On the sim device the time per token is mostly the CPU's own
compute (and its one-thread decoder); `--device cuda` measures the real link
(bench/gpu/run.sh runs it so).

    .venv/bin/python bench/bench_moe_decode.py [--device sim|cuda] [--tokens 16] [--link-gbps 25] [--repeats 3] [--json]

Every system (the resident model too) first decodes two tokens untimed (warm-up: the
streamed ones trace their steps there, and every system's first calls pay for
allocator and kernel warm-up), then the timed decode runs --repeats times; the
reported time per token is the median of those runs, with their min and max.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import layerstream  # noqa: E402


def build(args):
    import transformers
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
        moe_intermediate_size=args.expert_inter, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, num_experts=args.experts,
        num_experts_per_tok=args.top_k, max_position_embeddings=256)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval().requires_grad_(False)


def decode(model, prompt, tokens, forced=None):
    """Greedy decoding with the KV cache (or, with `forced`, feeding those tokens: every
    system then sees the same inputs); returns (generated ids, seconds per new token after
    the first, which also prefills, and each step's last logits on the CPU)."""
    out = model(input_ids=prompt, use_cache=True)
    logits = [out.logits[:, -1].float().cpu()]
    past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    ids = [int(nxt)]
    t0 = time.perf_counter()
    for i in range(tokens - 1):
        if forced is not None:
            nxt = torch.tensor([[forced[i]]], device=prompt.device)
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        ids.append(int(nxt))
        logits.append(out.logits[:, -1].float().cpu())
    return ids, (time.perf_counter() - t0) / max(1, tokens - 1), logits


def timed_decodes(model, prompt, tokens, repeats, forced=None, sync=None):
    """Warm-up (two tokens, untimed), then `repeats` timed decodes; returns (the first
    run's ids and logits, the seconds per token of every run)."""
    decode(model, prompt, 2)
    runs, first = [], None
    for _ in range(repeats):
        if sync:
            sync()
        ids, per_token, logits = decode(model, prompt, tokens, forced=forced)
        runs.append(per_token)
        if first is None:
            first = (ids, logits)
    return first[0], first[1], runs


def _spread(runs):
    """Median, min and max of per-token seconds, in ms."""
    ms = [r * 1e3 for r in runs]
    return statistics.median(ms), min(ms), max(ms)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="sim", help='"sim" (default) or "cuda"')
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--expert-inter", type=int, default=128)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--link-gbps", type=float, default=25.0)
    ap.add_argument("--repeats", type=int, default=3, help="timed decodes per system (median reported)")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="largest |logit - resident logit| accepted (bf16; 0 on the sim device in practice)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out-md", help="also write the markdown table to this file")
    args = ap.parse_args()
    on_gpu = args.device != "sim"
    if not on_gpu:
        torch.set_num_threads(1)
    compute = torch.device(args.device if on_gpu else "cpu")

    base = build(args)
    prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1)).to(compute)
    sync = (lambda: torch.cuda.synchronize(compute)) if on_gpu else None
    with torch.no_grad():
        resident = copy.deepcopy(base).to(compute)
        want, want_logits, resident_runs = timed_decodes(resident, prompt, args.tokens, args.repeats, sync=sync)
        del resident
    resident_ms, resident_min, resident_max = _spread(resident_runs)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in base.named_parameters() if "experts" in n)
    rows = []
    for label, mode, quantize in (("all", "all", None), ("routed", "routed", None),
                                  ("routed, lossless", "routed", "lossless")):
        model = copy.deepcopy(base)
        handle = layerstream.offload(model, device=args.device, experts=mode, quantize=quantize,
                                     sim_link_gbps=args.link_gbps, sim_latency_us=5.0)
        with torch.no_grad():
            decode(model, prompt, 2)  # warm-up: traces the steps (timed_decodes repeats it)
            before = handle.stats()
            # Fed the resident model's tokens, so that a near tie decided the other way by
            # last-bit differences (another GEMM algorithm on the GPU) cannot derail the run.
            got, logits, runs = timed_decodes(model, prompt, args.tokens, args.repeats, forced=want, sync=sync)
            after = handle.stats()
        diff = max(float((a - b).abs().max()) for a, b in zip(logits, want_logits))
        # bytes per call: one prefill + tokens - 1 decode calls per run, plus the 2-token warm-up
        calls = args.repeats * args.tokens + 2
        ms, ms_min, ms_max = _spread(runs)
        rows.append({
            "system": label,
            "experts": mode,
            "quantize": quantize,
            "ms_per_token": ms,
            "ms_per_token_min": ms_min,
            "ms_per_token_max": ms_max,
            "mib_per_call": (after["h2d_bytes"] - before["h2d_bytes"]) / calls / 2**20,
            "routed_fetches": int(after["routed_fetches"] - before["routed_fetches"]),
            "same_tokens_as_resident": got == want,
            "max_abs_logit_diff": diff,
            "matches_resident": diff <= args.tolerance,
        })
        handle.detach()
    info = {"experts_mib": expert_bytes / 2**20, "layers": args.layers, "experts": args.experts,
            "top_k": args.top_k, "device": args.device, "link_gbps": args.link_gbps if not on_gpu else None,
            "tokens": args.tokens, "repeats": args.repeats, "resident_ms_per_token": resident_ms,
            "resident_ms_per_token_min": resident_min, "resident_ms_per_token_max": resident_max}
    lines = [
        f"Qwen3-MoE shape, bf16, {args.layers} layers x {args.experts} experts ({args.top_k} per token), "
        f"{info['experts_mib']:.0f} MiB of experts; "
        f"{f'sim link {args.link_gbps} GB/s' if not on_gpu else args.device}; {args.tokens} tokens, greedy; "
        f"every system warmed up, then {args.repeats} timed runs (median, min-max); "
        f"resident: {resident_ms:.1f} ms / token ({resident_min:.1f}-{resident_max:.1f})",
        "",
        "| offload() | ms / token (median) | min-max | MiB on the bus / call | routed fetches | "
        "max abs logit diff vs resident | same greedy tokens |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r['system']} | {r['ms_per_token']:.1f} | {r['ms_per_token_min']:.1f}-"
                     f"{r['ms_per_token_max']:.1f} | {r['mib_per_call']:.1f} | {r['routed_fetches']} | "
                     f"{r['max_abs_logit_diff']:.3g}{'' if r['matches_resident'] else ' (over tolerance)'} | "
                     f"{'yes' if r['same_tokens_as_resident'] else 'no'} |")
    lines += ["", f"routed / all: {rows[1]['ms_per_token'] / rows[0]['ms_per_token']:.3f} of the time, "
                  f"{rows[1]['mib_per_call'] / rows[0]['mib_per_call']:.3f} of the bytes; "
                  f"lossless / plain, routed: {rows[2]['ms_per_token'] / rows[1]['ms_per_token']:.3f} of the time, "
                  f"{rows[2]['mib_per_call'] / rows[1]['mib_per_call']:.3f} of the bytes"]
    if args.out_md:
        with open(args.out_md, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.json:
        print(json.dumps({"config": info, "rows": rows}, indent=2))
    else:
        print("\n".join(lines))
    return 0 if all(r["matches_resident"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
