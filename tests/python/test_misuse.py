"""Misuse gives a clear error and leaves the model as it was: never garbage, never a
silent half-change. Each case checks the error's text and the model afterwards."""
from __future__ import annotations

import warnings
import copy
import functools
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import layerstream
from conftest import gguf_random_blocks
from layerstream import GgufWeight, LayerstreamError


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def _state(model):
    """Everything a misuse could change: each tensor's class, device, dtype, strides,
    storage address and values (packed stand-ins: metadata only)."""
    out = {}
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        values = None if t.is_meta else t.detach().clone()
        out[n] = (type(t), t.device, t.dtype, t.shape, t.stride(), t.requires_grad,
                  None if t.is_meta else t.untyped_storage().data_ptr(), values)
    return out


def _assert_unchanged(before, model):
    after = _state(model)
    assert after.keys() == before.keys()
    for n in before:
        *meta_b, vb = before[n]
        *meta_a, va = after[n]
        assert meta_a == meta_b, n
        assert (va is None) == (vb is None) and (va is None or torch.equal(va, vb)), n


# ---------------------------------------------------------------- packed stand-ins

@pytest.mark.parametrize("use", [
    lambda x, w: x @ w.t(),
    lambda x, w: x @ w.T,
    lambda x, w: F.linear(x, w),
    lambda x, w: torch.matmul(x, w.t()),
    lambda x, w: w + 1,
    lambda x, w: w.sum(),
    lambda x, w: torch.cat([w, w]),
    lambda x, w: w.clone(),
], ids=["matmul-t", "matmul-T", "F.linear", "torch.matmul", "add", "sum", "cat", "clone"])
def test_quantized_stand_in_refuses_computation(use):
    model = _mlp().requires_grad_(False)
    handle = layerstream.offload(model, device="sim", quantize="int8")
    x = torch.randn(4, 32)
    want = model(x)
    before = _state(model)
    with pytest.raises(LayerstreamError, match=r"packed in layerstream's host store.*computing with it.*"
                                               r"run the module itself"):
        use(x, model[0].weight)
    _assert_unchanged(before, model)
    assert torch.equal(model(x), want)  # the module itself still computes, from the packed weight
    # Metadata stays readable (optimizers, peft and printing rely on it).
    w = model[0].weight
    assert (w.shape, w.dtype, w.numel(), w.dim(), w.requires_grad) == ((64, 32), torch.float32, 2048, 2, False)
    handle.detach()


def _gguf_linear():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 8))
    w = GgufWeight((8, 32), torch.float32, "q8_0", gguf_random_blocks("Q8_0", 8, 32), "0.weight")
    model[0].weight = w
    return model


@pytest.mark.parametrize("use", [lambda x, w: x @ w.t(), lambda x, w: F.linear(x, w), lambda x, w: w * 2],
                         ids=["matmul", "F.linear", "mul"])
def test_gguf_stand_in_refuses_computation(use):
    model = _gguf_linear()
    before = _state(model)
    with pytest.raises(LayerstreamError, match=r"GGUF q8_0 bytes.*computing with it.*layerstream.offload"):
        use(torch.randn(2, 32), model[0].weight)
    _assert_unchanged(before, model)


def test_trainable_gguf_weight_is_refused_by_offload():
    model = _gguf_linear()
    model[0].weight.requires_grad_(True)
    before = _state(model)
    forward = model[0].forward
    with pytest.raises(LayerstreamError, match=r"1 GGUF weight\(s\) require grad: 0.weight.*frozen.*"
                                               r"requires_grad_\(False\)"):
        layerstream.offload(model, device="sim")
    _assert_unchanged(before, model)
    assert "forward" not in model[0].__dict__ and model[0].forward == forward


# ---------------------------------------------------------------- conversions

def test_move_to_meta_after_offload_is_refused_before_anything_changes():
    model = nn.Sequential(_mlp(), nn.LayerNorm(32))  # the LayerNorm stays resident
    handle = layerstream.offload(model, device="sim", exclude=["1"])
    x = torch.randn(4, 32)
    want = model(x)
    before = _state(model)
    for convert in (lambda m: m.to("meta"), lambda m: m.to_empty(device="meta")):
        with pytest.raises(LayerstreamError, match="would move them elsewhere or change their dtype"):
            convert(model)
        _assert_unchanged(before, model)  # the resident LayerNorm too: nothing went to meta
    assert torch.equal(model(x), want)
    handle.detach()


class _NormThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, h):
        return self.up(self.norm(h))


def test_a_refused_conversion_of_a_part_of_the_model_changes_nothing_and_a_copy_of_it_is_plain():
    """model[0].half() on a block that holds a streamed Linear after a resident LayerNorm:
    nn.Module._apply converted the LayerNorm to fp16 before the Linear refused, and every
    later forward failed ("mixed dtype"). Each module between the model and its streamed
    layers checks them first now, as the model itself does. A deep copy of such a block
    is an ordinary module (its conversions are not checked), and detach() removes the
    checks."""
    model = nn.Sequential(_NormThenLinear(), _NormThenLinear())
    handle = layerstream.offload(model, device="sim")
    x = torch.randn(4, 32)
    want = model(x)
    before = _state(model)
    for convert in (lambda m: m.half(), lambda m: m.to(torch.bfloat16)):
        with pytest.raises(LayerstreamError, match="keeps its weights in host memory"):
            convert(model[0])
        _assert_unchanged(before, model)
    assert torch.equal(model(x), want)
    copied = copy.deepcopy(model[0]).half()
    assert all(p.dtype == torch.float16 for p in copied.parameters())
    handle.detach()
    assert "_apply" not in model[0].__dict__
    model[0].half()  # an ordinary module again
    assert all(p.dtype == torch.float16 for p in model[0].parameters())


