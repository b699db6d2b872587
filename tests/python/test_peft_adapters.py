"""peft adapters whose forward reads their base layer's weight or bias itself (DoRA, HRA,
BOFT over a biased layer, ...: _discovery.peft_base_reader), and peft's
prepare_model_for_kbit_training(), around offload(): the base layers of such adapters
stay resident when the adapter is there first; added later, the first call refuses them
naming the adapter; over quantized layers, the errors name the peft code refused and
what to do instead. Training matches the resident peft model exactly."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from layerstream import LayerstreamError

from conftest import tiny_llama

peft = pytest.importorskip("peft")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))


def _train_exactly(model, ref, steps=2):
    """SGD steps on random inputs: outputs and every gradient bit-identical each step."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for _ in range(steps):
        x = torch.randn(8, 16)
        y, yr = model(x), ref(x)
        assert torch.equal(y, yr)
        y.square().sum().backward()
        yr.square().sum().backward()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), n
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()


@pytest.mark.parametrize("label, config", [
    pytest.param("HRA", lambda: peft.HRAConfig(r=4, target_modules=["0"], init_weights=False), id="HRA"),
    pytest.param("DeFT", lambda: peft.DeftConfig(r=4, target_modules=["0"]), id="DeFT"),  # reads the bias
    pytest.param("MiSS", lambda: peft.MissConfig(r=4, target_modules=["0"], init_weights="bat"), id="MiSS-bat"),
])
def test_peft_adapters_that_read_their_base_weight_keep_it_resident_at_offload(offload_sim, label, config):
    """Before, only DoRA's base layers stayed resident: HRA (its forward reads
    base_layer.weight.data), DeFT (base_layer.bias) and MiSS "bat" streamed theirs with
    no warning; on the sim device the numbers matched (the host computes), on a GPU the
    adapter met host tensors (device mismatch)."""
    model = peft.get_peft_model(_mlp(), config())
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match=rf"1 layer\(s\) of peft adapters that read their base layer's weights "
                                            rf"themselves stay resident .*'base_model.model.0.base_layer' \({label}\)"):
        handle = offload_sim(model)
    assert handle.layers == ["base_model.model.2", "base_model.model.4"]
    _train_exactly(model, ref)


def test_peft_adapters_that_do_not_read_their_base_weight_still_stream(offload_sim):
    """The rule names what reads: MiSS without "bat", and DeFT over a layer without
    bias, call their base layer's forward only, so their base layers stream."""
    base = _mlp()
    base[0] = nn.Linear(16, 16, bias=False)
    model = peft.get_peft_model(base, peft.DeftConfig(r=4, target_modules=["0"]))
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    assert "base_model.model.0.base_layer" in handle.layers
    _train_exactly(model, ref)
    model = peft.get_peft_model(_mlp(), peft.MissConfig(r=4, target_modules=["0"]))
    assert "base_model.model.0.base_layer" in offload_sim(model).layers


def test_dora_added_after_offload_is_refused_at_the_first_call_naming_the_adapter(offload_sim):
    """Before, get_peft_model(use_dora=True) after offload() left the DoRA base layers
    streamed without a word, and DoRA's forward read their host weights (on a GPU,
    torch's device-mismatch error naming nothing of layerstream's). Now each call refuses
    it, naming the adapter, its layer and the way out; after detach() and offload()
    again the base layer stays resident and training matches the resident model."""
    def dora(base):
        torch.manual_seed(1)
        return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["0"], use_dora=True,
                                                         init_lora_weights=False))

    base = _mlp()
    ref = dora(copy.deepcopy(base))
    handle = offload_sim(base)
    model = dora(base)
    for _ in range(2):  # the refusal stays until the model is offloaded again
        with pytest.raises(LayerstreamError, match=r"peft's DoRA adapter '0' was added after offload\(\).* base "
                                                   r"layer '0.base_layer' itself.*Add the adapter before offload\(\)"
                                                   r".*handle.detach\(\)"):
            model(torch.randn(2, 16))
    handle.detach()
    with pytest.warns(RuntimeWarning, match=r"'base_model.model.0.base_layer' \(DoRA\)"):
        handle = offload_sim(model)
    assert "base_model.model.0.base_layer" not in handle.layers
    _train_exactly(model, ref)


