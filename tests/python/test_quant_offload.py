"""Quantized streaming through offload(): bytes on the bus, accuracy at model
level, LoRA-style training over a quantized frozen base, bad input."""
import copy
import warnings

import pytest
import safetensors.torch
import torch
import torch.nn as nn

import layerstream
from conftest import TiedHead

# Packed bytes per parameter of each format (data + scales), from the layouts
# in docs/design/quant-formats.md; fp32 is 4.
BYTES_PER_PARAM = {"int8": 1 + 4 / 256, "fp8": 1 + 4 / 256, "nf4": 0.5 + 4 / 64, "int4": 0.5 + 8 / 128}
# Model-level relative output error bounds (||y - y_fp32|| / ||y_fp32||) for
# the tiny Llama below with N(0, 0.02) weights. Per-element bounds are tested
# in C++ (tests/cpp/test_quant.cpp); these bound how they add up through a model.
MODEL_TOL = {"int8": 0.02, "fp8": 0.08, "nf4": 0.2, "int4": 0.2}


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "nf4", "int4"])
def test_bus_bytes_drop_by_format(fmt):
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.ReLU(), nn.Linear(256, 256, bias=False))
    model.requires_grad_(False)
    dense = copy.deepcopy(model)
    x = torch.randn(4, 256)
    hd = layerstream.offload(dense, device="sim")
    hq = layerstream.offload(model, device="sim", quantize=fmt)
    for _ in range(3):
        dense(x)
        model(x)
    d, q = hd.stats(), hq.stats()
    assert q["quantized_layers"] == 2 and d["quantized_layers"] == 0
    ratio = q["h2d_bytes"] / d["h2d_bytes"]
    expected = BYTES_PER_PARAM[fmt] / 4
    # Section alignment (256 B) adds a little on these small layers.
    assert expected <= ratio <= expected * 1.05, (fmt, ratio, expected)
    assert hq.ordering_errors() == [] and hd.ordering_errors() == []


@pytest.mark.parametrize("fmt", ["int8", "fp8", "nf4", "int4"])
def test_tiny_llama_output_error_within_tolerance(fmt):
    ref = tiny_llama()
    model = copy.deepcopy(ref)
    model.requires_grad_(False)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        y_ref = ref(ids).logits
    h = layerstream.offload(model, device="sim", quantize=fmt, exclude=["lm_head"])
    with torch.no_grad():
        y = model(ids).logits
    err = ((y - y_ref).norm() / y_ref.norm()).item()
    assert err <= MODEL_TOL[fmt], f"{fmt}: relative error {err:.4f} > {MODEL_TOL[fmt]}"
    assert err > 0  # it really went through the quantized path
    assert h.stats()["quantized_layers"] == 14  # 2 x (q,k,v,o,gate,up,down)
    assert h.ordering_errors() == []


