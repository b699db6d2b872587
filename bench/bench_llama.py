"""A real model shape: a transformers Llama-architecture model built from its config with
random bf16 weights (default: Llama-3-8B's shape, ~8.0B parameters), LoRA training steps
and greedy decoding, resident against streamed under a device budget.

Two peers, each in its own process on the same work (same weights from the same seed,
same token ids):

    resident     the model on the device
    layerstream  layerstream.offload(model, budget=--budget) (default 8 GiB)

Per peer: the LoRA training step (peft LoRA r=16 on q/k/v/o, frozen base, forward +
backward of a language-model loss on --batch x --seq tokens), greedy decoding of
--new-tokens tokens after a --prompt-token prompt (tokens/s), the first tokens' ids (the
two peers must agree: the same bf16 weights, the same greedy path), and the peak device
memory (torch's allocator plus layerstream's slot arena).

    .venv/bin/python bench/bench_llama.py --device cuda            # ~8B, budget 8 GiB
    .venv/bin/python bench/bench_llama.py --device sim --tiny      # CPU check of the script
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from peer_process import StageClock, stage_deadline

PEERS = ["resident", "layerstream"]
# Llama-3-8B's shape (config.json of meta-llama/Meta-Llama-3-8B), and a tiny one for CPU checks.
SHAPES = {
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def run_peer(args) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    cfg = transformers.LlamaConfig(**SHAPES["tiny" if args.tiny else "8b"])
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    # bf16 while still on meta: the host holds 16 GB, not 32 GB of fp32 and then a copy.
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    tensors = list(model.parameters())
    # One random pool copied at rotating offsets into every tensor: seconds, not minutes, for
    # 16 GB, and every tensor still gets its own values (uniform in +-0.035).
    pool_n = max(p.numel() for p in tensors) + (1 << 20)
    pool = ((torch.rand(pool_n, generator=gen) - 0.5) * 0.07).to(torch.bfloat16)
    with torch.no_grad():
        for i, p in enumerate(tensors):
            start = (i * 1_000_003) % (pool_n - p.numel() + 1)
            p.copy_(pool[start:start + p.numel()].view_as(p))
    del pool
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # its buffers: to_empty left them unset
    params = sum(p.numel() for p in model.parameters())
    handle = None
    if args.peer == "layerstream":
        import layerstream

        handle = layerstream.offload(model, device=args.device, budget=args.budget, checker=False)
        device = handle.compute_device
    else:
        device = torch.device("cpu" if args.device == "sim" else args.device)
        model.to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen).to(device)
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_tokens), generator=gen).to(device)

    # Greedy decoding (the model's own generate(), KV cache on): eval, no LoRA yet.
    model.eval()
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=2, do_sample=False)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                             min_new_tokens=args.new_tokens)
        _sync(device)
        decode_s = time.perf_counter() - t0
    tokens = out[0, args.prompt_tokens:].tolist()

    # LoRA training steps.
    model.train()
    # peft creates each adapter beside its base weight: a streamed layer's is in host
    # memory, so .to(device) moves the adapters (the streamed weights stay; README).
    lora = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                 "o_proj"], lora_dropout=0.0))
    lora.to(device)
    off = [n for n, p in lora.named_parameters() if p.requires_grad and p.device != device]
    assert not off, f"trainable parameters off the compute device {device}: {off[:3]}"
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-4)

    def step():
        loss = lora(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step()
    _sync(device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = int(torch.cuda.max_memory_allocated()) if device.type == "cuda" else None
    row = {"peer": args.peer, "params": params, "decode_tokens_per_s": args.new_tokens / decode_s,
           "first_tokens": tokens[:8], "tokens": tokens, "train_step_ms": statistics.median(times) * 1e3,
           "peak_device_bytes_torch": peak}
    if handle is not None:
        s = handle.stats()
        row["peak_device_bytes_engine"] = int(s.get("streamed_device_bytes", s.get("peak_device_bytes", 0)))
        row["budget_bytes"] = args.budget
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="sim", help="sim (CPU) or cuda[:N]")
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama (CPU checks of the script)")
    ap.add_argument("--budget", type=int, default=8 << 30, help="layerstream's device budget in bytes")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024, help="training sequence length")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=stage_deadline(),
                    help="the whole run's seconds (default: $LS_STAGE_DEADLINE_S, which bench/gpu/run.sh sets; "
                         "0: none): a peer that cannot start in time is a row that says so")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--peer", choices=PEERS, help=argparse.SUPPRESS)  # a child's one peer
    args = ap.parse_args()
    if args.peer:
        print(json.dumps(run_peer(args)))
        return
    rows, clock = {}, StageClock(args.deadline_s)
    for peer in PEERS:
        cmd = [sys.executable, os.path.abspath(__file__), "--peer", peer, "--device", args.device,
               "--budget", str(args.budget), "--batch", str(args.batch), "--seq", str(args.seq),
               "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
               "--steps", str(args.steps)] + (["--tiny"] if args.tiny else [])
        rows[peer] = clock.run(cmd, peer)
    ok = all("error" not in r and "skipped" not in r for r in rows.values())
    result = {"config": {k: getattr(args, k) for k in ("device", "tiny", "budget", "batch", "seq", "prompt_tokens",
                                                       "new_tokens", "steps")},
              "peers": rows}
    if ok:
        res, ls = rows["resident"], rows["layerstream"]
        result["train_vs_resident"] = ls["train_step_ms"] / res["train_step_ms"]
        result["decode_vs_resident"] = res["decode_tokens_per_s"] / ls["decode_tokens_per_s"]
        result["same_tokens"] = ls["tokens"] == res["tokens"]
    if args.json:
        print(json.dumps(result))
    else:
        for peer, r in rows.items():
            if "error" in r or "skipped" in r:
                print(f"{peer}: failed\n{r.get('error') or r['skipped']}")
                continue
            print(f"{peer:<12} {r['params'] / 1e9:.3f}B params  train step {r['train_step_ms']:.1f} ms  "
                  f"decode {r['decode_tokens_per_s']:.2f} tokens/s  peak (torch) {r['peak_device_bytes_torch']}")
        if ok:
            print(f"layerstream / resident: train {result['train_vs_resident']:.3f}x, decode "
                  f"{result['decode_vs_resident']:.3f}x (time per token); same greedy tokens: "
                  f"{result['same_tokens']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