# ---------------------------------------------------------------- modes and handles

def test_offload_inside_inference_mode_is_refused():
    model = _mlp()
    before = _state(model)
    with torch.inference_mode():
        with pytest.raises(LayerstreamError, match=r"inside torch.inference_mode\(\).*outside inference_mode"):
            layerstream.offload(model, device="sim")
    _assert_unchanged(before, model)
    # Outside it, offload() works, and inference mode afterwards is fine.
    handle = layerstream.offload(model, device="sim")
    with torch.inference_mode():
        out = model(torch.randn(2, 32))
    assert out.shape == (2, 32)
    handle.detach()


def test_compat_attach_refuses_an_offloaded_model():
    from layerstream.compat import MemoryManager
    model = _mlp()
    handle = layerstream.offload(model, device="sim")
    x = torch.randn(4, 32)
    model(x).sum().backward()
    steps = handle.stats()["steps"]
    with pytest.raises(LayerstreamError, match=r"already offloaded by layerstream.offload\(\).*handle.detach\(\)"):
        MemoryManager.attach(model, torch.device("cpu"))
    assert not hasattr(model, "_memory_manager")
    model(x).sum().backward()  # the handle still streams the model
    assert handle.stats()["steps"] > steps
    handle.detach()


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_diffusers_group_offloading_is_refused_before_anything_changes(offload_type):
    """diffusers' group offloading moves the weights between host and device in its own hooks,
    the tensors layerstream would hold and stream: offload() says to use one of the two, and
    the model keeps computing under diffusers' hooks."""
    from diffusers.hooks import apply_group_offloading
    model = nn.Sequential(_mlp(), _mlp(1))
    cpu = torch.device("cpu")
    apply_group_offloading(model, onload_device=cpu, offload_device=cpu, offload_type=offload_type,
                           num_blocks_per_group=1)
    x = torch.randn(4, 32)
    expected = model(x)
    before = _state(model)
    with pytest.raises(LayerstreamError, match=r"is under diffusers' group offloading .*load the model without "
                                               r"enable_group_offload\(\) and call offload\(\)"):
        layerstream.offload(model, device="sim")
    _assert_unchanged(before, model)
    assert not any(hasattr(m, "_layerstream_handle") for m in model.modules())
    assert torch.equal(model(x), expected)


# ---------------------------------------------------------------- backward errors

def test_second_backward_gives_torchs_own_message():
    torch.manual_seed(0)
    for model, x, kw in [(_mlp(), torch.randn(4, 32, requires_grad=True), {}),
                         (nn.MultiheadAttention(32, 4), torch.randn(5, 2, 32, requires_grad=True), {})]:
        handle = layerstream.offload(model, device="sim", **kw)
        out = model(x) if isinstance(model, nn.Sequential) else model(x, x, x)[0]
        y = out.sum()
        y.backward()
        with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time") as err:
            y.backward()
        assert "modified in place" not in str(err.value)
        handle.detach()


def test_in_place_write_before_backward_names_the_layer():
    model = _mlp()
    handle = layerstream.offload(model, device="sim")
    x = torch.randn(4, 32, requires_grad=True)
    y = model(x).sum()
    with torch.no_grad():
        model[2].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    handle.detach()


# ---------------------------------------------------------------- arguments