def test_lora_over_quantized_base_trains_adapter_only():
    """A frozen nf4 base under a trainable adapter: the output, the input gradient and the
    adapter's gradients equal, bit for bit, those of the model resident with the base
    weight replaced by its reference nf4 dequantization (quant_ref.py, the format's spec in
    torch); the base gets no gradient and sends none back."""
    from quant_ref import assert_reference_values, ref_dequantize

    base = nn.Linear(128, 128)
    base.requires_grad_(False)
    lora_a = nn.Linear(128, 4, bias=False)
    lora_b = nn.Linear(4, 128, bias=False)
    nn.init.normal_(lora_b.weight, std=0.1)

    class WithLora(nn.Module):
        def __init__(self):
            super().__init__()
            self.base, self.a, self.b = base, lora_a, lora_b

        def forward(self, x):
            return self.base(x) + self.b(self.a(x))

    model = WithLora()
    original = model.base.weight.detach().clone()
    ref = copy.deepcopy(model)
    with torch.no_grad():
        ref.base.weight.copy_(ref_dequantize("nf4", original))
    h = layerstream.offload(model, device="sim", quantize="nf4", include=["base"])
    x = torch.randn(8, 128, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, yr = model(x), ref(xr)
    assert torch.equal(y, yr)
    y.square().mean().backward()
    yr.square().mean().backward()
    assert torch.equal(x.grad, xr.grad)
    assert torch.equal(lora_a.weight.grad, ref.a.weight.grad)
    assert torch.equal(lora_b.weight.grad, ref.b.weight.grad)
    assert lora_a.weight.grad.abs().sum() > 0 and lora_b.weight.grad.abs().sum() > 0
    assert model.base.weight.grad is None and model.base.weight.is_meta
    assert h.stats()["d2h_bytes"] == 0  # no gradient crosses back for the frozen packed weight
    assert h.ordering_errors() == []
    h.detach()
    assert_reference_values("nf4", original, model.base.weight, "base.weight")


def test_trainable_weight_cannot_be_quantized():
    m = nn.Linear(64, 64)
    with pytest.raises(layerstream.LayerstreamError, match="would quantize 1 trainable layer"):
        layerstream.offload(m, device="sim", quantize="int8")


def test_trainable_layer_after_frozen_ones_is_refused_before_anything_changes():
    """A trainable layer behind frozen ones (a peft model offloaded with quantize="nf4":
    lora_A/lora_B are trainable). Before, the engine refused it only after the frozen
    layers before it had been quantized: offload() raised, the model was left with packed
    (meta) weights whose dense values were gone, and no handle to undo it. Now it is
    refused before any module changes, naming the layers and the per-layer dict."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    m[0].requires_grad_(False)
    m[2].requires_grad_(False)
    ref = copy.deepcopy(m)
    with pytest.raises(layerstream.LayerstreamError,
                       match=r"1 trainable layer\(s\).*frozen: 4\. .*quantize=\{'\*lora_\*': None"):
        layerstream.offload(m, device="sim", quantize="nf4")
    assert all("forward" not in x.__dict__ for x in m.modules())
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert type(p) is nn.Parameter and torch.equal(p, q), n
    handle = layerstream.offload(m, device="sim", quantize={"4": None, "*": "nf4"})
    assert handle.stats()["quantized_layers"] == 2


def test_nan_weight_is_a_clear_error():
    m = nn.Linear(64, 64)
    m.requires_grad_(False)
    with torch.no_grad():
        m.weight[3, 5] = float("nan")
    with pytest.raises(layerstream.LayerstreamError, match=r"cannot quantize layer.*(NaN|nan)"):
        layerstream.offload(m, device="sim", quantize="fp8")


@pytest.mark.parametrize("fmt", ["int8", "fp8", "nf4", "int4"])
def test_a_float8_weight_streams_as_stored_or_is_refused_by_name(fmt):
    """A weight stored in float8 (e.g. by diffusers' layerwise casting) is not packed by any
    format: quantize=fmt streams it as it is stored, saying why; naming it in a dict is an
    error naming its dtype (was: torch's "isfinite not implemented for Float8_e4m3fn" from
    inside offload())."""
    m = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)).requires_grad_(False)
    m[0].to(torch.float8_e4m3fn)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    streamed = copy.deepcopy(m)
    with pytest.warns(RuntimeWarning,
                      match=r"cannot pack 1 layer.*0 \(the tensor is torch.float8_e4m3fn; only float32"):
        h = layerstream.offload(streamed, device="sim", quantize=fmt, compute_dtype=torch.bfloat16)
    assert h.stats()["quantized_layers"] == 1 and h.layers == ["0", "1"]
    with torch.no_grad():
        first = streamed[0](x)
    assert streamed[0].weight.dtype == torch.float8_e4m3fn
    assert torch.equal(first, nn.functional.linear(x, m[0].weight.to(torch.bfloat16), m[0].bias.to(torch.bfloat16)))
    with pytest.raises(layerstream.LayerstreamError,
                       match=f"cannot quantize layer '0' to {fmt}: the tensor is torch.float8"):
        layerstream.offload(copy.deepcopy(m), device="sim", quantize={"0": fmt})


def test_int4_shape_not_divisible_stays_dense_with_warning_or_errors_when_explicit():
    m = nn.Sequential(nn.Linear(100, 64), nn.Linear(64, 128))  # 100 is not a multiple of 128
    m.requires_grad_(False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        h = layerstream.offload(copy.deepcopy(m), device="sim", quantize="int4")
    assert any("cannot pack" in str(x.message) for x in w)
    assert h.stats()["quantized_layers"] == 0
    with pytest.raises(layerstream.LayerstreamError, match="divisible|multiple"):
        layerstream.offload(copy.deepcopy(m), device="sim", quantize={"0": "int4"})


def test_per_layer_overrides_and_detach_restores_dequantized():
    """{"0": "int8", "*": None}: layer 0 packed, layer 1 dense. The output equals the model
    resident with layer 0's weight replaced by its reference int8 dequantization
    (quant_ref.py) bit for bit; detach() restores exactly those values (within int8's
    bound of the original) and layer 1's weights bit for bit."""
    from quant_ref import assert_reference_values, ref_dequantize

    m = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
    m.requires_grad_(False)
    before = [p.detach().clone() for p in m.parameters()]
    ref = copy.deepcopy(m)
    with torch.no_grad():
        ref[0].weight.copy_(ref_dequantize("int8", before[0]))
    h = layerstream.offload(m, device="sim", quantize={"0": "int8", "*": None})
    assert h.stats()["quantized_layers"] == 1
    assert m[0].weight.is_meta and not m[1].weight.is_meta
    x = torch.randn(2, 128)
    with torch.no_grad():
        y = m(x)
        assert torch.equal(y, ref(x))
    h.detach()
    # the dense layer is bit-identical, the quantized one the reference int8 values
    assert torch.equal(m[1].weight, before[2]) and torch.equal(m[1].bias, before[3])
    assert torch.equal(m[0].bias, before[1])
    assert_reference_values("int8", before[0], m[0].weight, "0.weight")
    scale = before[0].abs().amax(1, keepdim=True) / 127
    assert ((m[0].weight - before[0]).abs() <= scale / 2 + 1e-7).all()


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
@pytest.mark.parametrize("dequant", [None, torch.bfloat16], ids=["own", "bf16"])
def test_a_quantized_layer_the_budget_keeps_resident_computes_with_the_streamed_values(fmt, dequant):
    """quantize= with a budget: a layer the planner keeps resident holds the values it
    would stream with (the reference dequantization, to dequant_dtype), so the budget does
    not change the numbers; its bias and the output equal the all-streamed model's, and
    detach() leaves those values too. A model with NaN in such a layer is refused before
    anything changes."""
    from quant_ref import ref_dequantize

    base = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]).requires_grad_(False)
    x = torch.randn(2, 256)
    outs, kept = [], []
    for budget in (None, "1200KiB"):
        m = copy.deepcopy(base)
        h = layerstream.offload(m, device="sim", quantize=fmt, budget=budget, prefetch=1, dequant_dtype=dequant)
        with torch.no_grad():
            outs.append(m(x))
        resident = [i for i in range(6) if not m[i].weight.is_meta]
        want = {i: ref_dequantize(fmt, base[i].weight.float()) for i in resident}
        if dequant is not None:
            want = {i: w.to(dequant).float() for i, w in want.items()}
        for i in resident:
            assert torch.equal(m[i].weight, want[i]) and torch.equal(m[i].bias, base[i].bias), i
        h.detach()
        for i in resident:
            assert torch.equal(m[i].weight, want[i]), i
        kept.append(len(resident))
    assert kept[0] == 0 and kept[1] > 0  # some layers resident with the budget
    assert torch.equal(outs[0], outs[1])
    bad = copy.deepcopy(base)
    with torch.no_grad():
        bad[0].weight[0, 0] = float("nan")
    before = bad[0].weight.detach().clone()
    with pytest.raises(layerstream.LayerstreamError, match="NaN or Inf"):
        layerstream.offload(bad, device="sim", quantize=fmt, budget="1200KiB", prefetch=1)
    assert torch.equal(bad[0].weight.isnan(), before.isnan()) and bad[0].weight.nan_to_num().equal(before.nan_to_num())


