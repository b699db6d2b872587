"""layerstream.compat: the original system's API with its observable behaviour."""
import copy

import pytest
import torch
import torch.nn as nn

from layerstream import LayerstreamError
from layerstream.compat import ConvLayerMemoryManager, LinearLayerMemoryManager, MemoryManager


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 64), nn.Conv1d(1, 1, 3),
                         nn.Linear(62, 4))


def test_attach_tags_params_and_matches_reference():
    m = make_model()
    ref = copy.deepcopy(m)
    mgr = MemoryManager.attach(m, torch.device("cpu"))
    assert m._memory_manager is mgr
    for layer in (m[0], m[2], m[3], m[4]):
        assert hasattr(layer, "_layer_memory_manager")
        assert layer._memory_management_device == torch.device("cpu")
        assert all(getattr(p, "_is_memory_managed", False) for p in layer.parameters())
    x = torch.randn(2, 1, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, yr = m(x), ref(xr)
    assert torch.equal(y, yr)
    y.square().sum().backward()
    yr.square().sum().backward()
    assert torch.equal(x.grad, xr.grad)
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert mgr.engine.ordering_errors() == []


def test_offload_percent_picks_largest_layers_deterministically():
    m = make_model()
    # sizes (params): [0]=544, [2]=2112, [3]=4, [4]=252; total 2912
    MemoryManager.attach(m, "cpu", offload_percent=0.5, ignore_modules=[m[4]])
    picked = [i for i, layer in enumerate(m) if hasattr(layer, "_layer_memory_manager")]
    assert picked == [2]  # the largest layer alone covers half of the bytes
    m2 = make_model()
    MemoryManager.attach(m2, "cpu", offload_percent=0.5, ignore_modules=[m2[4]])
    assert [i for i, layer in enumerate(m2) if hasattr(layer, "_layer_memory_manager")] == picked
    m3 = make_model()
    MemoryManager.attach(m3, "cpu", offload_percent=0.0)
    assert not any(hasattr(layer, "_layer_memory_manager") for layer in m3)


def test_extra_call_arguments_fall_back_to_original_forward():
    """A streamed layer called with extra arguments runs the module's own forward
    (nn.Linear's refuses them, as the resident layer does). A subclass whose forward
    takes them (and may compute more) is not streamed at all: it stays resident, and
    attaching it alone is refused rather than dropping its forward."""
    class Custom(nn.Linear):
        def forward(self, x, scale=1.0):
            return super().forward(x) * scale

    m = nn.Linear(4, 4)
    mgr = MemoryManager(m, "cpu")
    LinearLayerMemoryManager.attach(m, mgr)
    x = torch.randn(2, 4)
    with pytest.raises(TypeError):
        m(x, 3.0)
    model = nn.Sequential(Custom(4, 4))
    with pytest.warns(RuntimeWarning, match="own forward"):
        MemoryManager.attach(model, "cpu")
    plain = nn.functional.linear(x, model[0].weight, model[0].bias)
    assert not hasattr(model[0], "_layer_memory_manager")
    assert torch.equal(model[0](x, scale=3.0), 3.0 * plain)
    with pytest.raises(LayerstreamError, match="own forward"):
        LinearLayerMemoryManager.attach(Custom(4, 4), mgr)


def test_detach_hands_back_layers_attached_one_by_one():
    m = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(1, 1, 3))
    ref = copy.deepcopy(m)
    mgr = MemoryManager(m, "cpu")
    LinearLayerMemoryManager.attach(m[0], mgr)
    ConvLayerMemoryManager.attach(m[1], mgr)
    MemoryManager.detach(m)
    assert mgr.engine is None
    for layer, r in zip(m, ref):
        assert not {"forward", "_layer_memory_manager", "_apply"} & set(layer.__dict__)
        assert all(torch.equal(p, q) for p, q in zip(layer.parameters(), r.parameters()))
    x = torch.randn(2, 1, 4)
    assert torch.equal(m(x), ref(x))


def test_detach_of_a_parent_hands_back_a_child_given_to_attach_whole():
    """MemoryManager.detach(parent) of a model whose child was given to attach(): the
    child's layers were released but its manager, to() and _apply stayed, so child.to()
    raised and attach(child) again returned the dead manager (nothing streamed)."""
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    MemoryManager.attach(model[0], "cpu")
    MemoryManager.detach(model)
    assert not {"to", "_apply", "_memory_manager"} & set(model[0].__dict__)
    model[0].to("cpu")
    again = MemoryManager.attach(model[0], "cpu")
    assert again.engine is not None and all("_layer_memory_manager" in layer.__dict__ for layer in model[0])
    x = torch.randn(2, 4)
    assert torch.equal(model(x), ref(x))
    MemoryManager.detach(model[0])