@pytest.mark.parametrize("kw,match", [
    (dict(budget=1e30), r"budget of 1e\+30 bytes is too large"),
    (dict(budget=2**70), r"budget of 1180591620717411303424 bytes is too large"),
    (dict(budget=float("nan")), r"budget must be a finite number"),
    (dict(budget=float("inf")), r"budget must be a finite number"),
    (dict(budget="0.5"), r"not a whole number of bytes.*'50%'.*0\.5"),
    (dict(budget=1.5), r"not a whole number of bytes"),
    (dict(budget=-1), r"budget must be >= 0"),
    (dict(budget="150%"), r"\(0, 100\]"),
    (dict(budget=[1]), r"budget must be a size in bytes"),
    (dict(prefetch=10**9), r"prefetch must be in \[0, 64\]"),
    (dict(prefetch=100), r"prefetch must be in \[0, 64\]"),
    (dict(prefetch=100, budget="1MiB"), r"prefetch must be in \[0, 64\]"),
    (dict(prefetch=2.5), r"prefetch must be an integer"),
    (dict(slots=0), r"slots must be in \[2, 66\]"),
    (dict(slots=10**20), r"slots must be in \[2, 66\]"),
    (dict(sim_link_gbps=float("nan")), r"sim_link_gbps must be a finite bandwidth"),
    (dict(sim_link_gbps=-1), r"sim_link_gbps must be a finite bandwidth"),
    (dict(sim_latency_us=float("inf")), r"sim_latency_us must be a finite latency"),
    (dict(host_budget="40%"), r"host_budget='40%': invalid size .*unknown unit"),
    (dict(pinned_budget="-1"), r"pinned_budget='-1': invalid size"),
    (dict(host_budget=2**70), r"host_budget=1180591620717411303424: expected a whole number of bytes"),
    (dict(pinned_budget=0.5), r"pinned_budget=0.5: expected a whole number of bytes"),
])
def test_bad_arguments_are_one_clear_error(kw, match):
    model = _mlp()
    before = _state(model)
    with pytest.raises(ValueError, match=match):
        layerstream.offload(model, device="sim", **kw)
    _assert_unchanged(before, model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_the_same_rules_in_cpp_and_python():
    """The engine's own options (C++ EngineOptions, what the C++ offload() takes)
    check with the same rules and messages."""
    for opts, match in [({"prefetch": 10**9}, r"prefetch must be in \[0, 64\]"),
                        ({"slots": 1}, r"slots must be in \[2, 66\]"),
                        ({"sim_h2d_gbps": float("nan")}, r"sim_h2d_gbps must be a finite bandwidth"),
                        ({"budget_bytes": -2}, r"budget_bytes must be -1")]:
        with pytest.raises(LayerstreamError, match=match):
            layerstream._C.Engine({"device": "sim", **opts})
    assert layerstream.parse_bytes("12GiB") == 12 * 2**30
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        layerstream.parse_bytes("0.5")


def test_a_budget_share_and_prefetch_64_work():
    model = _mlp()
    handle = layerstream.offload(model, device="sim", budget=0.5, prefetch=64)
    assert handle.stats()["budget_bytes"] == layerstream.SIM_DEVICE_MEMORY // 2
    handle.detach()


def test_an_include_or_groups_pattern_that_names_no_module_is_warned():
    """A typo in include= or groups= would stream the intended modules otherwise, or not at
    all: one warning names the patterns that matched nothing (exclude= patterns are often
    written for several architectures at once: none)."""
    model = _mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = layerstream.offload(model, device="sim", include=["0", "nothing*"], groups=["grup"],
                                     exclude=["lm_head"])
    texts = [str(w.message) for w in caught if "matches no module" in str(w.message) or "match no" in str(w.message)]
    assert len(texts) == 2, texts
    assert "offload(include=...): 'nothing*' matches no module name" in texts[0]
    assert "offload(groups=...): 'grup' matches no module name" in texts[1]
    assert {w.filename for w in caught if "matches no module" in str(w.message)} == {__file__}
    handle.detach()


def test_a_quantize_pattern_that_names_no_module_is_warned():
    """quantize={pattern: format} with a pattern that names no module (a typo, or a
    parameter's name such as "0.weight") quantized nothing, silently: the layers the user
    meant to pack streamed dense. Warned as include= and groups= patterns are, from the
    caller's line; the matching pattern still applies."""
    model = _mlp().requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = layerstream.offload(model, device="sim", quantize={"0.weight": "int8", "2": "int8"})
    texts = [w for w in caught if "quantize=" in str(w.message) and "no module" in str(w.message)]
    assert len(texts) == 1 and "offload(quantize=...): '0.weight' matches no module name" in str(texts[0].message)
    assert texts[0].filename == __file__
    assert handle.stats()["quantized_layers"] == 1  # "2" matched
    handle.detach()


def test_a_quantize_pattern_that_names_only_modules_not_streamed_is_warned():
    """quantize={"0": "int8"} with exclude=["0"] (or a pattern naming only a container,
    not the layers in it) quantized nothing, silently, while a pattern naming no module
    was warned of. Now warned too, from the caller's line; not a None pattern, nor one
    naming a module inside a tensor group (it goes with the group)."""
    model = nn.Sequential(_mlp(), nn.Linear(32, 32)).requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = layerstream.offload(model, device="sim", exclude=["0.0"],
                                     quantize={"0.0": "int8", "0": "nf4", "1": "int8", "0.2": None})
    texts = [w for w in caught if "does not stream" in str(w.message)]
    assert len(texts) == 1 and str(texts[0].message).startswith(
        "layerstream: offload(quantize=...): '0.0', '0' match only modules offload() does not stream (left out by "
        "include=/exclude=, or containers")
    assert texts[0].filename == __file__
    assert handle.stats()["quantized_layers"] == 1  # "1"
    handle.detach()
    attn = nn.MultiheadAttention(32, 2).requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = layerstream.offload(attn, device="sim", quantize={"out_proj": "int8", "*": "int8"})
    assert not [w for w in caught if "does not stream" in str(w.message)]
    handle.detach()



def test_a_large_rnn_is_said_to_stay_resident_not_sent_to_groups():
    """A large nn.LSTM/GRU/RNN was named in the warning that recommends
    offload(groups=...), which then refuses it (cached weight references). The warning
    says it stays resident instead, and recommends groups= only for the other modules;
    the model runs as the resident one."""
    class Attention(nn.Module):  # its own nn.Parameter projections: groups= streams it
        def __init__(self, d):
            super().__init__()
            self.qkv = nn.Parameter(torch.randn(3 * d, d) * 0.02)

        def forward(self, x):
            q, k, v = (x @ self.qkv.t()).chunk(3, -1)
            return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    class Net(nn.Module):
        def __init__(self, attention):
            super().__init__()
            self.inp, self.rnn, self.out = nn.Linear(16, 256), nn.LSTM(256, 256, batch_first=True), nn.Linear(256, 4)
            self.att = Attention(256) if attention else None

        def forward(self, x):
            h = self.rnn(self.inp(x))[0]
            return self.out(h if self.att is None else self.att(h))

    for attention in (False, True):
        torch.manual_seed(0)
        model = Net(attention)
        ref = copy.deepcopy(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = layerstream.offload(model, device="sim")
        said = [str(w.message) for w in caught if "of no kind layerstream streams" in str(w.message)]
        assert len(said) == 1, said
        assert "'rnn' holds an nn.LSTM/GRU/RNN, which stays resident" in said[0], said
        assert ("streams such modules whole" in said[0]) == attention, said
        x = torch.randn(2, 3, 16)
        assert torch.equal(model(x), ref(x))
        handle.detach()
        if attention:  # what the warning recommends works
            layerstream.offload(model, device="sim", groups=["att"]).detach()

# ---------------------------------------------------------------- shared storage

def test_parameters_viewing_one_flat_buffer_are_refused():
    model = _mlp()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    offset = 0
    for m in (model[0], model[2]):
        for k in ("weight", "bias"):
            p = m._parameters[k]
            m._parameters[k] = nn.Parameter(flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
    before = _state(model)
    with pytest.raises(LayerstreamError, match=r"parameter '0.weight' shares its memory with '0.bias'.*"
                                               r"flat buffer.*clone\(\)"):
        layerstream.offload(model, device="sim")
    _assert_unchanged(before, model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    # The fix the message names works.
    for p in model.parameters():
        p.data = p.data.clone()
    x = torch.randn(3, 32)
    want = copy.deepcopy(model)(x)
    handle = layerstream.offload(model, device="sim")
    assert torch.equal(model(x), want)
    handle.detach()


@pytest.mark.parametrize("case", ["flat-outside", "offset", "strided-slice", "group"])
def test_a_parameter_using_part_of_its_memory_is_refused(case):
    """A streamed parameter that is a view into a larger buffer held outside the model (a
    flat buffer, a master copy) used to be accepted: offload() moved it into host memory of
    its own, so writes to the buffer no longer reached the model, for good after detach().
    A strided slice (big[::2, ::2]) came back from detach() dense, not in its layout. Both
    are now refused before anything changes, naming the parameter and the fixes; each fix
    works, and a dense view of a whole buffer (W.t(), W.view(...)) still streams."""
    model = _mlp()
    groups = ["2"] if case == "group" else None
    w = model[2].weight.detach()
    flat = torch.zeros(8 + w.numel() + 8)
    if case == "strided-slice":
        big = torch.zeros(2 * w.shape[0], 2 * w.shape[1])
        big[::2, ::2] = w
        view = big[::2, ::2]
    else:
        start = 0 if case == "flat-outside" else 8
        flat[start:start + w.numel()] = w.reshape(-1)
        view = flat[start:start + w.numel()].view(w.shape)
    model[2].weight = nn.Parameter(view)
    model[0].weight = nn.Parameter(torch.randn(32, 64).t())  # dense, all of its memory: streams
    model[0].bias = nn.Parameter(torch.randn(8, 8).view(64))
    x = torch.randn(3, 32)
    want = model(x)  # a deep copy would make the slice dense: another BLAS path
    before = _state(model)
    with pytest.raises(LayerstreamError, match=rf"parameter '2.weight' \(shape \(32, 64\), strides "
                                               rf"{re.escape(str(view.stride()))}, storage offset "
                                               rf"{view.storage_offset()}\) uses 8192 of the \d+ bytes.*"
                                               rf"view into a larger buffer.*strided slice.*gives it back dense.*"
                                               rf"p.data = p.data.clone\(\).*exclude=\['2'\]"):
        layerstream.offload(model, device="sim", groups=groups)
    _assert_unchanged(before, model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    handle = layerstream.offload(model, device="sim", exclude=["2"])
    assert handle.layers == ["0"]
    assert torch.equal(model(x), want)
    handle.detach()
    assert model[2].weight.data_ptr() == view.data_ptr()  # resident: still the view
    assert model[0].weight.stride() == (1, 64)
    model[2].weight.data = model[2].weight.data.clone()  # dense now (a slice's BLAS path changes)
    want = model(x)
    handle = layerstream.offload(model, device="sim", groups=groups)
    assert handle.layers == ["0", "2"]
    assert torch.equal(model(x), want)
    handle.detach()
    assert torch.equal(model(x), want)


@pytest.mark.parametrize("quantize", [None, "lossless", "int8"])
@pytest.mark.parametrize("which", ["weight", "bias"])
def test_a_parameter_whose_memory_overlaps_itself_is_refused(quantize, which):
    """An expand()ed parameter (stride 0: one row for all) used to be accepted: offload()
    streamed a dense copy, and detach() failed on torch's "more than one element of the
    written-to tensor refers to a single memory location" with the handle counted as
    detached and that layer and the ones after it left data-less (quantized) or with
    other strides (quantize=None). offload() now refuses it before anything changes,
    naming the parameter and both fixes; each fix works."""
    model = _mlp().requires_grad_(False)
    shape = model[2]._parameters[which].shape
    row = torch.randn(shape[1:]).unsqueeze(0) if which == "weight" else torch.randn(1)
    model[2]._parameters[which] = nn.Parameter(row.expand(shape), requires_grad=False)
    ref = copy.deepcopy(model)
    before = _state(model)
    with pytest.raises(LayerstreamError, match=rf"parameter '2.{which}' has shape .* strides \(0,.*overlaps "
                                               rf"itself.*detach\(\) could not give back.*"
                                               rf"p.data = p.data.contiguous\(\).*exclude=\['2'\]"):
        layerstream.offload(model, device="sim", quantize=quantize)
    _assert_unchanged(before, model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    x = torch.randn(3, 32)
    handle = layerstream.offload(model, device="sim", quantize=quantize, exclude=["2"])
    assert handle.layers == ["0"]
    handle.detach()
    model[2]._parameters[which].data = model[2]._parameters[which].data.contiguous()
    handle = layerstream.offload(model, device="sim", quantize=quantize)
    assert handle.layers == ["0", "2"]
    if quantize != "int8":
        assert torch.equal(model(x), ref(x))
    handle.detach()
    assert not any(p.is_meta for p in model.parameters())
    if quantize != "int8":
        assert torch.equal(model(x), ref(x))


def test_a_failure_while_detach_rebuilds_the_weights_changes_nothing(monkeypatch):
    """detach() rebuilds each weight offload() quantized from the host store (in the strides
    it had); that could fail (it did on an expand()ed weight, now refused by offload(); a
    device out of memory) after the engine had let go of every layer: the handle counted
    as detached, the failing layer and the ones after it stayed data-less, and the model
    could neither run nor be detached again. Everything that can fail now happens before
    anything changes: the error propagates, the model stays offloaded and runs, and
    detach() goes ahead once the cause is gone."""
    model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(3)]).requires_grad_(False)
    ref = copy.deepcopy(model)
    handle = layerstream.offload(model, device="sim", quantize="lossless")
    x = torch.randn(2, 16)
    assert torch.equal(model(x), ref(x))
    before = _state(model)
    real, calls = torch.empty_strided, []

    def failing(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise MemoryError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty_strided", failing)
    with pytest.raises(MemoryError, match="injected"):
        handle.detach()
    monkeypatch.undo()
    assert len(calls) == 2
    _assert_unchanged(before, model)
    assert handle.layers == ["0", "1", "2"] and handle.stats()["steps"] >= 1  # not detached
    assert torch.equal(model(x), ref(x))
    handle.detach()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q) and type(p) is nn.Parameter, n
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert torch.equal(model(x), ref(x))


def _doubled(forward, x):
    return forward(x) * 2


class _SlotWrapper:
    """A wrapper that keeps the forward it wraps where detach() cannot see it."""

    __slots__ = ("_inner",)

    def __init__(self, inner):
        self._inner = inner

    def __call__(self, x):
        return self._inner(x) * 2


@pytest.mark.parametrize("how", ["partial", "slots"])
def test_detach_refuses_a_wrapper_that_keeps_the_streamed_forward_out_of_reach(how):
    """A forward wrapper installed on a streamed layer after offload() that holds
    layerstream's forward where detach() cannot put the layer's own forward back (a
    functools.partial's arguments) or find it (an object with __slots__): detach() used
    to drop the wrapper (other outputs, silently). It now refuses before anything
    changes, naming the layer, the wrapper and the fix; the model still runs, wrapped;
    with the wrapper removed, detach() goes ahead."""
    model = _mlp()
    ref = copy.deepcopy(model)
    handle = layerstream.offload(model, device="sim")
    streamed = model[2].forward
    model[2].forward = functools.partial(_doubled, streamed) if how == "partial" else _SlotWrapper(streamed)
    x = torch.randn(3, 32)
    assert torch.equal(model(x), ref[2](ref[1](ref[0](x))) * 2)
    before, wrapper = _state(model), model[2].forward
    name = r"test_misuse\._doubled" if how == "partial" else r"a test_misuse\._SlotWrapper object"
    where = r"cannot replace it \(in a functools.partial" if how == "partial" else "does not find it"
    with pytest.raises(LayerstreamError, match=rf"detach\(\): the forward of streamed layer '2' was wrapped after "
                                               rf"offload\(\) by {name}, which .*{where}.*Nothing was changed: "
                                               rf"remove that wrapper first"):
        handle.detach()
    _assert_unchanged(before, model)
    assert model[2].__dict__["forward"] is wrapper and model[0].__dict__["forward"] is not None
    assert handle.layers == ["0", "2"]
    assert torch.equal(model(x), ref[2](ref[1](ref[0](x))) * 2)
    model[2].forward = streamed  # the fix the message names
    handle.detach()
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert torch.equal(model(x), ref(x))

def test_offload_warnings_name_the_callers_line():
    """offload() runs its steps in functions of its own; a warning from any of them
    (discovery, ties, formats) still points at the line that called offload()."""
    class Custom(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    shared = nn.Parameter(torch.zeros(8))
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    a.bias = b.bias = shared
    model = nn.Sequential(Custom(8, 8), a, b, nn.Linear(8, 100)).requires_grad_(False)  # 8 columns: no int4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = layerstream.offload(model, device="sim", quantize="int4")
    texts = {str(w.message)[:60]: w.filename for w in caught if "layerstream" in str(w.message)}
    assert any("subclass" in t for t in texts), texts
    assert any("tied weights" in t for t in texts), texts
    assert any("cannot pack" in t for t in texts), texts
    assert set(texts.values()) == {__file__}, texts
    handle.detach()


def _engine_holding_a_group():
    """A sim engine holding one fetched tensor group: (engine, its tensor, a copy of it,
    the group's index, the fetch token, the fetched views)."""
    e = layerstream._C.Engine({"device": "sim"})
    w = torch.randn(4, 8)
    i = e.add_group("experts", [w])
    token, views = e.fetch(i)
    return e, w, w.clone(), i, token, views


def test_suspend_is_refused_while_a_fetched_group_is_held_and_fetches_are_refused_until_resume():
    """Engine.suspend() frees the slot arena: not while a fetch() token still points
    into it (refused, nothing changed), and no fetch until resume(), which brings the
    same bytes back."""
    e, w, want, i, token, views = _engine_holding_a_group()
    with pytest.raises(LayerstreamError, match=r"1 fetch\(\) token.*release them first"):
        e.suspend()
    assert not e.suspended and e.stats()["device_bytes"] > 0
    e.release(token)
    e.suspend()
    assert e.suspended and e.stats()["device_bytes"] == 0
    with pytest.raises(LayerstreamError, match=r"suspended.*resume\(\)"):
        e.fetch(i)
    e.resume()
    token, views = e.fetch(i)
    assert torch.equal(views[0], want)
    e.release(token)
    assert e.ordering_errors() == []


def test_detach_is_refused_while_a_fetched_group_is_held():
    """Engine.detach() frees the scheduler a fetch() token releases through (another
    thread's layer computing, as the token of a group recomputed in backward): refused,
    nothing changed; once released, detach() goes ahead."""
    e, w, want, i, token, views = _engine_holding_a_group()
    with pytest.raises(LayerstreamError, match=r"detach\(\): 1 fetch\(\) token.*detach after it returns"):
        e.detach(["cpu"])
    assert torch.equal(views[0], want) and e.stats()["device_bytes"] > 0
    e.release(token)
    e.detach(["cpu"])
    assert torch.equal(w, want)


def test_a_backward_after_suspend_is_an_error_and_training_goes_on_after_resume():
    """A graph recorded before suspend() cannot run its backward (the streamed
    layers' weights would come back into freed slots): an error naming resume(); no
    streamed gradient reaches .grad. After resume(), a new step trains as the
    resident model does."""
    model = _mlp()
    ref = copy.deepcopy(model)
    handle = layerstream.offload(model, device="sim")
    x = torch.randn(3, 32)
    y = model(x).square().sum()
    handle.suspend()
    with pytest.raises(RuntimeError, match=r"suspended.*resume\(\)"):  # through autograd's engine
        y.backward()
    assert all(p.grad is None for p in model.parameters())
    handle.resume()
    model.zero_grad()
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    assert handle.ordering_errors() == []


def test_suspend_and_resume_inside_inference_mode_leave_tensors_a_backward_can_save():
    """handle.suspend() / resume() inside torch.inference_mode() (a sampling step of a LoRA
    training loop): the moves made inference tensors of the parameters, buffers and
    optimizer states, and the next training step failed ("Inference tensors cannot be
    saved for backward"). The moves leave inference mode. The sim device computes on the
    host, where nothing moves: the move helpers, with a host-to-host copy."""
    from layerstream._handle import _move_back, _moved_off
    from layerstream._optim_state import _move_states_back, _move_states_of

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = layerstream.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    cpu = torch.device("cpu")
    with torch.inference_mode():
        moved = _moved_off(model, cpu, torch.clone, [])
        params = [t for t, owner, _, _ in moved if owner is None]
        _move_states_of(params, cpu, torch.clone)
        _move_back(moved)
        _move_states_back([(p, cpu) for p in params])
    assert params and moved
    assert not any(t.is_inference() for t in [*model.parameters(), *model.buffers()])
    assert not any(t.is_inference() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()


def test_detach_of_a_suspended_model_restores_it_without_allocating_the_slots():
    """detach() while suspended: the model comes back whole (weights bit-identical,
    its own forward), and the engine did not allocate the slots again for it."""
    model = _mlp()
    before = _state(model)
    handle = layerstream.offload(model, device="sim")
    engine = handle._engine
    handle.suspend()
    handle.detach()
    assert engine.stats()["device_bytes"] == 0
    after = _state(model)
    for n, (*_, values) in before.items():
        assert torch.equal(after[n][-1], values), n
    x = torch.randn(3, 32)
    assert torch.equal(model(x), copy.deepcopy(model)(x))
    with pytest.raises(LayerstreamError, match="detached"):
        handle.resume()


def test_the_whole_model_to_the_host_suspends_and_back_to_the_compute_device_resumes():
    """What accelerate's and diffusers' CPU offload hooks (and training scripts
    freeing memory for sampling) do: model.to("cpu"), later model.to(<compute
    device>). On a model computing on a GPU, offload() makes the first suspend the
    handle and the second resume it; anything more than a plain move stays the
    class's own conversion (refused as before, naming both ways). The sim device
    computes on the host, so offload() leaves its model's methods alone; here they
    are installed as for a model computing on another device (meta), and the parity
    test runs the real thing on a GPU."""
    from layerstream._guards import _HostMove
    model = _mlp()
    handle = layerstream.offload(model, device="sim")
    assert "to" not in model.__dict__  # computes on the host: nothing installed
    x = torch.randn(3, 32)
    want = model(x)
    fake = torch.device("meta")
    for kind in ("to", "cpu", "cuda"):
        setattr(model, kind, _HostMove(kind, model, handle, fake))
    handle._host_moves = ["to", "cpu", "cuda"]
    assert model.to("cpu") is model
    assert handle.suspended and handle.stats()["device_bytes"] == 0 and "(suspended)" in repr(handle)
    # The advice fits the compute device: on sim (the host) model.to('cpu') does not resume.
    with pytest.raises(LayerstreamError, match=r"suspended.*call handle\.resume\(\) before running it$"):
        model(x)
    from layerstream._handle import _refuse_while_suspended
    with pytest.raises(LayerstreamError, match=r"handle\.resume\(\) or model\.to\('cuda:0'\) before running it"):
        _refuse_while_suspended("cuda:0", model, (x,))
    assert model.cpu() is model and model.to(device="cpu") is model and handle.suspended
    assert model.to("cpu", torch.float32) is model and handle.suspended  # the model's own dtype: a move
    with pytest.raises(LayerstreamError, match=r"share_memory\(\) would move them into shared memory"):
        model.share_memory()  # not a move: refused (test_ddp_rules.py); still suspended (below)
    with pytest.raises(LayerstreamError, match=r"would move them elsewhere or change their dtype.*"
                                               r"model\.to\('cpu'\) on the model given to offload\(\).*handle\.resume\(\)"):
        model.to("cpu", torch.float16)  # more than a move: the class's own
    assert handle.suspended
    # A move to the compute device resumes (with a dtype too: pipe.to("cuda",
    # torch.bfloat16)), then converts as nn.Module does: refused here, where the
    # streamed layers compute on the host, not on meta.
    with pytest.raises(LayerstreamError, match="would move them elsewhere"):
        model.to("meta", torch.float32)
    assert not handle.suspended and handle.stats()["device_bytes"] > 0
    assert torch.equal(model(x), want)
    handle.detach()
    assert not {"to", "cpu", "cuda"} & set(model.__dict__)


def test_requested_moves_are_read_as_torch_reads_them():
    """_HostMove's reading of model.to/cpu/cuda arguments: the device, the dtype and
    whether a memory format is asked for."""
    from layerstream._guards import _requested_move
    cpu, cuda, cuda1 = torch.device("cpu"), torch.device("cuda"), torch.device("cuda", 1)
    assert _requested_move("to", ("cpu",), {}) == (cpu, None, False)
    assert _requested_move("to", (), {"device": "cuda:1"}) == (cuda1, None, False)
    assert _requested_move("to", ("cpu", torch.float16), {}) == (cpu, torch.float16, False)
    assert _requested_move("to", (torch.bfloat16,), {}) == (None, torch.bfloat16, False)
    assert _requested_move("to", (), {"memory_format": torch.channels_last}) == (None, None, True)
    assert _requested_move("to", ("cuda",), {"non_blocking": True}) == (cuda, None, False)
    assert _requested_move("cpu", (), {}) == (cpu, None, False)
    assert _requested_move("cuda", (), {}) == (cuda, None, False)
    assert _requested_move("cuda", (1,), {}) == (cuda1, None, False)
    assert _requested_move("cuda", (), {"device": cuda1}) == (cuda1, None, False)


def test_suspend_moves_each_device_tensor_once_with_its_gradient():
    """What suspend() moves off the compute device (_moved_off), seen on this
    machine (one device) with a copy in place of the move: every parameter there
    (the same object, new data, its .grad too) and buffer, a shared buffer once
    (both modules then hold the one copy), nothing that lives elsewhere."""
    from layerstream._handle import _moved_off
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4))
    model[2].running_mean = model[1].running_mean  # registered twice
    elsewhere = torch.zeros(4, device="meta")
    model[0].register_buffer("elsewhere", elsewhere)
    model(torch.randn(3, 4)).sum().backward()
    params = list(model.parameters())
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    old = {id(p): (ptr(p), ptr(p.grad)) for p in params}
    buffers = dict(model.named_buffers(remove_duplicate=False))
    moved = _moved_off(model, torch.device("cpu"), lambda t: t.clone(), [])
    assert all(p is q for p, q in zip(model.parameters(), params))
    for n, p in model.named_parameters():
        assert ptr(p) != old[id(p)][0] and ptr(p.grad) != old[id(p)][1], n
    for n, b in model.named_buffers(remove_duplicate=False):
        assert b is elsewhere if n == "0.elsewhere" else b is not buffers[n] and torch.equal(b, buffers[n]), n
    assert model[2].running_mean is model[1].running_mean
    assert len([m for m in moved if m[1] is None]) == len(params)  # each parameter once


def test_device_auto_without_cuda_warns_why_as_no_device_does():
    """offload(device="auto") fell back to the sim device without a word (only device=None
    warned; the engine's own warning for "auto" never saw it, offload() resolves it first)."""
    from layerstream import _offload
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: device='auto' uses it")
    _offload._warn_sim_fallback.cache_clear()
    with pytest.warns(RuntimeWarning, match=r"device='auto'\) runs on the simulated device .* because"):
        h = layerstream.offload(nn.Sequential(nn.Linear(8, 8)), device="auto")
    assert h.device == "sim"
    h.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layerstream.offload(nn.Sequential(nn.Linear(8, 8))).detach()  # said once per process


def test_to_empty_after_offload_is_refused_before_anything_changes():
    """model.to_empty(device=<compute device>) after offload() went through: the streamed
    layers kept their host weights and every resident tensor (the LayerNorms here) became
    uninitialised memory, though the README lists to_empty() as refused. The conversion
    checks cannot tell it from a move to that device; the model, the modules between it
    and the streamed layers, and those layers refuse it themselves."""
    torch.manual_seed(0)
    model = nn.Sequential(_NormThenLinear(), nn.Linear(32, 32), nn.LayerNorm(32))
    for p in model.parameters():  # LayerNorm's ones and zeros would survive by chance
        p.data.normal_()
    x = torch.randn(4, 32)
    want = model(x)
    handle = layerstream.offload(model, device="sim")  # the compute device is the CPU
    assert handle.stats()["layers"] == 2
    before = _state(model)
    for convert in (lambda: model.to_empty(device="cpu"),
                    lambda: model.to_empty(device=torch.device("cpu"), recurse=False),
                    lambda: model[0].to_empty(device="cpu"),  # holds a LayerNorm and a streamed Linear
                    lambda: model[0].up.to_empty(device="cpu"),
                    lambda: model[1].to_empty(device="cpu")):
        with pytest.raises(LayerstreamError, match=r"to_empty\(device='cpu'\) of .* uninitialised memory"):
            convert()
        _assert_unchanged(before, model)
    with pytest.raises(LayerstreamError, match="would move them elsewhere"):
        model[0].to_empty(device="meta")  # refused as model.to("meta") is
    _assert_unchanged(before, model)
    assert torch.equal(model(x), want)
    handle.detach()
    assert not any("to_empty" in m.__dict__ for m in model.modules())
    model[2].to_empty(device="cpu")  # torch's own again


def test_a_model_offloaded_by_a_dropped_handle_names_the_way_back(offload_sim):
    """offload(model) on its own line drops the handle: a second offload() said to call
    detach() "on that handle", which the user no longer has. The error names the way
    to it from the model, and that way works."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    offload_sim(model)
    with pytest.raises(LayerstreamError, match=r"if it was not kept: model\[0\]\._layerstream_handle\.detach\(\)"):
        offload_sim(model, budget="1MiB")
    model[0]._layerstream_handle.detach()
    offload_sim(model)
    x = torch.randn(2, 8)
    assert torch.equal(model(x), ref(x))


def test_the_engine_names_a_trainable_complex_group_tensor_and_what_to_do():
    """Engine.add_group() of a complex tensor that requires grad said "tensor #0 is
    undefined, or requires grad and is not a floating-point tensor": neither the dtype
    nor the fix. (offload() refuses it earlier, naming the parameter: test_errors.py.)"""
    e = layerstream._C.Engine({"device": "sim"})
    w = torch.randn(4, 8, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(LayerstreamError, match=r"tensor #1 \(complex64\) requires grad but is not floating point; "
                                               r"a tensor group trains floating-point tensors only: freeze it"):
        e.add_group("g", [torch.randn(4), w])
    e.add_group("g", [torch.randn(4), w.detach()])  # frozen: crosses as it is


def test_a_layout_conversion_after_offload_is_refused_before_anything_changes():
    """model.to(memory_format=torch.channels_last) after offload() left the streamed conv
    weights contiguous, silently (the conversion probe's empty tensors have no layout), while
    the rest converted: the numbers of neither layout. Refused now, before anything changes;
    moves to the compute device and no-op conversions still pass."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 8, 3))
    layerstream.offload(model, device="sim")
    before = {n: (p.detach().clone(), p.stride()) for n, p in model.named_parameters()}
    with pytest.raises(LayerstreamError, match=r"streamed layer '0' .* another memory layout .*before offload\(\)"):
        model.to(memory_format=torch.channels_last)
    assert all(torch.equal(p, before[n][0]) and p.stride() == before[n][1] for n, p in model.named_parameters())
    model.to("cpu").float()
    model(torch.randn(2, 16, 8, 8))