class _AttnNet(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Sequential(*[nn.Linear(128, 128) for _ in range(3)])
        self.attn = nn.MultiheadAttention(128, 2, batch_first=True)  # a tensor group
        self.requires_grad_(False)

    def forward(self, x):
        return self.attn(*(self.fc(x),) * 3, need_weights=False)[0]


def test_writes_into_quantized_layers_the_budget_keeps_resident_are_quantized_too():
    """A streamed quantized layer re-quantizes what load_state_dict() or copy_() writes
    into it; one the planner kept resident computed with the written values as they
    were: the numbers after loading a checkpoint depended on the budget. Now both
    budgets give the same outputs, after a load and after copy_() into a Linear's weight
    and into a tensor group's tensor (an attention's out_proj, read by the group's own
    forward)."""
    x = torch.randn(2, 3, 128)
    new, other = _AttnNet(1).state_dict(), _AttnNet(2)
    outs, resident = [], []
    for budget in (None, "64MiB"):
        m = _AttnNet(0)
        h = layerstream.offload(m, device="sim", quantize="int8", budget=budget)
        resident.append(sum(not p.is_meta for p in m.parameters() if p.dim() == 2))
        m.load_state_dict(new)
        loaded = m(x)
        with torch.no_grad():
            m.fc[1].weight.copy_(other.fc[1].weight)
            m.attn.out_proj.weight.copy_(other.attn.out_proj.weight)
        outs.append((loaded, m(x)))
        h.detach()
    assert resident == [0, 5]  # all streamed, then all resident (3 Linear weights, the group's 2)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    plain = _AttnNet(0)
    plain.load_state_dict(new)
    assert not torch.allclose(outs[1][0], plain(x), rtol=0, atol=1e-6)  # quantized, not the loaded values


@pytest.mark.parametrize("fmt,dequant", [("int4", None), ("int8", torch.bfloat16), ("nf4", torch.float16)])
def test_loading_its_own_state_dict_into_a_resident_quantized_layer_changes_nothing(fmt, dequant):
    """A quantized layer the budget keeps resident quantized load_state_dict(model.state_dict())
    again: quantizing quantized values was not the identity (int4; a dequant_dtype narrower
    than the weights), so its weights and outputs moved at each such load. Now a write of
    the values it holds changes nothing, while new values are still quantized."""
    m = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)).requires_grad_(False)
    with torch.no_grad():
        m[0].weight.normal_(0, 0.05)
    other = copy.deepcopy(m)
    h = layerstream.offload(m, device="sim", quantize=fmt, dequant_dtype=dequant, budget="4MiB")
    assert not m[0].weight.is_meta  # kept resident
    x = torch.randn(4, 256)
    y0, w0 = m(x), m[0].weight.detach().clone()
    for _ in range(2):
        m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()})
        assert torch.equal(m(x), y0) and torch.equal(m[0].weight, w0)
    with torch.no_grad():
        m[0].weight.copy_(other[0].weight * 2)
    m(x)
    assert not torch.equal(m[0].weight, other[0].weight * 2)  # new values: quantized
    h.detach()


def test_a_load_with_nan_into_a_resident_quantized_layer_is_refused_and_keeps_the_old_weight():
    """load_state_dict() with a NaN for a quantized layer the budget keeps resident: torch
    wrote it, then the post-hook failed to quantize it without naming the layer, every
    later call failed, and detach() left the NaN: the old values were lost. Now it is
    refused before torch writes, naming the key and the layer, as a streamed layer's is;
    the rest loads, the layer keeps its weight. A NaN written with copy_() fails the next
    call naming the layer."""
    x = torch.randn(2, 3, 128)
    m = _AttnNet(0)
    h = layerstream.offload(m, device="sim", quantize="int8", budget="64MiB")
    before = m(x)
    weights = {n: p.detach().clone() for n, p in m.named_parameters()}
    sd = {k: v.clone() for k, v in _AttnNet(1).state_dict().items()}
    sd["fc.1.weight"][5, 7] = float("nan")
    sd["attn.out_proj.weight"][0, 0] = float("inf")
    with pytest.raises(RuntimeError) as info:
        m.load_state_dict(sd)
    msg = str(info.value)
    assert "While loading \"fc.1.weight\" into quantized layer 'fc.1'" in msg and "NaN at row 5, column 7" in msg
    assert "While loading \"attn.out_proj.weight\" into quantized layer 'attn'" in msg and "Inf" in msg
    assert "Missing key" not in msg
    assert torch.equal(m.fc[1].weight, weights["fc.1.weight"])
    assert torch.equal(m.attn.out_proj.weight, weights["attn.out_proj.weight"])
    assert torch.equal(m.fc[1].bias, sd["fc.1.bias"])  # the rest loaded, as torch does
    m.load_state_dict(weights)  # its own values back: nothing quantized again
    assert torch.equal(m(x), before)
    with torch.no_grad():
        m.fc[0].weight[1, 2] = float("nan")
    with pytest.raises(layerstream.LayerstreamError, match=r"quantized layer 'fc.0' \(kept resident.*NaN"):
        m(x)
    h.detach()


def test_a_resident_quantized_weight_unfrozen_after_offload_is_refused_as_a_streamed_one_is():
    """A quantized weight the budget keeps resident, unfrozen after offload(), trained and
    was then quantized again at the next call, silently (the step mostly undone); a
    streamed one refuses requires_grad_(True). Now its next call is refused with the same
    advice (an adapter), the weight unchanged, and runs again once frozen."""
    m = _two_layer(0)
    h = layerstream.offload(m, device="sim", quantize="int8", budget="4MiB")
    assert not m[0].weight.is_meta  # kept resident
    x = torch.randn(2, 64)
    before, w = m(x), m[0].weight.detach().clone()
    m[0].weight.requires_grad_(True)
    with pytest.raises(layerstream.LayerstreamError,
                       match=r"weight of quantized layer '0' \(kept resident by the budget\) cannot be trained.*"
                             r"train an adapter over it \(LoRA\).*requires_grad_\(False\)"):
        m(x)
    assert torch.equal(m[0].weight, w)
    m[0].weight.requires_grad_(False)
    assert torch.equal(m(x), before)
    h.detach()


def test_resident_quantized_layers_rounded_from_a_wider_dequant_dtype_are_warned_of():
    """bf16 weights with dequant_dtype=float32: a streamed layer computes with the float32
    dequantized weight, one the budget keeps resident holds its quantized values rounded
    to bf16 (its parameter's dtype), so the budget changed the numbers without a word.
    Now offload() warns, naming those layers and the two ways to the same numbers; not
    where the weights' dtype holds the dequant_dtype's values, nor with nothing resident."""
    base = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).requires_grad_(False)
    for dtype, dq, budget, warned in ((torch.bfloat16, torch.float32, "1MiB", True),
                                      (torch.float16, torch.bfloat16, "1MiB", True),
                                      (torch.float32, torch.bfloat16, "2MiB", False),
                                      (torch.bfloat16, torch.float32, None, False)):
        m = copy.deepcopy(base).to(dtype)
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            h = layerstream.offload(m, device="sim", quantize="int8", dequant_dtype=dq, budget=budget)
        assert (budget is None) == m[0].weight.is_meta
        msgs = [str(w.message) for w in ws if "kept resident" in str(w.message)]
        assert bool(msgs) == warned, (dtype, dq, budget, msgs)
        if warned:
            assert ws[-1].filename == __file__
            assert (f"2 quantized layer(s) kept resident by the budget hold their quantized values in their weights' "
                    f"dtype ({dtype}), rounded from dequant_dtype={dq}") in msgs[0]
            assert f"dequant_dtype={dtype}" in msgs[0] and "a budget that streams" in msgs[0]
            assert msgs[0].endswith("'0', '2'")
        h.detach()


