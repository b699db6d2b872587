"""quantize="lossless" (issue 28; core/lossless.h, docs/design/quant-formats.md):
weights entropy-coded on the host, crossing the bus coded and decoded in the slot
bit for bit. On the sim device: outputs and gradients bit-identical to the same
model streamed uncompressed, for bf16 / fp16 / fp32, Linear and convolution
layers, NaN / Inf / subnormal weights included; detach() gives the weights back
bit for bit; bytes on the link per parameter of realistic bf16 weights <= 0.75 of
bf16."""
import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import layerstream
from layerstream import LayerstreamError, _C


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_bit_exact_on_edge_cases(dtype):
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(-2**15, 2**15, (4099,), generator=g, dtype=torch.int32)
    bits = raw.to(torch.int16).view(dtype) if dtype != torch.float32 else \
        torch.randint(-2**31, 2**31 - 1, (4099,), generator=g, dtype=torch.int32).view(torch.float32)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-45, 6e-8],
                           dtype=torch.float32).to(dtype)
    cases = [bits, special, torch.full((5000,), 0.25, dtype=dtype), torch.empty(0, dtype=dtype),
             torch.randn(1, dtype=dtype), (torch.randn(3, 4097, generator=g) * 0.02).to(dtype)]
    for t in cases:
        coded = _C.lossless_encode(t)
        assert coded.numel() == _C.lossless_coded_bytes(t)
        out = torch.empty_like(t)
        _C.lossless_decode(coded, out)
        assert torch.equal(_bits(out), _bits(t))
    with pytest.raises(LayerstreamError, match="lossless"):
        bad = coded.clone()
        bad[:4] = 0  # the magic
        _C.lossless_decode(bad, torch.empty_like(cases[-1]))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.mlp = nn.Sequential(*[nn.Linear(32 * 8 * 8 if i == 0 else 128, 128) for i in range(3)])

    def forward(self, x):
        x = torch.relu(self.conv(x)).flatten(1)
        for m in self.mlp:
            x = torch.relu(m(x))
        return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_streamed_lossless_equals_streamed_uncompressed_bit_for_bit(dtype):
    torch.manual_seed(0)
    ref = ConvNet().to(dtype).requires_grad_(False)
    with torch.no_grad():  # weights the coder sees in the wild, and a few it must not bend
        for m in ref.mlp:
            m.weight.normal_(0, 0.02)
        ref.mlp[1].weight[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40])
    ours, plain = copy.deepcopy(ref), copy.deepcopy(ref)
    h = layerstream.offload(ours, device="sim", quantize="lossless", dequant_dtype=None)
    p = layerstream.offload(plain, device="sim")
    adapters = []
    for model in (ours, plain):  # a LoRA-like trainable input path: gradients reach x
        torch.manual_seed(1)
        adapters.append(nn.Parameter(torch.randn(3, 8, 8, dtype=dtype) * 0.1))
    for step in range(2):
        x = torch.randn(2, 3, 8, 8, dtype=dtype)
        outs = []
        for model, a in zip((ours, plain), adapters):
            y = model(x + a)
            y.float().nan_to_num().square().mean().backward()
            outs.append(y)
        assert torch.equal(_bits(outs[0]), _bits(outs[1])), step
        assert torch.equal(_bits(adapters[0].grad), _bits(adapters[1].grad)), step
        for a in adapters:
            a.grad = None
    s, q = h.stats(), p.stats()
    assert s["ordering_errors"] == 0 and s["h2d_bytes"] < q["h2d_bytes"]
    h.detach()
    for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(_bits(a), _bits(b)), n  # back bit for bit, NaN payloads included


