"""peft merges over offloaded layers whose tuner does not run peft's pre-merge check
(BaseTuner._check_merge_allowed, which layerstream extends: _packed.guard_peft_merges):
PeftMixedModel's merge_and_unload() (adapters of several types, here LoRA and LoHa) and LN
tuning's merges (LNTuningConfig: they swap the base layer with its tuned copy); diffusers'
fuses; unmerges of adapters merged before offload(). LoRA's own merges:
test_quant_offload.py and test_training.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from layerstream import LayerstreamError

peft = pytest.importorskip("peft")


class _SmallThenWide(nn.Module):
    """a -> norm -> b (small: a budget keeps them resident) -> four wide Linears (streamed), summed."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64)
        self.wide = nn.ModuleList(nn.Linear(64, 1024) for _ in range(4))

    def forward(self, x):
        y = self.b(self.norm(self.a(x)))
        return sum(layer(y) for layer in self.wide)


def _mixed():
    """LoRA 'l' and LoHa 'h' (over it on b and wide.0), both active, not zero at the start."""
    torch.manual_seed(0)
    model = peft.PeftMixedModel(_SmallThenWide(), peft.LoraConfig(
        r=4, target_modules=["a", "b", "wide.0", "wide.1"], init_lora_weights=False), "l")
    model.add_adapter("h", peft.LoHaConfig(r=4, target_modules=["b", "wide.0", "wide.2"], init_weights=False))
    model.set_adapter(["l", "h"])
    return model


def test_mixed_model_merges_into_streamed_layers_match_the_resident_model(offload_sim):
    """Into dense streamed weights peft's writes through .data land in the host copies the
    layers stream from: merge_adapter(), unmerge_adapter() and merge_and_unload() of a
    mixed model compute what the resident mixed model does."""
    ref, model = _mixed(), _mixed()
    handle = offload_sim(model, exclude=["*lora_*", "*hada_*"])
    assert any(name.endswith("wide.0.base_layer.base_layer") for name in handle.layers)
    x = torch.randn(3, 64)
    with torch.no_grad():
        for what in ("merged", "unmerged"):
            for m in (ref, model):
                m.merge_adapter() if what == "merged" else m.unmerge_adapter()
            assert torch.equal(model(x), ref(x)), what
        merged, ref_merged = model.merge_and_unload(), ref.merge_and_unload()
        assert torch.equal(merged(x), ref_merged(x))


def test_mixed_model_merge_and_unload_into_a_quantized_base_is_refused_before_any_layer_is_written(offload_sim):
    """PeftMixedModel's merge_and_unload() runs no pre-merge check: it merged and unwrapped
    a (dense), then b (a quantized layer the budget keeps resident: its dense tensor took
    the merge), and stopped at wide.0 (streamed, packed) with an error about an in-place
    add_(): the model half merged and half unwrapped, disable_adapter() no longer gave the
    base. Now it is refused before any layer is written, as LoRA's merges are, naming the
    layer, the adapter and what to do; after detach() the merge works."""
    model = _mixed()
    handle = offload_sim(model, exclude=["*lora_*", "*hada_*"], quantize={"*.a.base_layer": None, "*": "int8"},
                         budget="800KiB")
    base = model.base_model.model
    assert not base.b.base_layer.base_layer.weight.is_meta and base.wide[0].base_layer.base_layer.weight.is_meta
    x = torch.randn(3, 64)
    with torch.no_grad():
        with_adapters = model(x)
        with model.disable_adapter():
            without = model(x)
    modules = [name for name, _ in model.named_modules()]
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    for merge in (model.merge_and_unload, lambda: model.merge_and_unload(adapter_names=["h"]),
                  model.merge_adapter):
        with pytest.raises(LayerstreamError,
                           match=r"quantized layer 'base_model\.model\.b\.base_layer\.base_layer' \(kept resident by "
                                 r"the budget\).*cannot write adapter 'h'.*nothing was merged.*Merge before "
                                 r"offload\(\).*handle\.detach\(\) first"):
            merge()
        assert [name for name, _ in model.named_modules()] == modules
        assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters() if not p.is_meta)
        with torch.no_grad():
            assert torch.equal(model(x), with_adapters)
            with model.disable_adapter():
                assert torch.equal(model(x), without)
    handle.detach()
    merged = model.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(x), with_adapters, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:Unsupported layer type")  # peft's, for the norm