@pytest.mark.parametrize("fmt", ["int8", "fp8", "nf4", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_streamed_values_equal_the_reference_dequantization(fmt, dtype):
    """Every format, for a Linear: what the device computes with (its output against a
    resident Linear holding the reference values) and what detach() restores are the
    format's reference dequantization (quant_ref.py: the spec in torch, no engine code),
    rounded to the weight's dtype; the reference lies within the format's stated bound."""
    from quant_ref import assert_reference_values, ref_dequantize

    torch.manual_seed(0)
    lin = nn.Linear(256, 96).to(dtype).requires_grad_(False)
    with torch.no_grad():  # a zero row and a row of one value exercise the edge cases
        lin.weight[3].zero_()
        lin.weight[5].fill_(0.25)
    original = lin.weight.detach().clone()
    ref = copy.deepcopy(lin)
    with torch.no_grad():
        ref.weight.copy_(ref_dequantize(fmt, original))
    h = layerstream.offload(lin, device="sim", quantize=fmt)
    assert h.stats()["quantized_layers"] == 1
    x = torch.randn(4, 256, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(lin(x), ref(x))
    h.detach()
    assert_reference_values(fmt, original.float(), lin.weight, fmt)


def test_fp8_negative_zero_keeps_its_sign_except_in_an_all_zero_row():
    """docs/design/quant-formats.md: -0.0 encodes to 0x80, but an all-zero row (scale 0)
    gets codes 0, so its -0.0 comes back +0.0."""
    w = torch.zeros(2, 256)
    w[0, 3] = -0.0
    w[1] = 0.5
    w[1, 4] = -0.0
    q = layerstream._C.quantized_values(w, 2, 256, "fp8")
    assert not torch.signbit(q[0, 3]) and torch.signbit(q[1, 4])


def test_unknown_format_is_a_clear_error():
    m = nn.Linear(64, 64)
    m.requires_grad_(False)
    with pytest.raises(Exception, match="int8"):
        layerstream.offload(m, device="sim", quantize="int3")


def test_format_names_are_read_in_any_case_as_the_engine_reads_them():
    """quantize="INT8" was refused as "a GGUF format" (C++ OffloadOptions::quantize and
    layerstream plan read names in any case): it is int8, as a dict's values are."""
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    outputs = []
    for quantize in ("int8", "INT8", {"*": "Int8"}):
        torch.manual_seed(1)
        m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
        m.requires_grad_(False)
        h = layerstream.offload(m, device="sim", quantize=quantize)
        assert h.stats()["quantized_layers"] == 2
        outputs.append(m(x))
        h.detach()
    assert all(torch.equal(o, outputs[0]) for o in outputs)


def test_fp8_by_its_other_names_and_none_are_read_as_the_engine_reads_them():
    """quantize="e4m3" / "fp8_e4m3" were refused as "a GGUF format" and "none" as unknown,
    though C++'s quant::parse_format (OffloadOptions::quantize, docs/design/quant-formats.md)
    takes them: fp8, and no quantization."""
    x = torch.randn(3, 64)

    def run(quantize):
        torch.manual_seed(1)
        m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)).requires_grad_(False)
        h = layerstream.offload(m, device="sim", quantize=quantize)
        out, n = m(x), h.stats()["quantized_layers"]
        h.detach()
        return out, n

    fp8, n = run("fp8")
    assert n == 2
    for quantize in ("e4m3", "FP8_E4M3", "fp8e4m3", {"*": "E4M3"}):
        out, n = run(quantize)
        assert n == 2 and torch.equal(out, fp8), quantize
    dense, n = run(None)
    assert n == 0
    for quantize in ("none", "NONE", {"*": "none"}):
        out, n = run(quantize)
        assert n == 0 and torch.equal(out, dense), quantize
    with pytest.raises(ValueError, match="'q4_k' is a GGUF format"):
        run("q4_k")
    with pytest.raises(ValueError, match="unknown quantization format 'e5m2'.*fp8"):
        run("e5m2")


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per-channel", "per-tensor"])
def test_prequantized_torch_qint8_weight_streams_exactly(per_tensor):
    """Per channel (axis 0) and per tensor (one scale, a path of its own that no test
    had run): equal to F.linear over q.dequantize()."""
    lin = nn.Linear(64, 32)
    w = lin.weight.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if per_tensor:
            q = torch.quantize_per_tensor(w, w.abs().max().item() / 127, 0, torch.qint8)
        else:
            q = torch.quantize_per_channel(w, w.abs().amax(1) / 127, torch.zeros(32, dtype=torch.long), 0,
                                           torch.qint8)
    del lin.weight
    lin.weight = q
    x = torch.randn(3, 64)
    expected = nn.functional.linear(x, q.dequantize(), lin.bias)
    h = layerstream.offload(lin, device="sim")
    assert torch.equal(lin(x), expected)
    assert h.stats()["h2d_bytes"] < 64 * 32 * 2  # packed int8, not fp32
    lin.to("cpu")  # to the compute device: the streamed layer stays as it is
    assert lin.weight is q and torch.equal(lin(x), expected)
    with pytest.raises(layerstream.LayerstreamError, match="change their dtype"):
        lin.half()  # the bias would change dtype



@pytest.mark.parametrize("per_tensor", [False, True], ids=["per-row", "per-tensor"])
def test_prequantized_int8_weight_with_weight_scale_streams_exactly(per_tensor):
    """An int8 weight with a `weight_scale` attribute (one scale per row, or one for the
    tensor) computes F.linear(x, codes * scale, bias) bit for bit (the codes times an
    fp32 scale: the same fp32 products), and detach() gives back the module's own int8
    parameter and scale. It was only ever streamed with a constant scale and never
    compared, so a scale lost on the way (every row at 1) passed."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    codes = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    scale = torch.tensor(0.013) if per_tensor else torch.rand(32) * 0.02 + 0.001
    del lin.weight
    lin.weight = nn.Parameter(codes.clone(), requires_grad=False)
    lin.weight_scale = scale
    weight = lin.weight
    x = torch.randn(3, 64)
    expected = nn.functional.linear(x, codes.float() * (scale if per_tensor else scale[:, None]), lin.bias)
    h = layerstream.offload(lin, device="sim")
    assert torch.equal(lin(x), expected)
    assert h.stats()["h2d_bytes"] < 64 * 32 * 2  # packed int8, not fp32
    h.detach()
    assert lin.weight is weight and lin.weight.dtype == torch.int8 and torch.equal(lin.weight, codes)
    assert lin.weight_scale is scale

def _align256(n):
    return (n + 255) // 256 * 256


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_dequantized_on_the_transfer_path_inside_the_budget(fmt, tmp_path):
    """The packed weight and its dequantized copy share the layer's slot: the
    dequantization runs on the dequant stream right after the copy (a
    'post-copy' slice per fetch in the timeline), not on the compute path,
    and the whole slot counts against the budget."""
    import json
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256, bias=(i % 2 == 0)) for i in range(4)]).to(torch.bfloat16)
    model.requires_grad_(False)
    ref = copy.deepcopy(model)
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    packed = layerstream._C.quant_packed_bytes(fmt, 256, 256)
    dense = 256 * 256 * 2
    slot = _align256(packed) + _align256(256 * 2) + _align256(dense)  # weight, bias, workspace
    h = layerstream.offload(model, device="sim", quantize=fmt, trace=True, budget=2 * slot)
    with torch.no_grad():
        for _ in range(3):
            y = model(x)
    s = h.stats()
    assert s["slot_bytes"] == slot
    assert s["peak_device_bytes"] <= 2 * slot
    assert h.ordering_errors() == []
    # Each step copies only the packed bytes.
    assert s["h2d_bytes"] >= 3 * 4 * packed
    assert s["h2d_bytes"] <= 3 * (4 * _align256(packed) + 2 * 512)
    path = tmp_path / "trace.json"
    h.export_trace(str(path))
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    post = [e for e in events if e.get("ph") == "X" and lanes.get(e["tid"]) == "post-copy"]
    assert len(post) >= 4, "every fetched quantized layer is dequantized on the post-copy lane"
    assert all(e["name"].startswith("dequant ") for e in post)
    # The compute lane does not dequantize.
    assert not any(e["name"].startswith("dequant") for e in events
                   if e.get("ph") == "X" and lanes.get(e["tid"]) != "post-copy")
    # Same numbers as the dense layers with the host-dequantized weights
    # (detach() restores those): the device dequantization is bit-identical.
    h.detach()
    with torch.no_grad():
        assert torch.equal(model(x), y)
        assert not torch.equal(ref(x), y)  # it really was quantized


def test_budget_must_hold_packed_and_dequantized_weight():
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Linear(256, 256, bias=False))
    model.requires_grad_(False)
    packed = _align256(layerstream._C.quant_packed_bytes("nf4", 256, 256))
    # Enough for 2 slots of packed bytes, not for packed + dequantized fp32.
    with pytest.raises(layerstream.LayerstreamError, match="copied \\+ the weight written on the device"):
        layerstream.offload(model, device="sim", quantize="nf4", budget=3 * packed)


def test_dequant_dtype_matches_cast_at_use_with_smaller_slots():
    """An fp32 checkpoint run in bf16: dequant_dtype=bf16 makes the device
    write the bf16 weight directly (half the workspace), with the same numbers
    as dequantizing to fp32 and casting at use (both round the fp32 value to
    nearest even)."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256, bias=False))
    a.requires_grad_(False)
    b = copy.deepcopy(a)
    ha = layerstream.offload(a, device="sim", quantize="int4")
    hb = layerstream.offload(b, device="sim", quantize="int4", dequant_dtype=torch.bfloat16)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        ya, yb = a(x), b(x)
    assert ya.dtype == yb.dtype == torch.bfloat16
    assert torch.equal(ya, yb)
    packed = _align256(layerstream._C.quant_packed_bytes("int4", 512, 256))
    bias = _align256(512 * 4)
    assert ha.stats()["slot_bytes"] == packed + bias + _align256(512 * 256 * 4)
    assert hb.stats()["slot_bytes"] == packed + bias + _align256(512 * 256 * 2)
    assert ha.ordering_errors() == [] and hb.ordering_errors() == []


def test_dequant_dtype_must_be_a_float_dtype():
    m = nn.Linear(128, 128)
    m.requires_grad_(False)
    with pytest.raises(ValueError, match="dequant_dtype"):
        layerstream.offload(m, device="sim", quantize="int8", dequant_dtype=torch.int8)


def test_dequant_dtype_without_a_lossy_format_is_warned_of():
    """offload(dequant_dtype=...) with no lossy quantize= (none, "lossless", a dict of
    those) was ignored without a word: the weights computed in their own dtype. Now it
    warns that it does nothing here and what it applies to; not with a lossy format."""
    def mk():
        return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).requires_grad_(False)
    for quantize, warned in ((None, True), ("lossless", True), ({"*": None}, True), ("int8", False),
                             ({"0": "nf4"}, False)):
        m = mk()
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            h = layerstream.offload(m, device="sim", quantize=quantize, dequant_dtype=torch.bfloat16)
        msgs = [str(w.message) for w in ws if "dequant_dtype=" in str(w.message)]
        assert bool(msgs) == warned, (quantize, msgs)
        if warned:
            assert msgs[0].startswith(f"layerstream: offload(dequant_dtype=torch.bfloat16) does nothing here: no "
                                      f"weight is dequantized (quantize={quantize!r} packs none with a loss")
            assert "compute_dtype=" in msgs[0] and ws[0].filename == __file__
        h.detach()


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_quantized_conv_matches_host_dequantized_weights(fmt):
    """Conv weights [out, in, kh, kw] are packed as [out, in*kh*kw]; the device
    dequantization into the slot gives exactly the host-dequantized weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3, bias=False))
    model.requires_grad_(False)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 8, 10, 10)
    h = layerstream.offload(model, device="sim", quantize=fmt)
    assert h.stats()["quantized_layers"] == 2
    with torch.no_grad():
        y = model(x)
        y_dense = ref(x)
    h.detach()  # restores the host-dequantized weights
    with torch.no_grad():
        assert torch.equal(model(x), y)
    err = ((y - y_dense).norm() / y_dense.norm()).item()
    assert 0 < err <= MODEL_TOL[fmt], err


def test_detach_restores_a_quantized_weight_in_its_memory_layout():
    """A channels_last conv weight is packed from its logical order; detach() restores
    the dequantized values in the layout the weight had (it came back contiguous)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 8, 3)).to(
        memory_format=torch.channels_last).requires_grad_(False)
    strides = [m.weight.stride() for m in model]
    assert not model[0].weight.is_contiguous()
    h = layerstream.offload(model, device="sim", quantize="int8")
    dequantized = [h._engine.dequantized_weight(a.index) for a in h._attached]
    h.detach()
    for m, st, dq in zip(model, strides, dequantized):
        assert m.weight.stride() == st
        assert torch.equal(m.weight, dq)