def test_bytes_on_the_link_of_a_bf16_llama_are_at_most_three_quarters(tmp_path):
    """A transformers Llama initialised as transformers does (normal, std 0.02) and
    trained a few steps: coded bytes per parameter <= 0.75 of bf16, outputs equal."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16))
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model = model.to(torch.bfloat16).requires_grad_(False)
    ours, plain = copy.deepcopy(model), copy.deepcopy(model)
    h = layerstream.offload(ours, device="sim", quantize="lossless", exclude=["*embed_tokens", "lm_head"])
    p = layerstream.offload(plain, device="sim", exclude=["*embed_tokens", "lm_head"])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, plain(ids).logits)
    ratio = h.stats()["h2d_bytes"] / p.stats()["h2d_bytes"]
    print(f"lossless bytes on the link / bf16: {ratio:.3f}")
    assert ratio <= 0.75


def test_frozen_lossless_weights_are_not_rewritten_in_place_and_a_refused_load_writes_nothing():
    """A load_state_dict() naming lossless-coded weights is refused, as their coded size
    depends on their values. Before, torch wrote every other key first (the biases, the
    norms) and the model held parts of two checkpoints; the model's own pre-hook now
    refuses before any key is written (Note [A refused load writes nothing]), a tensor
    group's tensor too."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(64, 4), "fc": nn.Linear(64, 64)})
    frozen = model.to(torch.bfloat16).requires_grad_(False)
    state = {k: v + 1 for k, v in frozen.state_dict().items()}
    h = layerstream.offload(frozen, device="sim", quantize="lossless")
    before = {k: v.clone() for k, v in frozen.state_dict().items() if not v.is_meta}
    assert {"fc.bias", "attn.in_proj_bias"} <= set(before)
    for key, left in (("fc.weight", ("attn.in_proj_weight", "attn.out_proj.weight")),
                      ("attn.in_proj_weight", ("fc.weight",))):
        with pytest.raises(LayerstreamError, match=rf"refused before writing anything: '{key}' names a quantized "
                                                   r"streamed weight .*lossless-coded"):
            frozen.load_state_dict({k: v for k, v in state.items() if k not in left})
        assert all(torch.equal(frozen.state_dict()[k], v) for k, v in before.items())
    frozen.load_state_dict({k: v for k, v in state.items() if k not in ("fc.weight", "attn.in_proj_weight",
                                                                         "attn.out_proj.weight")}, strict=False)
    assert torch.equal(frozen.fc.bias, before["fc.bias"] + 1)
    h.detach()
    frozen.load_state_dict(state)