def test_ln_tuning_merges_over_a_quantized_base_compute_the_tuned_layers(offload_sim):
    """LN tuning's adapter is a tuned copy of its layer (here Linears as well as a norm), and
    its merge swaps the copy in for the base layer, writing no weight. merge_adapter() over
    a quantized base was refused (taken for a write into it) while merge_and_unload() of the
    same went through. Both now compute the tuned layers; unmerge_adapter() and
    disable_adapter() give back the adapter's and the base's numbers."""
    torch.manual_seed(0)
    model = peft.get_peft_model(_SmallThenWide(), peft.LNTuningConfig(target_modules=["a", "norm", "b", "wide.0"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "ln_tuning_layers" in n:
                p.add_(0.1 * torch.randn_like(p))
    handle = offload_sim(model, quantize={"*ln_tuning_layers*": None, "*.a.base_layer": None, "*": "int8"},
                         budget="800KiB")
    base = model.base_model.model
    assert not base.b.base_layer.weight.is_meta and base.wide[0].base_layer.weight.is_meta  # resident, streamed
    x = torch.randn(3, 64)
    with torch.no_grad():
        with_adapter = model(x)
        with model.disable_adapter():
            without = model(x)
        assert not torch.equal(with_adapter, without)
        model.merge_adapter()
        assert base.b.merged and torch.equal(model(x), with_adapter)
        model.unmerge_adapter()
        assert torch.equal(model(x), with_adapter)
        with model.disable_adapter():
            assert torch.equal(model(x), without)
        merged = model.merge_and_unload()
        assert torch.equal(merged(x), with_adapter)
    handle.detach()
    with torch.no_grad():
        assert torch.equal(merged(x), with_adapter)


def _diffusers_model():
    """_SmallThenWide as a diffusers model with a LoRA on a, b and wide.0 added through
    diffusers' PEFT integration (add_adapter), not zero at the start."""
    diffusers = pytest.importorskip("diffusers")
    from diffusers.loaders.peft import PeftAdapterMixin

    class Model(diffusers.ModelMixin, PeftAdapterMixin):
        def __init__(self):
            super().__init__()
            self.a, self.norm, self.b = nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64)
            self.wide = nn.ModuleList(nn.Linear(64, 1024) for _ in range(4))

        forward = _SmallThenWide.forward

    torch.manual_seed(0)
    model = Model()
    model.add_adapter(peft.LoraConfig(r=4, target_modules=["a", "b", "wide.0"], init_lora_weights=False))
    return model


def _pipeline(**components):
    """A diffusers pipeline's LoRA loader (LoraBaseMixin) over `components`."""
    from diffusers.loaders.lora_base import LoraBaseMixin

    pipe = type("Pipe", (LoraBaseMixin,), {"_lora_loadable_modules": list(components)})()
    for name, model in components.items():
        setattr(pipe, name, model)
    return pipe


_FUSES = {
    "model": lambda model, other: model.fuse_lora(),
    "model, lora_scale": lambda model, other: model.fuse_lora(lora_scale=0.5),  # scales each layer first
    "model, adapter_names": lambda model, other: model.fuse_lora(adapter_names=["default"]),
    "text encoder": lambda model, other: __import__("diffusers").loaders.lora_base.fuse_text_encoder_lora(model),
    "pipeline": lambda model, other: _pipeline(unet=other, transformer=model).fuse_lora(
        components=["unet", "transformer"]),
}


@pytest.mark.parametrize("fuse", list(_FUSES))
def test_diffusers_fuse_lora_into_a_quantized_base_is_refused_before_any_layer_is_written(offload_sim, fuse):
    """diffusers' fuses (a model's fuse_lora(), fuse_text_encoder_lora(), a pipeline's
    fuse_lora() over its components) call each peft layer's merge() in turn, never peft's
    pre-merge check: over a quantized base they fused a (dense) and b (quantized, kept
    resident by the budget: its dense tensor took the merge), then wide.0 (streamed,
    packed) refused: the model half fused (the pipeline's unet before it fused whole).
    Now each is refused before any layer (or component) is written, as peft's merges are,
    saying what to do; after detach() the fuse works."""
    other = _diffusers_model()  # the pipeline's other component, resident
    model = _diffusers_model()
    handle = offload_sim(model, exclude=["*lora_*"], quantize={"a.base_layer": None, "*": "int8"}, budget="800KiB")
    assert not model.b.base_layer.weight.is_meta and model.wide[0].base_layer.weight.is_meta  # resident, streamed
    x = torch.randn(3, 64)
    with torch.no_grad():
        with_adapter, other_out = model(x), other(x)
    weights = {(id(m), n): p.detach().clone() for m in (model, other) for n, p in m.named_parameters()
               if not p.is_meta}
    with pytest.raises(LayerstreamError, match=r"quantized layer 'b\.base_layer' \(kept resident by the budget\).*"
                                               r"diffusers' fuse_lora\(\) cannot write adapter 'default'.*nothing "
                                               r"was fused.*Fuse before offload\(\).*handle\.detach\(\) first"):
        _FUSES[fuse](model, other)
    assert all(torch.equal(p, weights[id(m), n]) for m in (model, other) for n, p in m.named_parameters()
               if not p.is_meta)
    assert not any(getattr(m, "merged", False) for mm in (model, other) for m in mm.modules())
    with torch.no_grad():
        assert torch.equal(model(x), with_adapter) and torch.equal(other(x), other_out)
    handle.detach()
    _FUSES[fuse](model, other)
    with torch.no_grad():
        assert model.b.merged and model.wide[0].merged
        want = with_adapter if fuse != "model, lora_scale" else None
        if want is not None:
            torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


def test_diffusers_fuse_lora_into_a_streamed_quantized_layer_says_to_fuse_before_offload(offload_sim):
    """The first layer the fuse writes streamed (packed): the refusal names it and says what to do."""
    model = _diffusers_model()
    offload_sim(model, exclude=["*lora_*"], quantize="int8", budget="680KiB")
    assert model.a.base_layer.weight.is_meta
    with pytest.raises(LayerstreamError, match=r"quantized streamed layer 'a\.base_layer'.*diffusers' fuse_lora\(\) "
                                               r"cannot write adapter 'default'.*nothing was fused.*detach\(\) first"
                                               r".*Or: Fuse before offload\(\)"):
        model.fuse_lora()
    assert not any(getattr(m, "merged", False) for m in model.modules())


@pytest.mark.parametrize("fuse", list(_FUSES))
def test_diffusers_fuse_and_unfuse_over_dense_streamed_layers_match_the_resident_model(offload_sim, fuse):
    """Into dense streamed weights diffusers' fuses write through peft's merge() into the host
    copies the layers stream from: fused, then unfused (unfuse_lora()), each call equals the
    resident model's."""
    ref, model = _diffusers_model(), _diffusers_model()
    ref_other, other = _diffusers_model(), _diffusers_model()
    handle = offload_sim(model, exclude=["*lora_*"], budget="800KiB")
    assert any(name.startswith("wide.0") for name in handle.layers)
    x = torch.randn(3, 64)
    with torch.no_grad():
        _FUSES[fuse](ref, ref_other)
        _FUSES[fuse](model, other)
        assert model.wide[0].merged and torch.equal(model(x), ref(x))
        ref.unfuse_lora()
        model.unfuse_lora()
        assert not model.wide[0].merged and torch.equal(model(x), ref(x))


def _lora_merged(mixed: bool = False):
    """_SmallThenWide with a LoRA on a, b and wide.0 (with mixed, _mixed()'s LoRA and LoHa),
    merged into its weights (before offload())."""
    if mixed:
        model = _mixed()
    else:
        torch.manual_seed(0)
        model = peft.get_peft_model(_SmallThenWide(), peft.LoraConfig(
            r=4, target_modules=["a", "b", "wide.0"], init_lora_weights=False))
    model.merge_adapter()
    return model


def _merged_flags(*models):
    return [(m.merged, list(m.merged_adapters)) for mm in models for m in mm.modules() if hasattr(m, "merged_adapters")]


_UNFUSES = {
    "model": lambda model, other: model.unfuse_lora(),
    "text encoder": lambda model, other: __import__("diffusers").loaders.lora_base.unfuse_text_encoder_lora(model),
    "pipeline": lambda model, other: _pipeline(unet=other, transformer=model).unfuse_lora(
        components=["unet", "transformer"]),
}


@pytest.mark.parametrize("unmerge", ["peft", "peft mixed"] + [f"diffusers {u}" for u in _UNFUSES])
def test_unmerge_of_adapters_merged_before_offload_into_a_quantized_base_is_refused_before_any_layer_is_written(
        offload_sim, unmerge):
    """An adapter merged (peft's merge_adapter()) or fused (diffusers' fuse_lora()) before an
    offload() that quantized its base: peft's unmerge_adapter() and diffusers' unfuses call
    each layer's unmerge() in turn, which pops the layer's merged flag, then writes: they
    unmerged a (dense) and b (quantized, kept resident by the budget), then wide.0 (streamed,
    packed) refused with its flag popped: the model half unmerged, flagged unmerged
    throughout. Now refused before any layer is written, flags kept, saying what to do;
    after detach() the unmerge works."""
    other = _diffusers_model() if unmerge.startswith("diffusers") else None  # the pipeline's other one, resident
    if other is not None:
        model = _diffusers_model()
        for m in (model, other):
            m.fuse_lora()
        prefix, who, what = "", "diffusers' unfuse_lora", r"unfused.*unfuse_lora\(\), then offload\(\) again.*" \
                                                           r"unload_lora_weights\(\) before offload\(\)"
        call = lambda: _UNFUSES[unmerge.split(" ", 1)[1]](model, other)  # noqa: E731
    else:
        model, other = _lora_merged(mixed=unmerge == "peft mixed"), nn.Linear(64, 1)
        prefix, who, what = r"base_model\.model\.", "peft's unmerge_adapter", \
            r"unmerged.*unmerge_adapter\(\), then offload\(\) again.*merge_and_unload\(\) before offload\(\)"
        call = lambda: model.unmerge_adapter()  # noqa: E731 (looked up after offload(), which wraps it)
    handle = offload_sim(model, exclude=["*lora_*", "*hada_*"], quantize={"*a.base_layer": None, "*": "int8"},
                         budget="800KiB")
    layer = model.base_model.model if prefix else model
    b, wide = layer.b.base_layer, layer.wide[0].base_layer
    if unmerge == "peft mixed":
        b, wide = b.base_layer, wide.base_layer
    assert not b.weight.is_meta and wide.weight.is_meta  # resident, streamed
    x = torch.randn(3, 64)
    with torch.no_grad():
        merged, other_out = model(x), other(x)
    flags = _merged_flags(model, other)
    weights = {(id(m), n): p.detach().clone() for m in (model, other) for n, p in m.named_parameters()
               if not p.is_meta}
    with pytest.raises(LayerstreamError, match=rf"quantized layer '{prefix}b\.base_layer.*' \(kept resident by the "
                                               rf"budget\).*{who}\(\) cannot take adapter '.*', merged before "
                                               rf"offload\(\),.*nothing was {what}"):
        call()
    assert _merged_flags(model, other) == flags and all(flag for flag, _ in flags)
    assert all(torch.equal(p, weights[id(m), n]) for m in (model, other) for n, p in m.named_parameters()
               if not p.is_meta)
    with torch.no_grad():
        assert torch.equal(model(x), merged) and torch.equal(other(x), other_out)
    handle.detach()
    call()
    assert not any(flag for flag, _ in _merged_flags(model))


def test_unmerge_adapter_out_of_a_streamed_quantized_layer_says_what_to_do(offload_sim):
    """The first layer the unmerge writes streamed (packed): the refusal names it and says what to do."""
    model = _lora_merged()
    offload_sim(model, exclude=["*lora_*"], quantize="int8", budget="680KiB")
    assert model.base_model.model.a.base_layer.weight.is_meta
    with pytest.raises(LayerstreamError, match=r"streamed layer 'base_model\.model\.a\.base_layer' is held quantized.*"
                                               r"unmerge_adapter\(\) cannot take adapter 'default'.*nothing was "
                                               r"unmerged.*handle\.detach\(\) first.*then offload\(\) again"):
        model.unmerge_adapter()
    assert all(flag for flag, _ in _merged_flags(model))


@pytest.mark.parametrize("unmerge", ["peft", "peft mixed", "diffusers"])
def test_unmerge_of_adapters_merged_before_offload_over_dense_streamed_layers_matches_the_resident_model(
        offload_sim, unmerge):
    """Merged (fused) before offload(), dense streamed: unmerge_adapter() (unfuse_lora()) writes
    into the host copies the layers stream from, and computes what the resident model does."""
    if unmerge == "diffusers":
        ref, model = _diffusers_model(), _diffusers_model()
        for m in (ref, model):
            m.fuse_lora()
        call = lambda m: m.unfuse_lora()  # noqa: E731
    else:
        ref, model = _lora_merged(unmerge == "peft mixed"), _lora_merged(unmerge == "peft mixed")
        call = lambda m: m.unmerge_adapter()  # noqa: E731
    handle = offload_sim(model, exclude=["*lora_*", "*hada_*"], budget="800KiB")
    assert any(".wide.0" in "." + name for name in handle.layers)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
        call(ref)
        call(model)
        assert not any(flag for flag, _ in _merged_flags(model)) and torch.equal(model(x), ref(x))