def test_compute_dtype_dequantizes_to_it_and_casts_the_bias_in_the_slot():
    """compute_dtype on a quantized layer: the weight is dequantized straight to
    it (as dequant_dtype does) and the fp32 bias is cast into the slot too; the
    numbers are those of dequant_dtype with the bias cast at use."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256, bias=False))
    a.requires_grad_(False)
    b = copy.deepcopy(a)
    ha = layerstream.offload(a, device="sim", quantize="int4", dequant_dtype=torch.bfloat16)
    hb = layerstream.offload(b, device="sim", quantize="int4", compute_dtype=torch.bfloat16)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    packed = _align256(layerstream._C.quant_packed_bytes("int4", 512, 256))
    bias = _align256(512 * 4)
    assert ha.stats()["slot_bytes"] == packed + bias + _align256(512 * 256 * 2)
    assert hb.stats()["slot_bytes"] == packed + bias + _align256(512 * 256 * 2) + _align256(512 * 2)
    assert hb.ordering_errors() == []


# ---------------------------------------------------------------- writing quantized weights
def _two_layer(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32)).requires_grad_(False)


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
@pytest.mark.parametrize("cache", [False, True], ids=["nocache", "cache"])
def test_load_state_dict_requantizes(offload_sim, fmt, cache):
    """load_state_dict() into an offloaded quantized model loads the new weights: they
    are re-quantized into the host store (before, the copy into the data-less parameter
    was lost and the model silently kept its old weights). Outputs then equal a model
    offloaded with the new weights from the start, bit for bit; strict loading reports
    no missing key; weights cached on the device are not reused."""
    model, new = _two_layer(0), _two_layer(1)
    for a, b in zip(model, new):  # same biases: only the quantized weights change
        if isinstance(a, nn.Linear):
            b.bias = nn.Parameter(a.bias.detach().clone(), requires_grad=False)
    fresh = copy.deepcopy(new)
    offload_sim(model, quantize=fmt, cache_across_steps=cache)
    offload_sim(fresh, quantize=fmt)
    x = torch.randn(3, 64)
    old = model(x)
    model(x)  # with cache_across_steps the weights now sit in device slots
    # Weights only (no bias write, whose version bump would also drop the cache).
    weights = {k: v for k, v in new.state_dict().items() if k.endswith("weight")}
    result = model.load_state_dict(weights, strict=False)
    assert result.missing_keys == ["0.bias", "2.bias"] and not result.unexpected_keys
    assert all(p.is_meta for n, p in model.named_parameters() if n.endswith("weight"))
    got = model(x)
    assert torch.equal(got, fresh(x))
    assert not torch.equal(got, old)
    result = model.load_state_dict(new.state_dict())  # strict: the taken keys are not missing
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(model(x), got)


def test_load_state_dict_between_forward_and_backward_raises(offload_sim):
    """Re-quantizing a weight (load_state_dict) after a forward and before its backward
    counts as an in-place write for autograd's version check, as copying into a resident
    weight does: the backward raises instead of using the new weights for the input
    gradient of the old forward."""
    model, new = _two_layer(0), _two_layer(1)
    offload_sim(model, quantize="int8")
    x = torch.randn(3, 64, requires_grad=True)
    y = model(x)
    model.load_state_dict(new.state_dict())
    with pytest.raises(RuntimeError, match=r"streamed layer '2'.*modified by an inplace operation"):
        y.sum().backward()
    x.grad = None
    model(x).sum().backward()  # a fresh forward is fine
    assert x.grad is not None


def test_load_state_dict_bad_values_keep_the_old_weight(offload_sim):
    """A NaN weight or a data-less (meta) one, e.g. from the state_dict() of an offloaded
    quantized model, fails load_state_dict() with a message naming the key; the layer
    keeps its old weight (nothing half-written) and stays usable."""
    model = _two_layer(0)
    offload_sim(model, quantize="int8")
    x = torch.randn(3, 64)
    before = model(x)
    sd = {k: v.clone() for k, v in _two_layer(1).state_dict().items()}
    sd["0.weight"][0, 0] = float("nan")
    with pytest.raises(RuntimeError, match=r'"0.weight".*NaN'):
        model.load_state_dict(sd)
    assert torch.equal(model[0].bias, sd["0.bias"])  # the rest loaded, as torch does
    model[0].bias.data.copy_(_two_layer(0)[0].bias)
    model[2].load_state_dict(_two_layer(0)[2].state_dict())
    assert torch.equal(model(x), before)
    with pytest.raises(RuntimeError, match=r'"0.weight".*data-less \(meta\)'):
        model.load_state_dict(model.state_dict())
    assert torch.equal(model(x), before)


def test_writes_to_a_quantized_weight_requantize_or_are_refused(offload_sim):
    """The data-less parameter of a quantized layer never swallows a write (before,
    copy_ and in-place ops into the meta tensor were silently lost): copy_ re-quantizes;
    other in-place ops, .data writes (peft's merge), conversions and moves fail at once,
    saying what to do; a write that bypasses all that (no __torch_function__) is caught
    by the version counter at the next call. Reads behave as on a meta tensor."""
    import io

    model, new = _two_layer(0), _two_layer(1)
    fresh = copy.deepcopy(new)
    offload_sim(model, quantize="int8")
    offload_sim(fresh, quantize="int8")
    x = torch.randn(3, 64)
    w = model[0].weight
    assert w.is_meta and w.shape == (64, 64) and w.dtype == torch.float32 and not w.requires_grad
    assert "packed weight of '0'" in repr(w)
    with torch.no_grad():
        w.copy_(new[0].weight)
        model[2].weight.data.copy_(new[2].weight)  # .data is the parameter itself
        model[0].bias.copy_(new[0].bias)
        model[2].bias.copy_(new[2].bias)
    assert torch.equal(model(x), fresh(x))
    before = model(x)
    refused = {
        "mul_": lambda: w.mul_(2),
        "data +=": lambda: w.data.add_(1),  # what `w.data += delta` runs
        "iadd": lambda: w.__iadd__(1),
        "setitem": lambda: w.__setitem__(0, 1.0),
        ".data =": lambda: setattr(w, "data", torch.zeros(64, 64)),
        "to fp16": lambda: model.to(torch.float16),
        "to cpu": lambda: w.to("cpu"),
        "torch.save": lambda: torch.save(model.state_dict(), io.BytesIO()),
        # safetensors reads the bytes at data_ptr(), 0 for a meta tensor: it failed with
        # "invalid shape, data type, or offset for tensor", naming no tensor.
        "safetensors": lambda: safetensors.torch.save(model.state_dict()),
        "deepcopy": lambda: copy.deepcopy(w),
    }
    for what, write in refused.items():
        with torch.no_grad(), pytest.raises(layerstream.LayerstreamError,
                                            match=r"streamed layer '[02]'.*detach\(\)"):
            write()
        assert torch.equal(model(x), before), what
    for train in (lambda: w.requires_grad_(), lambda: setattr(w, "requires_grad", True),
                  lambda: model.requires_grad_(True)):
        # Before, the flag flipped but the layer never produced a gradient for it.
        with pytest.raises(layerstream.LayerstreamError, match="cannot be trained"):
            train()
    assert not w.requires_grad
    model.requires_grad_(False)  # freezing is fine
    model.to(torch.float32)  # a no-op conversion is fine
    model.train(False)
    assert torch.equal(model(x), before)
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        w.mul_(2)  # reaches the meta tensor itself: a no-op, but it bumps the version counter
    with pytest.raises(layerstream.LayerstreamError, match=r"quantized layer '0' was written in place"):
        model(x)
    model.load_state_dict(new.state_dict())  # loads the values and re-arms the check
    assert torch.equal(model(x), fresh(x))


class _TwoLinears(nn.Module):
    """a -> relu -> b: LoRA targets for the peft tests below."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_peft_merge_into_a_quantized_base_is_refused(offload_sim):
    """peft's merge_and_unload() adds the adapter through `base.weight.data += delta`; into
    a quantized streamed base that was silently dropped (the merged model computed without
    the adapter). Now it fails naming detach(); after detach() the merge works."""
    peft = pytest.importorskip("peft")

    model = peft.get_peft_model(_TwoLinears(), peft.LoraConfig(r=4, target_modules=["a", "b"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    handle = offload_sim(model, exclude=["*lora_*"], quantize="int8")
    x = torch.randn(3, 32)
    with_adapter = model(x)
    with pytest.raises(layerstream.LayerstreamError, match=r"merge a LoRA adapter.*detach\(\)"):
        model.merge_and_unload()
    handle.detach()
    merged = model.merge_and_unload()
    torch.testing.assert_close(merged(x), with_adapter, rtol=1e-5, atol=1e-5)


class _SmallThenWide(nn.Module):
    """a -> b (small: a budget keeps them resident) -> four wide Linears (streamed), summed."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.wide = nn.ModuleList(nn.Linear(64, 1024) for _ in range(4))

    def forward(self, x):
        y = self.b(self.a(x))
        return sum(layer(y) for layer in self.wide)


def test_peft_merge_into_a_quantized_base_kept_resident_is_refused_before_any_layer_is_written(offload_sim):
    """peft's merges write each base weight through `.data` in turn: a quantized layer the
    budget kept resident (a dense tensor) took its write, a dense layer before it too, and the
    first streamed one refused: the adapter was half merged, and disable_adapter() no longer
    gave the base model. Now merge_adapter() and merge_and_unload() are refused before any
    layer is written, naming the layer and what to do; after detach() the merge works."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(_SmallThenWide(), peft.LoraConfig(
        r=4, target_modules=["a", "b", "wide.0", "wide.1", "wide.2", "wide.3"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    handle = offload_sim(model, exclude=["*lora_*"], quantize={"*.a.base_layer": None, "*": "int8"},
                         budget="800KiB")
    base = model.base_model.model
    assert not base.a.base_layer.weight.is_meta and not base.b.base_layer.weight.is_meta  # kept resident
    assert all(layer.base_layer.weight.is_meta for layer in base.wide)  # streamed
    x = torch.randn(3, 64)
    with torch.no_grad():
        with_adapter = model(x)
        with model.disable_adapter():
            without = model(x)
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    for merge in (model.merge_adapter, model.merge_and_unload):
        with pytest.raises(layerstream.LayerstreamError,
                           match=r"quantized layer 'base_model\.model\.b\.base_layer' \(kept resident by the budget\)"
                                 r".*nothing was merged.*Merge before offload\(\).*handle\.detach\(\) first"):
            merge()
        assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters() if not p.is_meta)
        with torch.no_grad():
            assert torch.equal(model(x), with_adapter)
            with model.disable_adapter():
                assert torch.equal(model(x), without)
    handle.detach()
    merged = model.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(x), with_adapter, rtol=1e-5, atol=1e-5)


def test_a_peft_merge_refuses_only_the_adapters_it_would_write_into_a_quantized_layer(offload_sim):
    """A merge was refused whenever any adapter layer's base held a quantized weight, also
    merge_adapter(adapter_names=["d"]) / merge_and_unload(adapter_names=["d"]) of an adapter
    that is on a dense layer only (nothing quantized written). Now a merge is refused when
    a layer it writes (one holding an adapter it merges: the named ones, else the active
    ones) is quantized, before any layer is written, naming that adapter; a merge of the
    dense-only adapter computes what the adapter did."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(_SmallThenWide(), peft.LoraConfig(
        r=4, target_modules=["a", "b", "wide.0"], init_lora_weights=False), adapter_name="q")
    model.add_adapter("d", peft.LoraConfig(r=4, target_modules=["a"], init_lora_weights=False))
    handle = offload_sim(model, exclude=["*lora_*"], quantize={"*.a.base_layer": None, "*": "int8"},
                         budget="800KiB")
    base = model.base_model.model
    assert not base.b.base_layer.weight.is_meta and base.wide[0].base_layer.weight.is_meta  # resident, streamed
    x = torch.randn(3, 64)
    with torch.no_grad():
        with_q = model(x)
        model.set_adapter("d")
        with_d = model(x)
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    for merge in (lambda: model.merge_adapter(adapter_names=["d", "q"]), lambda: model.merge_adapter(["q"]),
                  lambda: model.merge_and_unload(adapter_names=["q"])):
        with pytest.raises(layerstream.LayerstreamError,
                           match=r"quantized layer 'base_model\.model\.b\.base_layer'.*cannot write adapter 'q'"
                                 r".*nothing was merged"):
            merge()
        assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters() if not p.is_meta)
    with pytest.raises(layerstream.LayerstreamError, match=r"cannot write adapter 'q'"):
        model.base_model._check_merge_allowed()  # a merge that does not say which adapters: any of them
    with torch.no_grad():
        model.merge_adapter()  # the active adapter: "d"
        torch.testing.assert_close(model(x), with_d, rtol=1e-5, atol=1e-5)
        model.unmerge_adapter()
        model.set_adapter("q")
        with pytest.raises(layerstream.LayerstreamError, match=r"cannot write adapter 'q'"):
            model.merge_adapter()
        torch.testing.assert_close(model(x), with_q, rtol=1e-5, atol=1e-5)  # a: merged and unmerged
        merged = model.merge_and_unload(adapter_names=["d"])
        torch.testing.assert_close(merged(x), with_d, rtol=1e-5, atol=1e-5)
    handle.detach()


_MERGE_AFTER_A_LATE_PEFT_IMPORT = """
import sys, torch, torch.nn as nn, layerstream
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.wide = nn.ModuleList(nn.Linear(64, 1024) for _ in range(4))
    def forward(self, x):
        y = self.a(x)
        return sum(layer(y) for layer in self.wide)
torch.manual_seed(0)
model = M().requires_grad_(False)
layerstream.offload(model, device="sim", quantize="int8", budget="800KiB")
assert "peft" not in sys.modules and not model.a.weight.is_meta and model.wide[0].weight.is_meta
import peft
pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["a", "wide.0"], init_lora_weights=False))
x = torch.randn(2, 64)
with torch.no_grad():
    before = pm(x)
weights = {n: p.clone() for n, p in pm.named_parameters() if not p.is_meta}
try:
    pm.merge_and_unload()
except layerstream.LayerstreamError as e:
    assert "nothing was merged" in str(e), e
    assert all(torch.equal(p, weights[n]) for n, p in pm.named_parameters() if not p.is_meta)
    with torch.no_grad():
        assert torch.equal(pm(x), before)
    print("refused")
"""


def test_a_merge_after_peft_was_imported_after_offload_is_refused_before_any_layer_is_written():
    """peft's merges are guarded from offload() while peft is imported; a script that
    imports peft only after offload() (then get_peft_model() over the quantized base) got
    the half-merged model: the guard is also put in place by the first call of the model
    after peft's adapters were added. In a fresh process, where peft is not imported yet."""
    import os
    import subprocess
    import sys

    pytest.importorskip("peft")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", _MERGE_AFTER_A_LATE_PEFT_IMPORT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["refused"]


def test_lora_added_after_offload_lives_on_the_host_and_trains(offload_sim):
    """The flow the 'would quantize trainable layers' error suggests: quantize the
    frozen base, then add the adapter. peft puts an adapter on its base weight's
    device; the packed stand-in reports the CPU (it is meta underneath), so the
    adapter gets real host tensors. (It used to get meta ones: values lost.)"""
    peft = pytest.importorskip("peft")

    base = _TwoLinears().requires_grad_(False)
    handle = offload_sim(base, quantize="int8")
    assert base.a.weight.is_meta and base.a.weight.device == torch.device("cpu")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["a", "b"]))
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(lora) == 4 and all(p.device.type == "cpu" and not p.is_meta for p in lora.values())
    with torch.no_grad():
        for n, p in lora.items():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    x = torch.randn(3, 32)
    model(x).square().sum().backward()
    got = {n: p.grad.clone() for n, p in lora.items()}
    out = model(x).detach()
    handle.detach()  # dense, dequantized base weights: the same function without streaming
    for p in lora.values():
        p.grad = None
    torch.testing.assert_close(model(x), out, rtol=1e-5, atol=1e-6)
    model(x).square().sum().backward()
    for n, p in lora.items():
        torch.testing.assert_close(p.grad, got[n], rtol=1e-5, atol=1e-6)


