"""bitsandbytes NF4 weights (Linear4bit / Params4bit, QLoRA's format) stream
as they are: their codes and absmax become our nf4 layout byte for byte, so
the device dequantization gives exactly bitsandbytes' own dequantized weight."""
import copy
import io

import pytest
import torch
import torch.nn as nn

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF

import layerstream


def bnb_linear(n_in, n_out, bias=True, compress_statistics=True, quant_type="nf4", dtype=torch.bfloat16,
               quant_storage=torch.uint8):
    """A Linear4bit quantized on the CPU (bitsandbytes quantizes when the module moves)."""
    dense = nn.Linear(n_in, n_out, bias=bias)
    lin = bnb.nn.Linear4bit(n_in, n_out, bias=bias, compute_dtype=dtype, quant_type=quant_type,
                            compress_statistics=compress_statistics, quant_storage=quant_storage)
    lin.weight = bnb.nn.Params4bit(dense.weight.data.to(dtype), requires_grad=False, quant_type=quant_type,
                                   compress_statistics=compress_statistics, quant_storage=quant_storage)
    if bias:
        lin.bias = nn.Parameter(dense.bias.data.to(dtype), requires_grad=False)
    return lin.to("cpu")


def bnb_dequantized(lin):
    return bnbF.dequantize_4bit(lin.weight.data, lin.weight.quant_state)


@pytest.mark.parametrize("nested, storage", [(True, torch.uint8), (False, torch.uint8), (True, torch.bfloat16)],
                         ids=["double-quant", "plain-absmax", "bf16-storage"])
def test_bnb_nf4_streams_bit_identical_to_its_own_dequantization(nested, storage):
    """Also with the codes stored in bfloat16 (bnb_4bit_quant_storage, FSDP-QLoRA's choice):
    the same bytes, given back in that container by detach() (was: refused, "pre-packed
    codes must be an int8/uint8 tensor")."""
    torch.manual_seed(0)
    model = nn.Sequential(bnb_linear(128, 256, compress_statistics=nested, quant_storage=storage), nn.GELU(),
                          bnb_linear(256, 64, bias=False, compress_statistics=nested, quant_storage=storage))
    assert model[0].weight.quant_state is not None and model[0].weight.dtype == storage
    w_ref = [bnb_dequantized(model[0]), bnb_dequantized(model[2])]
    b0 = model[0].bias.detach().clone()
    codes_before = [model[0].weight.data.clone(), model[2].weight.data.clone()]
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        want = nn.functional.linear(nn.functional.gelu(nn.functional.linear(x, w_ref[0], b0)), w_ref[1])
        y_bnb = model(x)  # bitsandbytes' own forward, before offload
    h = layerstream.offload(model, device="sim")
    s = h.stats()
    assert s["quantized_layers"] == 2
    with torch.no_grad():
        y = model(x)
        y2 = model(x)
    assert torch.equal(y, want), "device dequantization must equal bitsandbytes' dequantize_4bit"
    assert torch.equal(y, y2)
    torch.testing.assert_close(y, y_bnb, rtol=2e-2, atol=2e-2)
    # Only the packed bytes cross the bus: ~0.56 B/param instead of 2 (bf16).
    h2d = h.stats()["h2d_bytes"] / 2  # two forward passes
    params = 128 * 256 + 256 * 64
    assert h2d < 0.6 * params + 256 * 2 + 4096, h2d
    assert model[0].weight.is_meta  # bitsandbytes' copy was released
    assert h.ordering_errors() == []
    # detach() rebuilds the Params4bit from the same bytes: bitsandbytes runs it again.
    h.detach()
    assert type(model[0].weight).__name__ == "Params4bit" and model[0].weight.dtype == storage
    for got, want in zip((model[0].weight.data, model[2].weight.data), codes_before):  # as bytes (bf16: NaNs)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    with torch.no_grad():
        assert torch.equal(model(x), y_bnb)


