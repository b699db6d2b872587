"""What detach() gives back for weights offload() quantized: the memory layout they had
(channels_last, tensor groups too), and the values the layer computed with whatever the
budget (a dequant_dtype / compute_dtype rounds them as it rounds a resident layer's)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import layerstream


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(4, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, x):
        return x + self.c2(torch.relu(self.c1(x)))


def _convs(frozen):
    torch.manual_seed(0)
    return nn.Sequential(_Block(), _Block()).to(memory_format=torch.channels_last).requires_grad_(not frozen)


def _weights(model):
    return [(n, p.detach().clone()) for n, p in model.named_parameters() if p.dim() == 4]


@pytest.mark.parametrize("fmt", ["int8", "lossless"])
def test_a_quantized_tensor_group_keeps_its_layout_after_detach(offload_sim, fmt):
    """groups= with int8 or frozen lossless: detach() gave the convs' weights back contiguous
    where the model had them channels_last (README: parameters keep their memory layout).
    Now they have the strides they had, the same as the layers a budget keeps resident hold,
    with the same values (lossless: the original ones, bit for bit)."""
    x = torch.randn(2, 4, 8, 8).to(memory_format=torch.channels_last)
    original = _weights(_convs(True))
    runs = []
    for budget in (None, 10**9):  # all streamed; all kept resident (held with their quantized values)
        model = _convs(True)
        handle = offload_sim(model, groups=["0", "1"], quantize=fmt, budget=budget)
        assert model[0].c1.weight.is_meta == (budget is None)
        with torch.no_grad():
            y = model(x)
        handle.detach()
        runs.append((y, _weights(model)))
    (y_streamed, streamed), (y_resident, resident) = runs
    assert torch.equal(y_streamed, y_resident)
    for (name, w), (_, r), (_, o) in zip(streamed, resident, original):
        assert w.stride() == o.stride() == r.stride(), name
        assert w.is_contiguous(memory_format=torch.channels_last), name
        assert torch.equal(w, r), name
        if fmt == "lossless":
            assert torch.equal(w, o), name


def _linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256)).requires_grad_(False)


def _attention():
    torch.manual_seed(0)
    # train(): a resident layer in eval takes torch's fused inference path (other kernels)
    return nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).requires_grad_(False).train()


@pytest.mark.parametrize("build,x_shape", [(_linears, (4, 256)), (_attention, (2, 5, 64))], ids=["linear", "attention"])
@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8"])
@pytest.mark.parametrize("kw", [dict(compute_dtype=torch.bfloat16), dict(dequant_dtype=torch.float16)],
                         ids=["compute_bf16", "dequant_fp16"])
def test_detach_gives_the_same_quantized_weights_whatever_the_budget(offload_sim, build, x_shape, fmt, kw):
    """quantize= with compute_dtype=bf16: a layer the budget kept resident held (and detach() left)
    its weights rounded to bf16, as it computes with them, while a streamed layer's detach() gave
    the unrounded float32 dequantization: detach() gave other weights for another budget (README:
    the budget does not change the numbers). Now a streamed layer's detach() gives the values it
    computed with too; forwards and detached weights are equal under every budget."""
    x = torch.randn(*x_shape)
    runs = []
    model = build()
    sizes = sorted({sum(p.numel() * p.element_size() for p in m.parameters(recurse=True))
                    for m in model.modules() if m is not model})
    for budget in (None, "mixed", 10**9):
        model = build()
        if budget == "mixed":  # slots for the largest layer, and room for about one layer more
            budget = 4 * sizes[-1]
        handle = offload_sim(model, quantize=fmt, budget=budget, **kw)
        resident = sum(not p.is_meta for p in model.parameters() if p.dim() >= 2)
        with torch.no_grad():
            # (A quantized tensor group's forward gets its weights in the dequant dtype: float32
            # activations meet bfloat16 weights there, an error of their own; autocast only.)
            y32 = model(x) if build is _linears else None
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y16 = model(x)
        handle.detach()
        runs.append((resident, y32, y16, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == 0 and runs[-1][0] > 0  # all streamed, then some resident
    for resident, y32, y16, weights in runs[1:]:
        assert (y32 is None or torch.equal(y32, runs[0][1])) and torch.equal(y16, runs[0][2])
        for w, w0 in zip(weights, runs[0][3]):
            assert torch.equal(w, w0)
    dq = kw.get("compute_dtype", kw.get("dequant_dtype"))
    for w in runs[0][3]:
        if w.dim() >= 2:  # the values it computed with: representable in the dequant dtype
            assert torch.equal(w, w.to(dq).float())


@pytest.mark.parametrize("fmt", ["int8", "fp8", "nf4", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_detached_quantized_values_quantize_to_themselves(offload_sim, fmt, dtype):
    """offload() of the values detach() restored (or load_state_dict() of a detached model's
    state dict) quantizes them to themselves. int4 did not: range / 15 of bf16/fp16-rounded
    values is not the scale they came from, and symmetric groups span 14 codes; about
    0.1% of the weights moved at each detach()/offload() cycle (quant.cpp, Note [An int4
    group that holds dequantized int4 values])."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512)).to(dtype).requires_grad_(False)
    with torch.no_grad():
        model[2].weight.uniform_(-0.05, 0.05)  # symmetric groups: zero points that tie
    offload_sim(model, quantize=fmt).detach()
    once = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 512, dtype=dtype)
    h = offload_sim(model, quantize=fmt)
    y = model(x)
    h.detach()
    for k, v in model.state_dict().items():
        assert torch.equal(v, once[k]), k
    ref = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512)).to(dtype)
    ref.load_state_dict(once)
    assert torch.equal(y, ref(x))  # it computed with them
    h = offload_sim(model, quantize=fmt)
    model.load_state_dict(once)
    h.detach()
    for k, v in model.state_dict().items():
        assert torch.equal(v, once[k]), k