def test_in_place_write_to_a_prequantized_int8_weight_is_an_error(offload_sim):
    """A weight that arrived int8 (with weight_scale) is copied into the host store; a
    later write to the module's int8 parameter (here add_; load_state_dict's copy alike)
    is refused at the next call."""
    lin = nn.Linear(64, 32)
    codes = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    del lin.weight
    lin.weight = nn.Parameter(codes, requires_grad=False)
    lin.weight_scale = torch.full((32,), 0.01)
    offload_sim(lin)
    x = torch.randn(2, 64)
    lin(x)
    with torch.no_grad():
        lin.weight.add_(1)
    with pytest.raises(layerstream.LayerstreamError, match="written in place"):
        lin(x)


def test_a_budget_too_small_suggests_a_narrower_write_only_where_there_is_one():
    """offload()'s "budget too small" error: fp32 weights packed to int8 are dequantized to
    fp32 in the slot, so it suggests having the device write bf16; with dequant_dtype
    bfloat16, or lossless bf16 weights (decoded into their own dtype), it does not."""
    def message(dtype, **kw):
        model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)).to(dtype).requires_grad_(False)
        with pytest.raises(layerstream.LayerstreamError, match="is too small: the largest layer") as e:
            layerstream.offload(model, device="sim", budget="100KiB", **kw)
        return str(e.value)

    assert "have the device write a narrower dtype" in message(torch.float32, quantize="int8")
    assert "narrower dtype" not in message(torch.float32, quantize="int8", dequant_dtype="bfloat16")
    assert "narrower dtype" not in message(torch.bfloat16, quantize="lossless")