def test_state_dict_of_an_offloaded_bnb_model_keeps_its_quant_state_keys():
    """bitsandbytes adds its quant state's keys (weight.absmax, weight.quant_map, weight.nested_*,
    weight.quant_state.bitsandbytes__nf4) from weight.quant_state, which the streamed stand-in has
    not: state_dict() of the offloaded model here had 5 keys where the resident one has 18, without a
    word. Now the same keys in the same order, with the same quant-state values (copies: a write
    into them changes nothing detach() gives back); the weight itself stays the data-less
    stand-in, whose save is refused with the save message; detach() gives bitsandbytes' own."""
    torch.manual_seed(0)
    model = nn.Sequential(bnb_linear(64, 64), bnb_linear(64, 64, compress_statistics=False),
                          bnb_linear(64, 64, bias=False))
    resident = {k: v.clone() for k, v in model.state_dict().items()}
    assert len(resident) == 18  # weight, bias, absmax, quant_map, the packed state; nested_* when double-quantized
    h = layerstream.offload(model, device="sim")
    assert all(model[i].weight.is_meta for i in range(3))  # streamed
    offloaded = model.state_dict()
    assert list(offloaded) == list(resident)
    for k, v in offloaded.items():
        assert v.is_meta if k.endswith(".weight") else torch.equal(v, resident[k]), k
    offloaded["0.weight.absmax"].fill_(0)
    with pytest.raises(layerstream.LayerstreamError, match=r"it cannot be saved \(torch.save"):
        torch.save(offloaded, io.BytesIO())
    h.detach()
    after = model.state_dict()
    assert list(after) == list(resident)
    assert all(torch.equal(after[k], v) for k, v in resident.items())


def test_lora_over_bnb_nf4_base_trains_the_adapter():
    import peft

    torch.manual_seed(0)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = bnb_linear(64, 64)

        def forward(self, x):
            return self.proj(x)

    base = Tiny()
    ref = copy.deepcopy(base)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], lora_dropout=0.0,
                           init_lora_weights=False)
    model = peft.get_peft_model(base, cfg)
    ref = peft.get_peft_model(ref, cfg)
    with torch.no_grad():  # same adapter weights in both
        mine = dict(model.named_parameters())
        for n, p in ref.named_parameters():
            if p.requires_grad:
                p.copy_(mine[n])
    h = layerstream.offload(model, device="sim")
    assert h.stats()["quantized_layers"] == 1
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    y, y_ref = model(x), ref(x)
    assert torch.equal(y, y_ref)
    y.float().pow(2).sum().backward()
    y_ref.float().pow(2).sum().backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and len(got) == 2  # lora_A, lora_B
    # bit for bit: the streamed base computes with exactly bitsandbytes' dequantized weight
    # (test above) and the adapters are the same resident modules on the same CPU ops
    for n in want:
        assert torch.equal(got[n], want[n]), n
    assert h.ordering_errors() == []


def test_bnb_fp4_is_a_clear_error():
    model = nn.Sequential(bnb_linear(64, 64, quant_type="fp4"))
    with pytest.raises(layerstream.LayerstreamError, match="fp4"):
        layerstream.offload(model, device="sim")


def test_prepacked_input_is_checked():
    e = layerstream._C.Engine({"device": "sim"})
    codes = torch.zeros(64 * 128 // 2, dtype=torch.uint8)
    absmax = torch.ones(64 * 128 // 64)
    with pytest.raises(layerstream.LayerstreamError, match="needs 4096 bytes of codes, got 4095"):
        e.add_linear_packed("a", "nf4", codes[:-1], absmax, None, 64, 128, torch.bfloat16)
    with pytest.raises(layerstream.LayerstreamError, match="needs 128 scales, got 127"):
        e.add_linear_packed("b", "nf4", codes, absmax[:-1], None, 64, 128, torch.bfloat16)
    with pytest.raises(layerstream.LayerstreamError, match="NaN/Inf"):
        e.add_linear_packed("c", "nf4", codes, absmax * float("nan"), None, 64, 128, torch.bfloat16)
    with pytest.raises(layerstream.LayerstreamError, match="int8, fp8, nf4 and GGUF formats, got int4"):
        e.add_linear_packed("d", "int4", codes, absmax, None, 64, 128, torch.bfloat16)
    with pytest.raises(layerstream.LayerstreamError, match="int8/uint8"):
        e.add_linear_packed("e", "nf4", codes.float(), absmax, None, 64, 128, torch.bfloat16)
    # The caller's tensors are copied, not aliased or modified.
    i = e.add_linear_packed("f", "nf4", codes, absmax, None, 64, 128, torch.bfloat16)
    codes.fill_(0x11)
    assert int(e.packed_codes(i).max()) == 0