def test_tensor_groups_are_coded():
    """A tensor group (here MultiheadAttention's) is coded like a Linear weight: its
    matrices cross coded (fewer host bytes than dense), the outputs are bit-identical to
    the resident module's, and detach() restores it bit for bit."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(256, 4), "fc": nn.Linear(256, 256)})
    model = model.to(torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    ref, dense = copy.deepcopy(model), copy.deepcopy(model)
    h = layerstream.offload(model, device="sim", quantize="lossless")
    h_dense = layerstream.offload(dense, device="sim")
    assert h.stats()["group_layers"] == 1 and h.stats()["quantized_layers"] == 2
    assert model["attn"].in_proj_weight.is_meta
    attn_bytes = sum(p.numel() * 2 for p in ref["attn"].parameters())
    assert h.stats()["pinned_bytes"] < h_dense.stats()["pinned_bytes"] - 0.25 * attn_bytes
    x = torch.randn(5, 2, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model["attn"](x, x, x)[0], ref["attn"](x, x, x)[0])
    h.detach(), h_dense.detach()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n


def _full_finetune_pair(dtype):
    """ConvNet with every weight trainable, offloaded lossless and plain (sim)."""
    torch.manual_seed(0)
    ref = ConvNet().to(dtype)
    with torch.no_grad():
        for m in ref.mlp:
            m.weight.normal_(0, 0.02)
    ours, plain = copy.deepcopy(ref), copy.deepcopy(ref)
    h = layerstream.offload(ours, device="sim", quantize="lossless")
    p = layerstream.offload(plain, device="sim")
    return ours, plain, h, p


def _step_both(models, opts, x, handles=None):
    """A step of each model; with `handles`, its backward inside opt.overlap(handle)."""
    outs = []
    for k, (model, opt) in enumerate(zip(models, opts)):
        y = model(x)
        with opt.overlap(handles[k]) if handles else contextlib.nullcontext():
            y.float().square().mean().backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        outs.append(y)
    return outs


@pytest.mark.parametrize("optimizer", ["torch", "layerstream", "layerstream-overlap"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_trainable_lossless_weights_train_like_plain_streamed_ones(dtype, optimizer):
    """Full fine-tuning with quantize="lossless": the weights stay dense parameters on
    the host (the optimizer writes them), cross the bus coded and are re-coded after
    each step. Outputs and every parameter after each step are bit-identical to the
    same model streamed uncompressed; each weight is re-coded once per step (with the
    step overlapped, on the stepping thread during the backward: done before step()
    returns); the link carries fewer bytes."""
    ours, plain, h, p = _full_finetune_pair(dtype)
    n_coded = 4  # conv + 3 Linear
    assert h.stats()["coded_layers"] == n_coded and p.stats()["coded_layers"] == 0
    assert all(isinstance(w, nn.Parameter) and w.requires_grad for w in ours.parameters())
    if optimizer == "torch":
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, plain)]
    else:
        opts = [layerstream.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, plain)]
    ahead = optimizer == "layerstream-overlap"
    dense = sum(m.weight.numel() * m.weight.element_size() for m in [ours.conv, *ours.mlp])
    torch.manual_seed(1)
    for step in range(3):
        x = torch.randn(4, 3, 8, 8, dtype=dtype)
        y, y2 = _step_both((ours, plain), opts, x, (h, p) if ahead else None)
        assert torch.equal(_bits(y), _bits(y2)), step
        for (n, a), b in zip(ours.named_parameters(), plain.parameters()):
            assert torch.equal(_bits(a.detach()), _bits(b.detach())), (step, n)
        # Coded before the first copy; re-coded after each step: right after it when
        # it was overlapped, else before the next copy.
        assert h.stats()["recoded_bytes"] == (step + ahead) * dense, step
    s, q = h.stats(), p.stats()
    assert s["h2d_bytes"] < q["h2d_bytes"] and s["ordering_errors"] == 0
    assert s["recode_seconds"] > 0
    h.detach()
    p.detach()
    for a, b in zip(ours.parameters(), plain.parameters()):
        assert torch.equal(_bits(a.detach()), _bits(b.detach()))


def test_a_write_through_data_is_seen_and_an_unchanged_weight_is_not_recoded():
    """Writes the version counter does not see (through .data) are caught by a
    sample of the weight's bytes before the next copy; forward passes without a
    change re-code nothing."""
    ours, plain, h, p = _full_finetune_pair(torch.float32)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(ours(x), plain(x))
    assert h.stats()["recoded_bytes"] == 0
    new = torch.randn_like(ours.mlp[1].weight) * 0.05
    ours.mlp[1].weight.data.copy_(new)  # bumps no version counter
    plain.mlp[1].weight.data.copy_(new)
    with torch.no_grad():
        assert torch.equal(ours(x), plain(x))
    w = ours.mlp[1].weight
    assert h.stats()["recoded_bytes"] == w.numel() * w.element_size()


def test_a_write_to_a_few_elements_through_data_is_seen_after_synchronize():
    """A `.data` write to one element escapes both the version counter and the sample
    of 1024 words (element 3 of a 1 MiB weight is in an unsampled word): the next copy
    still moves the old coding. handle.synchronize(), the documented call after writes
    no counter sees, makes the next copy re-code every trainable coded weight."""
    ours, plain, h, p = _full_finetune_pair(torch.float32)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(ours(x), plain(x))
        for m in (ours, plain):
            m.mlp[0].weight.data[0, 3] = 4.0
        assert not torch.equal(ours(x), plain(x)), "the sample saw the write: the test shows nothing"
        h.synchronize()
        assert torch.equal(ours(x), plain(x))
    dense = sum(m.weight.numel() * m.weight.element_size() for m in [ours.conv, *ours.mlp])
    assert h.stats()["recoded_bytes"] == dense  # every trainable coded weight, once


def test_trainable_lossless_plans_the_dense_weight_and_its_largest_coded_size():
    """The host plan counts the dense weight, its coded buffer at its largest size and
    the gradient's staging buffer; the slot holds the largest coded size and the
    decoded weight; the per-step bus bytes are the coded ones."""
    lin = nn.Sequential(nn.Linear(512, 512, bias=False), nn.Linear(512, 512, bias=False)).to(torch.bfloat16)
    with torch.no_grad():
        for m in lin:
            m.weight.normal_(0, 0.02)
    coded = _C.lossless_coded_bytes(lin[0].weight.detach())
    cap = _C.lossless_max_bytes(lin[0].weight.detach())
    dense = 512 * 512 * 2
    assert coded < 0.75 * dense < dense < cap
    a, b = copy.deepcopy(lin), copy.deepcopy(lin).requires_grad_(False)
    # Said at offload(), with both sizes: an inference user rarely means to pay it.
    coded_both = sum(_C.lossless_coded_bytes(m.weight.detach()) for m in lin)
    want = (f"2 lossless layer\\(s\\) require grad, .* {_C.format_bytes(2 * (dense + cap))} of host memory "
            f"where frozen weights would take {_C.format_bytes(coded_both)}\\. .*model.requires_grad_\\(False\\)")
    with pytest.warns(RuntimeWarning, match=want):
        h = layerstream.offload(a, device="sim", quantize="lossless", host_budget="1GiB")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # frozen: nothing to say
        frozen = layerstream.offload(b, device="sim", quantize="lossless", host_budget="1GiB")
    hp, fp = h.host_plan, frozen.host_plan
    assert hp["store_bytes"] - fp["store_bytes"] >= 2 * (dense + cap - coded) - 2 * 4096
    with torch.no_grad():  # the slots exist once the scheduler is built
        for model in (a, b):
            model(torch.randn(2, 512, dtype=torch.bfloat16))
    assert h.stats()["slot_bytes"] >= cap + dense > frozen.stats()["slot_bytes"]


@pytest.mark.parametrize("variant", ["cache_across_steps", "cache_across_steps+overlap", "pinned_budget=0",
                                     "accumulate", "compiled"])
def test_trainable_lossless_weights_with_cached_slots_pageable_buffers_accumulation_and_compile(variant):
    """The same bit-for-bit equality with plain streamed weights when slot content is
    kept across steps (prefetching wraps into the next step, so re-coding must wait for
    a copy in flight; also when the step runs during the backward and re-codes there),
    when the coded buffers are pageable (pinned_budget=0: copied from where they are,
    never staged), over micro-batches (nothing re-coded until the optimizer writes),
    and under torch.compile (fullgraph, the layerstream operators)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU(), nn.Linear(96, 32))
    kw = {"cache_across_steps": True} if variant.startswith("cache_across_steps") else \
        {"pinned_budget": 0} if variant == "pinned_budget=0" else {}
    ours, plain = copy.deepcopy(ref), copy.deepcopy(ref)
    h = layerstream.offload(ours, device="sim", quantize="lossless", **kw)
    p = layerstream.offload(plain, device="sim", **kw)
    ahead = variant.endswith("+overlap")
    opts = [layerstream.optim.AdamW(m.parameters(), lr=1e-2) if ahead else torch.optim.SGD(m.parameters(), lr=0.1)
            for m in (ours, plain)]
    run = [torch.compile(m, fullgraph=True, backend="aot_eager") for m in (ours, plain)] \
        if variant == "compiled" else [ours, plain]
    micro = 3 if variant == "accumulate" else 1
    dense = sum(m.weight.numel() * 4 for m in ours[::2])
    for step in range(3):
        for k in range(micro):
            x = torch.randn(5, 64)
            y, y2 = run[0](x), run[1](x)
            assert torch.equal(_bits(y.detach()), _bits(y2.detach())), (step, k)
            for out, opt, handle in ((y, opts[0], h), (y2, opts[1], p)):
                with opt.overlap(handle) if ahead else contextlib.nullcontext():
                    out.square().mean().backward()
            # Once per optimizer step: during its backward when overlapped, else at the next copy.
            assert h.stats()["recoded_bytes"] == (step + ahead) * dense, (step, k)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for a, b in zip(ours.parameters(), plain.parameters()):
            assert torch.equal(_bits(a.detach()), _bits(b.detach())), step
    s = h.stats()
    assert s["ordering_errors"] == 0 and s["coded_layers"] == 3
    if variant == "pinned_budget=0":
        assert s["pageable_bytes"] > 0 and s["staged_read_bytes"] < p.stats()["staged_read_bytes"]


def test_unfreezing_a_weight_frozen_at_offload_says_lossless_weights_train():
    """A frozen lossless weight is held coded without what training needs: unfreezing it
    after offload() is refused with the way that works (detach, unfreeze, offload again),
    not the lossy formats' advice (an adapter, or no quantization)."""
    m = nn.Sequential(nn.Linear(64, 8)).requires_grad_(False)
    h = layerstream.offload(m, device="sim", quantize="lossless")
    with pytest.raises(layerstream.LayerstreamError, match=r"lossless weights do train: detach\(\), "
                                                           r"requires_grad_\(True\), then offload\(\) again"):
        m[0].weight.requires_grad_(True)
    h.detach()
    m.requires_grad_(True)
    layerstream.offload(m, device="sim", quantize="lossless")
    m(torch.randn(2, 64)).sum().backward()
    assert m[0].weight.grad is not None