def test_a_budget_too_small_for_quantized_slots_says_when_the_stored_slot_is_smaller():
    """bf16 weights packed to nf4 take a larger slot than as stored (the packed copy and
    the bf16 weight written from it), so a budget that holds the unquantized slots was
    "too small" with quantize="nf4" and no advice. The error now gives the slot as stored,
    which fits; fp32 weights packed to nf4 and written in bf16 take a smaller slot, and
    it says nothing of it."""
    layer = 256 * 256 * 2 + 256 * 2

    def model(dtype):
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).to(dtype).requires_grad_(False)

    with pytest.raises(layerstream.LayerstreamError, match="is too small") as e:
        layerstream.offload(model(torch.bfloat16), device="sim", budget=2 * layer + 100, quantize="nf4", prefetch=1)
    assert str(e.value).endswith("(streamed as stored, without quantize= / compute_dtype, it would need a slot "
                                 "of 128.50 KiB: what crosses the bus shrinks, but the slot also holds the weight "
                                 "written from it)"), e.value
    layerstream.offload(model(torch.bfloat16), device="sim", budget=2 * layer + 100, prefetch=1).detach()
    with pytest.raises(layerstream.LayerstreamError, match="is too small") as e:
        layerstream.offload(model(torch.float32), device="sim", budget=2 * layer, quantize="nf4",
                            dequant_dtype="bfloat16", prefetch=1)
    assert "streamed as stored" not in str(e.value), e.value


def test_a_budget_too_small_suggests_quantizing_only_a_layer_it_applies_to():
    """offload()'s "budget too small" error ended "(or quantize the weights, e.g. to nf4)"
    when its largest layer was a head tied to the embedding, which streams as stored
    (quantize= does not apply to it), also with quantize="nf4" given. It says so now, as
    the C++ planner does (PlannerLayer::as_stored); an untied head is still told to."""
    for tied, quantize in ((True, None), (True, "nf4"), (False, None)):
        model = TiedHead(tied).requires_grad_(False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tied head stays unquantized: warned
            with pytest.raises(layerstream.LayerstreamError,
                               match="is too small: the largest layer \"head\"") as e:
                layerstream.offload(model, device="sim", budget="300KiB", prefetch=1, quantize=quantize)
        text = str(e.value)
        if tied:
            assert text.endswith("(it streams as stored: quantization does not apply to it)"), text
            assert "quantize the weights" not in text, text
        else:
            assert text.endswith("(or quantize the weights, e.g. to nf4)"), text
