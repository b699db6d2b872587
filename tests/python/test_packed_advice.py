"""What a frozen lossless-coded weight's refusals advise: the way that works (detach, change,
offload again), not load_state_dict()/copy_(), which the engine refuses for a coded weight."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn

import layerstream
from conftest import TwoLinears
from layerstream import LayerstreamError


def _frozen(groups):
    torch.manual_seed(0)
    model = nn.Sequential(TwoLinears(), nn.Linear(16, 8)) if groups else nn.Sequential(nn.Linear(16, 16),
                                                                                 nn.Linear(16, 8))
    return model.requires_grad_(False)


@pytest.mark.parametrize("groups", [None, ["0"]], ids=["layer", "group"])
def test_a_write_into_a_frozen_lossless_weight_advises_detach_change_offload(offload_sim, groups):
    """w.add_() (and peft's merge, `.data += delta`) into a frozen lossless weight said "Load new
    values with load_state_dict() or weight.copy_() (they are re-quantized)", but both are refused
    for a lossless-coded weight. The refusal now advises detach(), change, offload() again; that
    advice is followed here and gives the resident model's numbers with the changed weight."""
    model = _frozen(groups)
    ref = copy.deepcopy(model)
    handle = offload_sim(model, quantize="lossless", groups=groups)
    w = model[0].a.weight if groups else model[0].weight
    for write in (lambda: w.add_(1.0), lambda: w.data.__iadd__(1.0)):
        with pytest.raises(LayerstreamError) as info:
            write()
        text = str(info.value)
        assert "lossless-coded" in text and "re-quantized" not in text
        assert re.search(r"not by load_state_dict\(\) or weight\.copy_\(\) either\): call handle\.detach\(\) "
                         r"\(it restores the weight bit for bit\), change it, then offload\(\) again", text)
    with pytest.raises((LayerstreamError, RuntimeError), match="lossless-coded"):
        w.copy_(torch.zeros(w.shape))  # what the old message advised: refused
    # The advice, followed.
    handle.detach()
    with torch.no_grad():
        (model[0].a.weight if groups else model[0].weight).add_(1.0)
        (ref[0].a.weight if groups else ref[0].weight).add_(1.0)
    offload_sim(model, quantize="lossless", groups=groups)
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_unfreezing_a_frozen_lossless_group_tensor_says_lossless_trains(offload_sim):
    """requires_grad_(True) on a frozen lossless tensor of a tensor group said it "cannot be
    trained ... train an adapter (LoRA), or offload() again without quantizing": lossless
    weights do train. It now says so, as for a single layer; the advice works."""
    model = _frozen(["0"])
    ref = copy.deepcopy(model).requires_grad_(True)
    handle = offload_sim(model, quantize="lossless", groups=["0"])
    with pytest.raises(LayerstreamError, match=r"lossless weights do train: detach\(\), requires_grad_\(True\), "
                                               r"then offload\(\) again"):
        model[0].a.weight.requires_grad_(True)
    handle.detach()
    model.requires_grad_(True)
    offload_sim(model, quantize="lossless", groups=["0"])
    x = torch.randn(3, 16)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert torch.equal(model[0].a.weight.grad, ref[0].a.weight.grad)


def test_a_write_into_an_int8_weight_still_advises_requantizing_copy(offload_sim):
    """The lossy formats keep their advice: copy_() re-quantizes, and it works."""
    model = _frozen(None)
    offload_sim(model, quantize="int8")
    with pytest.raises(LayerstreamError, match=r"Load new values with load_state_dict\(\) or weight\.copy_\(\)"):
        model[0].weight.add_(1.0)
    model[0].weight.copy_(torch.zeros(16, 16))
    with torch.no_grad():
        assert torch.equal(model[0](torch.randn(2, 16)), model[0].bias.expand(2, 16))


def test_peft_merge_into_a_frozen_lossless_base_advises_what_works(offload_sim):
    """peft's merge_adapter() into a frozen lossless base said to load the values with
    load_state_dict()/copy_() (refused for lossless). It now advises detach() first; after
    it the merge works and the merged model computes what the adapted one did."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["0", "1"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    handle = offload_sim(model, exclude=["*lora_*"], quantize="lossless")
    x = torch.randn(3, 16)
    with torch.no_grad():
        with_adapter = model(x)
    with pytest.raises(LayerstreamError, match=r"lossless-coded.*call handle\.detach\(\).*then offload\(\) again"):
        model.merge_adapter()
    handle.detach()
    merged = model.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(x), with_adapter, rtol=1e-5, atol=1e-5)