def test_a_wrapper_installed_after_attach_calls_the_layers_own_forward_after_detach():
    """A forward wrapper put on a streamed layer after attach (not the org_forward style
    compat repairs) kept calling the streamed forward, whose engine detach() released:
    AttributeError on 'NoneType'. It now falls through to the layer's own forward."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4))
    x = torch.randn(2, 4)
    want = m(x) * 2
    MemoryManager.attach(m, "cpu")
    streamed = m[0].forward
    m[0].forward = lambda t: streamed(t) * 2
    assert torch.equal(m(x), want)
    MemoryManager.detach(m)
    assert torch.equal(m(x), want)


def test_a_model_whose_weights_are_still_in_their_file_is_refused_naming_offload(tmp_path):
    """attach() of a model loaded by layerstream.load_safetensors() (weights left in the
    file) failed with torch's "Cannot copy out of meta tensor" after a misleading warning."""
    import layerstream
    from safetensors.torch import save_file
    path = tmp_path / "m.safetensors"
    save_file(nn.Sequential(nn.Linear(16, 4)).state_dict(), str(path))
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(16, 4))
    layerstream.load_safetensors(m, str(path))
    with pytest.raises(LayerstreamError, match=r"still in their checkpoint file .* layerstream.offload\(model"):
        MemoryManager.attach(m, "cpu")
    assert "_memory_manager" not in m.__dict__


class _NormThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up = nn.LayerNorm(4), nn.Linear(4, 4)

    def forward(self, h):
        return self.up(self.norm(h))


def test_a_refused_conversion_of_a_part_of_the_model_changes_nothing():
    """model[0].half() after attach: the block's LayerNorm was fp16 before its streamed
    Linear refused, and every forward then failed (mixed dtype). Checked first now, also
    after model.to(dtype) attached the layers anew; detach() removes the checks."""
    model = nn.Sequential(_NormThenLinear(), _NormThenLinear())
    ref = copy.deepcopy(model)
    MemoryManager.attach(model, "cpu")
    x = torch.randn(2, 4)
    for convert in (lambda m: m[0].half(), lambda m: m.to(torch.bfloat16) and m[1].half()):
        with pytest.raises(LayerstreamError, match="keeps its weights in host memory"):
            convert(model)
        assert len({p.dtype for p in model.parameters()}) == 1
    model.to(torch.float32)
    ref.to(torch.bfloat16).to(torch.float32)  # the round trip model.to(torch.bfloat16) made
    assert torch.equal(model(x), ref(x))
    MemoryManager.detach(model)
    assert "_apply" not in model[0].__dict__
    model[0].half()
    assert all(p.dtype == torch.float16 for p in model[0].parameters())


def test_second_attach_is_a_no_op():
    m = nn.Linear(4, 4)
    mgr = MemoryManager(m, "cpu")
    first = LinearLayerMemoryManager.attach(m, mgr)
    assert LinearLayerMemoryManager.attach(m, mgr) is first
    assert mgr.engine.num_layers == 1


def test_attach_of_a_table_that_cannot_stream_says_why():
    """BaseLayerMemoryManager.attach() of a non-floating nn.Embedding raised KeyError: compat's
    sentences lacked offload()'s table reasons. It says why now, offload()'s words."""
    from layerstream.compat import BaseLayerMemoryManager
    table = nn.Embedding(8, 4).to(torch.complex64)
    with pytest.raises(LayerstreamError, match=r"cannot stream: a streamed lookup reads float32"):
        BaseLayerMemoryManager.attach(table, MemoryManager(table, "cpu"), name="emb")


def test_ara_lora_ref_gets_its_org_forward_replaced():
    base = nn.Linear(4, 4)

    class Ara(nn.Module):
        def __init__(self):
            super().__init__()
            self.org_forward = base.forward

        def forward(self, x):
            return self.org_forward(x) * 2

    ara = Ara()
    base.ara_lora_ref = lambda: ara
    mgr = MemoryManager(base, "cpu")
    LinearLayerMemoryManager.attach(base, mgr)
    assert "forward" not in base.__dict__  # the module's own forward is untouched
    x = torch.ones(1, 4)
    assert torch.allclose(ara(x), 2 * nn.functional.linear(x, base.weight, base.bias))
    assert mgr.stats()["acquires"] == 1  # it went through the streamed path