def test_dora_added_to_an_offloaded_peft_model_is_refused_in_its_generate(offload_sim):
    """peft's PeftModel.generate() calls the causal LM inside the peft wrappers, below the
    offloaded root: the root's call hooks never ran, and a DoRA adapter added after
    offload() computed unrefused there. Now the hooks on the modules a caller enters
    below the root (Note [Calls that enter the model below its root]) refuse it in
    generate(), as in a call of the root."""
    pm = peft.get_peft_model(tiny_llama().requires_grad_(False), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    offload_sim(pm)
    ids = torch.randint(0, 64, (1, 4))
    pm.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
    pm.add_adapter("d", peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    pm.set_adapter("d")
    with pytest.raises(LayerstreamError, match=r"peft's DoRA adapter '\S+q_proj' was added after offload\(\)"):
        pm.generate(input_ids=ids, max_new_tokens=2, do_sample=False)


def test_hra_added_after_a_quantized_offload_is_refused_naming_hra(offload_sim):
    """Before, HRA added over an offload(quantize="int8") model failed in its forward with
    the stand-in's "computing with it (mm())", naming no adapter."""
    model = tiny_llama().requires_grad_(False)
    offload_sim(model, quantize="int8")
    pm = peft.get_peft_model(model, peft.HRAConfig(r=4, target_modules=["q_proj"], init_weights=False))
    with pytest.raises(LayerstreamError, match=r"peft's HRA adapter 'model.layers.0.self_attn.q_proj' .* held "
                                               r"quantized .*HRA over a quantized layer is not supported.*before "
                                               r"offload\(\)"):
        pm(torch.randint(0, 64, (2, 5)))


def test_qdora_over_a_quantized_offload_is_refused_naming_dora(offload_sim):
    """Before, get_peft_model(use_dora=True) over an offload(quantize=...) model failed
    with "cannot be converted or moved (to())" and advice about load_state_dict and
    merges; now the refusal names DoRA and says to add it before offload()."""
    model = tiny_llama().requires_grad_(False)
    offload_sim(model, quantize="nf4")
    with pytest.raises(LayerstreamError, match=r"cannot be converted or moved \(to\(\)\)\. peft's DoRA adapter "
                                               r"\(DoraLinearLayer\.\w+\) .*not supported\. Add the adapter before "
                                               r"offload\(\)") as e:
        peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    assert "load_state_dict" not in str(e.value)


def _bf16_llama():
    return tiny_llama().to(torch.bfloat16).requires_grad_(False)


def test_prepare_model_for_kbit_training_after_a_quantized_offload_is_refused_before_casting(offload_sim):
    """Before, peft's prepare_model_for_kbit_training() after offload(quantize="nf4") cast
    the embedding to float32 through .data, then failed at the first packed weight with
    "cannot be converted or moved (to())" and advice that did not fit, leaving the model
    half-converted (and the next call failing on the embedding). Now it is refused at its
    first loop (the freeze), before anything is cast, naming it and what to do."""
    model = _bf16_llama()
    offload_sim(model, quantize="nf4")
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(LayerstreamError, match=r"prepare_model_for_kbit_training\(\) casts .*nothing was cast yet.*"
                                               r"Call it before offload\(\).*gradient_checkpointing_enable\(\)"):
        peft.prepare_model_for_kbit_training(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_prepare_model_for_kbit_training_before_offload_trains_as_the_resident_model(offload_sim):
    """The QLoRA recipe in the order the README gives: prepare_model_for_kbit_training(),
    offload(), get_peft_model(); with quantize="nf4" a step runs, and unquantized the
    loss and the adapters' gradients equal the resident model's."""
    def build(offload, **kw):
        model = peft.prepare_model_for_kbit_training(_bf16_llama())
        handle = offload(model, **kw) if offload else None
        torch.manual_seed(3)
        return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                          init_lora_weights=False)), handle

    ids = torch.randint(0, 64, (2, 5))
    model, _ = build(offload_sim, quantize="nf4")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    model, _ = build(offload_sim)
    ref, _ = build(None)
    loss, ref_loss = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    loss.backward(), ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), n