@pytest.mark.parametrize("mode", ["zeros", "reflect"])
def test_conv_manager_streams_conv2d(mode):
    conv = nn.Conv2d(3, 8, 3, padding=1, padding_mode=mode)  # reflect: the input is padded first
    ref = copy.deepcopy(conv)
    mgr = MemoryManager(conv, "cpu")
    ConvLayerMemoryManager.attach(conv, mgr)
    x = torch.randn(1, 3, 8, 8)
    assert torch.equal(conv(x), ref(x))
    assert mgr.stats()["h2d_bytes"] > 0


def test_unsupported_device_is_a_clear_error():
    with pytest.raises(ValueError, match="unsupported device"):
        MemoryManager(nn.Linear(2, 2), "meta")


def test_peft_lora_on_a_weight_parameter_keeps_its_layer_and_adapters_resident():
    """peft's LoRA on a Linear's weight (LoraConfig(target_parameters=...)) parametrizes
    the weight during each call and reads its adapters' weights directly: attach() leaves
    that Linear and the adapters' Linear modules resident (the wrapped one with a
    warning), streams the rest, and the outputs and adapter gradients equal the
    resident model's."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=[], target_parameters=["0.weight"],
                                                      init_lora_weights=False))
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match="computed"):
        MemoryManager.attach(model, "cpu")
    managed = [n for n, m in model.named_modules() if hasattr(m, "_layer_memory_manager")]
    assert managed == ["base_model.model.2"]
    x = torch.randn(3, 16)
    y, yr = model(x), ref(x)
    assert torch.equal(y, yr)
    y.square().sum().backward()
    yr.square().sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if p.requires_grad:
            assert torch.equal(p.grad, q.grad), n


class _Float64Head(nn.Module):
    """A float32 body and a float64 head (e.g. a precision-sensitive output layer)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(16, 32), nn.Linear(32, 8).double()

    def forward(self, x):
        return self.head(torch.relu(self.body(x)).double())


def test_a_float64_layer_stays_resident_under_attach_as_under_offload():
    """attach() used to stream a float64 Linear, which then refused its input at every
    call ("got a Double input"); offload() keeps such layers resident (_discovery's
    _activation_dtype). attach now asks the same rule: the float64 layer stays
    resident with a warning, the float32 one streams, and output and gradients equal
    the resident model's. Attaching that layer alone is refused, naming why."""
    model = _Float64Head()
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match=r"cannot stream stay resident .* float64 or complex"):
        mgr = MemoryManager.attach(model, "cpu")
    assert hasattr(model.body, "_layer_memory_manager") and not hasattr(model.head, "_layer_memory_manager")
    # The original's list of what attach left resident holds the layers that cannot stream too.
    assert any(m is model.head for m in mgr.unmanaged_modules)
    assert not any(m is model.body for m in mgr.unmanaged_modules)
    x = torch.randn(3, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    y, yr = model(x), ref(xr)
    assert y.dtype == torch.float64 and torch.equal(y, yr)
    y.square().sum().backward()
    yr.square().sum().backward()
    assert torch.equal(x.grad, xr.grad)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    assert mgr.stats()["acquires"] > 0
    MemoryManager.detach(model)
    with pytest.raises(LayerstreamError, match=r"layer 'head' cannot stream: its weight is float64 or complex"):
        LinearLayerMemoryManager.attach(model.head, MemoryManager(model.head, "cpu"), "head")


def test_converting_an_attached_model_to_float64_is_refused_before_anything_changes():
    """model.to(torch.float64) after attach used to stream the layers again in float64,
    which then refused their input at every call. Refused now (attach's rule), the
    model as it was: it still runs, equal to the resident model."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    ref = copy.deepcopy(model)
    MemoryManager.attach(model, "cpu")
    with pytest.raises(LayerstreamError, match=r"model.to\(torch.float64\): layer '[02]' streams, and streamed "
                                               r"layers do not compute in torch.float64 .* nothing was changed"):
        model.to(torch.float64)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x = torch.randn(3, 16)
    assert torch.equal(model(x), ref(x))
    MemoryManager.detach(model)
