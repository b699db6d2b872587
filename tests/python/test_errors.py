"""Error paths of offload() and the Handle: each error is a clear, specific message."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn

import layerstream
from layerstream import LayerstreamError


class Named(nn.Module):
    def __init__(self):
        super().__init__()
        self.small = nn.Linear(4, 8)
        self.big = nn.Linear(8, 64)   # the largest layer: 64*8*4 + 64*4 = 2304 bytes
        self.out = nn.Linear(64, 2)

    def forward(self, x):
        return self.out(torch.relu(self.big(torch.relu(self.small(x)))))


def _forwards(model):
    return {n: m.__dict__.get("forward") for n, m in model.named_modules()}


# ---------------------------------------------------------------- budget
def _stack(n=6, d=32):
    """n equal Linear(d, d) layers: 4224 bytes each (4352 in a slot) for d=32."""
    return nn.Sequential(*[nn.Linear(d, d) for _ in range(n)])


def _budget_error(offload_sim, model, x, **kw):
    """The LayerstreamError for a bad budget, raised by offload() or, if the
    schedule is built lazily, by the first forward (which must then not have
    transferred anything)."""
    try:
        handle = offload_sim(model, **kw)
    except LayerstreamError as e:
        return e
    with pytest.raises(LayerstreamError) as info:
        model(x)
    assert handle.stats()["h2d_bytes"] == 0
    return info.value


def _minimum_from(msg):
    m = re.search(r"at least[^()]*?\((\d+) bytes\)", msg) or re.search(r"at least (\d+) bytes", msg)
    assert m, f"the message does not say the minimum budget: {msg}"
    return int(m.group(1))


def test_budget_smaller_than_largest_layer(offload_sim):
    model = Named()
    budget = 1000  # < 2304 bytes of the largest layer alone
    msg = str(_budget_error(offload_sim, model, torch.randn(2, 4), budget=budget))
    assert re.search(r"""['"]big['"]""", msg), msg      # names the layer
    assert "1000 bytes" in msg, msg                     # the budget given
    assert "2304" in msg, msg                           # the layer's size
    # and what is needed: here the whole model resident (2984 bytes) is cheaper than 2 slots
    # of 'big' (4608), or 'big' resident and 2 slots of 'out' (768 bytes each: 3840)
    assert _minimum_from(msg) == 160 + 2304 + 520 < 2304 + 2 * 768 < 2 * 2304, msg
    assert "(every layer resident)" in msg, msg
    handle = offload_sim(model, budget=_minimum_from(msg))
    assert handle.layers == []


def test_budget_error_at_offload_leaves_model_untouched():
    """A budget below the largest layer is refused by offload() itself (the planner runs
    there), before any module changes: forwards, parameter storage and handles as before."""
    model = Named()
    before = _forwards(model)
    data = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(LayerstreamError, match=r"budget.*1000 bytes"):
        layerstream.offload(model, device="sim", budget=1000)
    assert _forwards(model) == before
    assert [p.data_ptr() for p in model.parameters()] == data
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert all(getattr(m, "_layerstream_handle", None) is None for m in model.modules())


def test_budget_error_minimum_is_enough(offload_sim):
    """The minimum the message asks for is actually enough, and layers stream under it."""
    msg = str(_budget_error(offload_sim, _stack(), torch.randn(1, 32), budget=1))
    minimum = _minimum_from(msg)
    model = _stack()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, budget=minimum)
    assert handle.layers, "at the minimum budget the layers must stream"
    x = torch.randn(3, 32, requires_grad=True)
    y = model(x)
    assert torch.equal(y, ref(x))
    y.sum().backward()
    assert handle.stats()["peak_device_bytes"] <= minimum
    # one byte less is refused
    err = _budget_error(offload_sim, _stack(), torch.randn(1, 32), budget=minimum - 1)
    assert _minimum_from(str(err)) == minimum


def test_budget_that_fits_everything_keeps_layers_resident(offload_sim):
    """1 MiB holds the whole model (2984 bytes): the planner keeps all three layers
    resident, so nothing streams and nothing crosses the bus."""
    model = Named()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, budget="1MiB")
    x = torch.randn(2, 4)
    assert torch.equal(model(x), ref(x))
    stats = handle.stats()
    assert stats["budget_bytes"] == 2**20
    assert stats["peak_device_bytes"] <= 2**20
    assert handle.layers == []
    assert stats["resident_layers"] == 3
    assert stats["resident_bytes"] == sum(p.numel() * p.element_size() for p in ref.parameters())
    assert stats["h2d_bytes"] == 0


def test_budget_string_units(offload_sim):
    msg = str(_budget_error(offload_sim, Named(), torch.randn(1, 4), budget="1KiB"))
    assert "1024 bytes" in msg, msg
    handle = offload_sim(_stack(), budget="12KiB")
    assert handle.stats()["budget_bytes"] == 12 * 1024


@pytest.mark.parametrize("kw,exc,match", [
    pytest.param(dict(budget="12 parsecs"), ValueError, "invalid size", id="budget-unit"),
    pytest.param(dict(budget=-5), ValueError, "budget", id="budget-negative"),
    pytest.param(dict(budget=True), ValueError, "budget", id="budget-bool"),
    pytest.param(dict(slots=1), ValueError, "slots", id="slots-1"),
    pytest.param(dict(prefetch=-1), ValueError, "prefetch", id="prefetch-neg"),
])
def test_bad_options(kw, exc, match):
    model = Named()
    before = _forwards(model)
    with pytest.raises(exc, match=match):
        layerstream.offload(model, device="sim", **kw)
    assert _forwards(model) == before  # nothing attached


def test_slots_do_not_fit_budget(offload_sim):
    err = _budget_error(offload_sim, _stack(n=12), torch.randn(1, 32), budget=3 * 4352, slots=8)
    msg = str(err)
    assert "slots=8" in msg, msg
    assert _minimum_from(msg) == 8 * 4352, msg  # what 8 slots of the largest layer need
    # (with 6 layers, keeping them all resident would be the cheaper plan, and the message says so)
    msg6 = str(_budget_error(offload_sim, _stack(), torch.randn(1, 32), budget=3 * 4352, slots=8))
    assert _minimum_from(msg6) == 6 * 4224 and "(every layer resident)" in msg6, msg6
    model = _stack(n=12)  # 12 * 4224 bytes: does not fit resident in 8 * 4352
    handle = offload_sim(model, budget=8 * 4352, slots=8)
    model(torch.randn(1, 32))  # the schedule (and its slots) is built on first use
    assert handle.stats()["slots"] == 8


# --------------------------------------------------- budget: slots before residency
@pytest.mark.parametrize("prefetch,slots", [(0, 2), (1, 2), (2, 3), (3, 4)])
def test_budget_reserves_the_prefetch_slots_before_residency(offload_sim, prefetch, slots):
    """With a budget, the planner first reserves prefetch + 1 slots (one in use,
    `prefetch` in flight), then keeps layers resident with the rest: the
    requested prefetch depth is not traded away for residency."""
    budget = 8 * 4352  # 12 layers of 4352 bytes in a slot (4224 resident)
    model = _stack(n=12)
    ref = copy.deepcopy(model)
    handle = offload_sim(model, budget=budget, prefetch=prefetch)
    x = torch.randn(3, 32)
    assert torch.equal(model(x), ref(x))
    s = handle.stats()
    assert s["slots"] >= slots, s
    assert s["peak_device_bytes"] <= budget, s
    # residency takes what the reserved slots leave, and only that
    expected_resident = (budget - slots * 4352) // 4224
    assert s["resident_layers"] == min(expected_resident, 12 - slots), s
    assert s["slots"] * 4352 + s["resident_layers"] * 4224 <= budget


def test_budget_too_small_for_the_prefetch_slots_streams_with_fewer(offload_sim):
    """A budget that holds 2 slots but not prefetch + 1 still streams (prefetch
    depth 1), as documented, and stays inside the budget."""
    model = _stack(n=6)
    ref = copy.deepcopy(model)
    handle = offload_sim(model, budget=2 * 4352 + 100, prefetch=3)
    x = torch.randn(2, 32)
    assert torch.equal(model(x), ref(x))
    s = handle.stats()
    assert s["slots"] == 2 and s.get("resident_layers", 0) == 0, s
    assert s["peak_device_bytes"] <= 2 * 4352 + 100


def test_explicit_slots_with_budget_are_reserved_before_residency(offload_sim):
    """slots=N with a budget that holds N slots and more: N slots, the rest
    resident (the planner used to spend the budget on residency first and the
    engine then refused the N slots)."""
    budget = 8 * 4352
    model = _stack(n=12)
    handle = offload_sim(model, budget=budget, slots=4)
    model(torch.randn(1, 32))
    s = handle.stats()
    assert s["slots"] == 4, s
    assert s["resident_layers"] == (budget - 4 * 4352) // 4224, s
    assert s["peak_device_bytes"] <= budget


class _WithHead(nn.Module):
    """Six 4352-byte-slot layers and an LM-head-like outlier ten times larger."""

    def __init__(self):
        super().__init__()
        self.blocks = _stack(n=6)
        self.head = nn.Linear(32, 336)  # 336*32*4 + 336*4 = 44352 bytes

    def forward(self, x):
        return self.head(self.blocks(x))


def test_budget_keeps_an_outlier_layer_resident_to_shrink_the_slots(offload_sim):
    """The slots are sized by the largest *streamed* layer. An outlier (an LM head
    10x a block's layers) is kept resident when that lets the prefetch slots fit:
    before, a budget below prefetch + 1 slots of the outlier fell back to 2 slots of
    it, or was refused below 2 (here it was refused: a 58 KB budget, slots of 44.5 KB)."""
    torch.manual_seed(0)
    budget = 44352 + 3 * 4352 + 1000
    model = _WithHead()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, budget=budget, prefetch=2)
    assert "head" not in handle.layers and len(handle.layers) == 6
    x = torch.randn(3, 32)
    out, want = model(x), ref(x)
    assert torch.equal(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    s = handle.stats()
    assert s["slots"] == 3 and s["slot_bytes"] == 4352, s
    assert s["peak_device_bytes"] <= budget, s
    # Too small for the outlier plus 2 slots: the error names the least budget and how.
    with pytest.raises(LayerstreamError, match=r"a budget of at least 51.81 KiB \(53056 bytes\) is needed "
                                               r"\(the least with the 1 largest layer\(s\) resident"):
        offload_sim(_WithHead(), budget=44352 + 2 * 4352 - 1)


# ---------------------------------------------------------------- device
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a visible GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_gpu(device):
    model = Named()
    before = _forwards(model)
    with pytest.raises(LayerstreamError, match="no CUDA GPU") as info:
        layerstream.offload(model, device=device)
    assert f"'{device}'" in str(info.value)
    assert "use device='sim'" in str(info.value)  # suggests the simulated device, in Python's spelling
    assert "OffloadOptions" not in str(info.value) and "--device" not in str(info.value)
    assert _forwards(model) == before
    assert all(not hasattr(p, "_is_memory_managed") for p in model.parameters())


@pytest.mark.parametrize("device", ["tpu", "mps", "cpu", "", "cuda:x"])
def test_unknown_device(device):
    model = Named()
    with pytest.raises(LayerstreamError, match="device") as info:
        layerstream.offload(model, device=device)
    assert repr(device) in str(info.value) or device in str(info.value)
    assert all(getattr(m, "_layerstream_handle", None) is None for m in model.modules())


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks CUDA when a GPU is visible")
def test_auto_device_is_sim_without_gpu(offload_sim):
    model = Named()
    handle = layerstream.offload(model)
    try:
        assert handle.device == "sim"
        assert handle.compute_device == torch.device("cpu")
        assert handle.ordering_errors() == []
    finally:
        handle.detach()


# ---------------------------------------------------------------- attach twice
def test_offload_same_model_twice(offload_sim):
    model = Named()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    with pytest.raises(LayerstreamError, match="already offloaded") as info:
        layerstream.offload(model, device="sim")
    assert "'small'" in str(info.value)  # names the module
    assert "detach" in str(info.value)
    # the first handle still works
    x = torch.randn(2, 4)
    assert torch.equal(model(x), ref(x))
    assert handle.layers == ["small", "big", "out"]


def test_offload_parent_of_offloaded_submodule(offload_sim):
    inner = Named()
    offload_sim(inner)
    outer = nn.Sequential(nn.Linear(3, 4), inner)
    with pytest.raises(LayerstreamError, match=r"'1\.small'"):
        layerstream.offload(outer, device="sim")
    # the outer Linear was not attached by the failed call
    assert "forward" not in outer[0].__dict__


def test_offload_parent_of_quantized_offloaded_submodule(offload_sim):
    """The data-less (meta) weights of a quantized offloaded submodule are not taken
    for an unloaded model: the error is the 'already offloaded' one."""
    inner = Named().requires_grad_(False)
    offload_sim(inner, quantize="int8")
    assert inner.big.weight.is_meta
    outer = nn.Sequential(nn.Linear(3, 4), inner)
    with pytest.raises(LayerstreamError, match=r"'1\.small' is already offloaded"):
        layerstream.offload(outer, device="sim")


@pytest.mark.parametrize("where", ["all", "one_module"])
def test_data_less_weights_are_a_clear_error(where):
    """A model built on the meta device (or with accelerate's init_empty_weights, or whose
    weights accelerate offloads through hooks) has no values to stream. Before, offload()
    failed deep inside with torch's "Cannot copy out of meta tensor"; now the error names
    the tensors and says how to load the weights, and nothing was changed."""
    if where == "all":
        with torch.device("meta"):
            model = Named()
        names = "small.weight, small.bias, big.weight, big.bias, out.weight, ..."
    else:
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
        model[1].to("meta")
        names = "1.weight, 1.bias."
    with pytest.raises(LayerstreamError, match="no data \\(meta tensors\\)") as info:
        layerstream.offload(model, device="sim")
    assert names in str(info.value)
    assert "from_pretrained" in str(info.value)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert not any(getattr(m, "_layerstream_handle", None) for m in model.modules())


def test_layer_with_a_forward_wrapped_on_the_instance_stays_resident(offload_sim):
    """A layer whose forward was replaced on the instance (accelerate's add_hook_to_module,
    or any wrapping) used to be streamed with the plain Linear forward, silently dropping
    the wrapper (here: an output scaled by 2). It now stays resident with one warning that
    names it and how to remove accelerate's hooks; the other layers stream."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Double(ModelHook):
        def post_forward(self, module, output):
            return output * 2

    model = Named()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        add_hook_to_module(m.big, Double())
        plain = m.out.forward
        m.out.forward = lambda x, plain=plain: plain(x) + 1
    with pytest.warns(RuntimeWarning, match=r"2 layer\(s\) whose forward was replaced on the instance "
                                            r"stay resident .*remove_hook_from_module.*: 'big' "
                                            r"\(accelerate hook\); 'out'"):
        handle = offload_sim(model)
    assert handle.layers == ["small"]
    x = torch.randn(3, 4)
    assert torch.equal(model(x), ref(x))
    handle.detach()
    assert torch.equal(model(x), ref(x))


def _plus_one(forward):
    def wrapper(x):
        return forward(x) + 1
    return wrapper


def test_a_diffusers_hook_installed_after_offload_keeps_working_after_detach(offload_sim):
    """diffusers' HookRegistry keeps the forward it wraps in an attribute of a plain
    object (HookFunctionReference) reached from its closure, and sets __wrapped__ on its
    partial: detach() patched __wrapped__ only, so the hook (and, once removed, the forward
    diffusers put back) called the stale streamed forward: every call raised "replaced or
    moved". Now the hook calls the layer's own forward, and removing it leaves a plain layer."""
    pytest.importorskip("diffusers")
    from diffusers.hooks import HookRegistry, ModelHook

    class Count(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Count.calls += 1
            return args, kwargs

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(2, 16)
    want = model(x)
    handle = offload_sim(model)
    HookRegistry.check_if_exists_or_initialize(model[0]).register_hook(Count(), "count")
    assert torch.equal(model(x), want) and Count.calls == 1
    handle.detach()
    assert torch.equal(model(x), want) and Count.calls == 2
    HookRegistry.check_if_exists_or_initialize(model[0]).remove_hook("count")
    with torch.no_grad():
        model[0].weight.mul_(2)
    plain = nn.functional.linear(torch.relu(nn.functional.linear(x, model[0].weight, model[0].bias)),
                                 model[2].weight, model[2].bias)
    assert torch.equal(model(x), plain) and Count.calls == 2


def test_a_wrapper_installed_after_offload_keeps_working_after_detach(offload_sim):
    """Forward wrappers installed on streamed layers after offload() (accelerate's
    add_hook_to_module, which keeps the forward it wraps in module._old_forward; a closure;
    a default argument)
    used to be dropped by detach(): other outputs, silently; and accelerate's
    remove_hook_from_module() then put layerstream's stale forward back (its next call:
    "the weight of streamed layer ... was replaced", after detach). detach() now undoes
    only its own forward: each wrapper keeps working over the layer's own forward, and
    removing it leaves a plain module."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class Double(ModelHook):
        def post_forward(self, module, output):
            return output * 2

    model = Named()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    for m in (model, ref):
        add_hook_to_module(m.big, Double())
        m.out.forward = _plus_one(m.out.forward)
        m.small.forward = lambda x, base=m.small.forward: base(x) - 1  # a default argument
    x = torch.randn(3, 4)
    assert torch.equal(model(x), ref(x))
    handle.detach()
    assert torch.equal(model(x), ref(x))
    assert model.big._old_forward.__func__ is nn.Linear.forward and model.big._old_forward.__self__ is model.big
    assert model.out.forward.__closure__[0].cell_contents.__func__ is nn.Linear.forward
    assert model.small.forward.__defaults__[0].__func__ is nn.Linear.forward
    for m in (model, ref):
        remove_hook_from_module(m.big)
        m.out.forward = m.out.forward.__closure__[0].cell_contents
    assert model.big.forward.__func__ is nn.Linear.forward
    assert torch.equal(model(x), ref(x))


def test_accelerate_cpu_offload_on_an_offloaded_model(offload_sim):
    """accelerate's cpu_offload() on an offloaded model hooks every layer and swaps its
    parameters for data-less ones (it loads them from its own copy, taken from the
    state_dict, for each call). A streamed layer's call then refuses (its parameters were
    replaced) naming cpu_offload; detach() used to drop accelerate's hooks from the
    streamed layers, which then computed with the data-less weights: garbage (torch
    2.14's linear on a meta weight returns uninitialised memory). detach() now leaves
    accelerate's hooks working over the layers' own forwards: the outputs are the model's,
    and removing the hooks gives the model back. (Quantized layers: cpu_offload() fails
    reading their data-less stand-ins, before it changes anything.)"""
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    cpu_offload(model, execution_device=torch.device("cpu"))
    ids = torch.tensor([[1, 5, 9, 3]])
    with pytest.raises(LayerstreamError, match=r"parameters of streamed layer '0' were replaced after offload\(\) "
                                               r"\(e.g. by accelerate's cpu_offload\(\)"):
        model(ids)
    handle.detach()
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))
    remove_hook_from_module(model, recurse=True)
    assert not any(p.is_meta for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))

@pytest.mark.parametrize("where", ["third_layer", "moving_resident_weights"])
def test_failure_while_attaching_undoes_what_was_attached(offload_sim, monkeypatch, where):
    """A failure part way through offload() (injected at the third layer, after the engine
    took it and its forward was swapped; or when the resident weights move to the device,
    where device memory can run out) used to leave the layers streamed, with no handle to
    detach them. offload() now undoes every layer it touched, as detach() does: original
    forwards, the weights bit-identical on their devices, no engine state left, and the
    error propagates."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    calls = []
    if where == "third_layer":
        real = layerstream._StreamedApply

        def failing(module, device, name):
            calls.append(name)
            if len(calls) == 3:
                raise MemoryError("injected")
            return real(module, device, name)

        monkeypatch.setattr(layerstream._attach, "_StreamedApply", failing)
    else:
        def failing(*args):
            calls.append("moved")
            raise MemoryError("injected")

        monkeypatch.setattr(layerstream._attach, "_move_resident", failing)
    with pytest.raises(MemoryError, match="injected"):
        layerstream.offload(model, device="sim")
    monkeypatch.undo()
    assert calls == (["0", "2", "4"] if where == "third_layer" else ["moved"])
    assert "_apply" not in model.__dict__
    for m in model.modules():
        assert "forward" not in m.__dict__ and "_apply" not in m.__dict__
        assert getattr(m, "_layerstream_handle", None) is None
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q) and p.device == q.device, n
        assert not hasattr(p, "_is_memory_managed"), n
    x = torch.randn(3, 4)
    assert torch.equal(model(x), ref(x))
    handle = offload_sim(model)  # and it can be offloaded again
    assert torch.equal(model(x), ref(x))
    assert handle.layers == ["0", "2", "4"]


def test_offload_again_after_detach(offload_sim):
    model = Named()
    ref = copy.deepcopy(model)
    offload_sim(model).detach()
    handle = offload_sim(model)
    x = torch.randn(2, 4)
    assert torch.equal(model(x), ref(x))
    assert handle.stats()["h2d_bytes"] > 0


def test_zero_element_layer_is_left_as_it_is(offload_sim):
    """A Linear with zero elements (out_features=0) has nothing to stream: before, it was
    attached anyway and its first call failed claiming its weight had been replaced. It is
    now left as it is and the other layers stream."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 0))
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    assert handle.layers == ["0"]
    x = torch.randn(2, 4, requires_grad=True)
    y = model(x)
    assert y.shape == (2, 0) and torch.equal(y, ref(x))
    (y.sum() + model[0](x).sum()).backward()
    assert model[0].weight.grad is not None


def test_nothing_to_stream():
    with pytest.raises(LayerstreamError, match="no Linear, Conv1d/2d/3d, Embedding, MultiheadAttention or "
                                               "mixture-of-experts layer"):
        layerstream.offload(nn.Sequential(nn.ReLU(), nn.LayerNorm(4)), device="sim")
    with pytest.raises(LayerstreamError, match="include/exclude"):
        layerstream.offload(Named(), device="sim", exclude="*")


def test_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        layerstream.offload(torch.randn(3), device="sim")


# ---------------------------------------------------------------- detached handle
@pytest.mark.parametrize("call", [
    "stats", "synchronize", "detach", "ordering_errors", "device", "compute_device",
])
def test_detached_handle_raises(offload_sim, call):
    model = Named()
    handle = offload_sim(model)
    handle.detach()
    with pytest.raises(LayerstreamError, match="detached"):
        attr = getattr(handle, call)
        if callable(attr):
            attr()
    assert "detached" in repr(handle)
    # the model itself keeps working with its original forward
    model(torch.randn(1, 4)).sum().backward()


# ---------------------------------------------------------------- inputs
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float64])
def test_linear_wrong_input_dtype(offload_sim, dtype):
    model = Named()
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.ones(2, 4, dtype=dtype)
    with pytest.raises(LayerstreamError) as info:
        model(x)
    msg = str(info.value)
    assert "'small'" in msg, msg
    assert "float32" in msg and "bfloat16" in msg, msg
    # the engine is still usable afterwards
    xf = torch.randn(2, 4, requires_grad=True)
    model(xf).sum().backward()
    ref(xf.detach().requires_grad_()).sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_conv_int_input(offload_sim):
    conv = nn.Conv2d(3, 4, 3)
    offload_sim(conv)
    with pytest.raises(LayerstreamError, match="activations must be"):
        conv(torch.ones(1, 3, 5, 5, dtype=torch.long))


def test_wrong_shape_then_recovers(offload_sim):
    """A shape error inside the streamed layer releases its slot: the next call works."""
    model = Named()
    ref = copy.deepcopy(model)
    offload_sim(model, slots=2, prefetch=1)
    for _ in range(3):
        with pytest.raises(RuntimeError):
            model(torch.randn(2, 5))
    x = torch.randn(2, 4, requires_grad=True)
    model(x).sum().backward()
    ref(x.detach().requires_grad_()).sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def _two_layers(kind, input_grad=True):
    """Two streamed Linear or Conv2d layers (names '0' and '2') and an input."""
    if kind == "linear":
        return (nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)),
                torch.randn(2, 4, requires_grad=input_grad))
    return (nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Conv2d(3, 2, 3)),
            torch.randn(2, 2, 7, 7, requires_grad=input_grad))


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_create_graph_backward_is_a_clear_error_then_recovers(offload_sim, kind):
    """backward(create_graph=True) through a streamed layer (a gradient penalty) is refused:
    before, the input gradient's graph held a device slot that is reused (and lacked the
    weight's share), and the parameter gradients came out wrong or missing without a word.
    A plain backward afterwards matches the reference."""
    model, x = _two_layers(kind)
    ref = copy.deepcopy(model)
    offload_sim(model)
    with pytest.raises(RuntimeError, match=r"layer '2': backward with create_graph=True .*"
                                           r"offload\(exclude=\[\.\.\.\]\)"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        model(x).square().sum().backward(create_graph=True)
    for p in model.parameters():
        p.grad = None
    xr = x.detach().requires_grad_()
    x.grad = None
    model(x).square().sum().backward()
    ref(xr).square().sum().backward()
    assert torch.equal(x.grad, xr.grad)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("input_grad", [True, False])
def test_weight_written_between_forward_and_backward_raises_like_autograd(offload_sim, kind, input_grad):
    """A weight written in place between a forward and its backward (an optimizer step
    before the second micro-batch's backward, an EMA update...). Autograd raises when
    the backward needs the old weight; layerstream fetched the new one and returned
    wrong input gradients without a word. It now saves the weight for autograd's
    version check exactly where autograd's Linear / conv do (Linear: only when the
    input gradient needs it; conv: always), so it raises iff the reference raises, and
    names the layer; when neither raises, gradients are identical."""
    torch.manual_seed(0)
    model, x = _two_layers(kind, input_grad)
    ref = copy.deepcopy(model)
    offload_sim(model)
    outcomes = []
    for m in (ref, model):
        xm = x.detach().clone().requires_grad_(input_grad)
        y = m(xm)
        with torch.no_grad():
            m[0].weight.mul_(2)
        try:
            y.square().sum().backward()
            outcomes.append(None)
        except RuntimeError as e:
            outcomes.append(str(e))
    ref_error, error = outcomes
    # The last layer's input always requires grad, so its weight is needed and the
    # first layer's edit matters only when the first layer's input gradient (or, for
    # a conv, anything) needs it.
    assert (ref_error is not None) == (input_grad or kind == "conv")
    assert (error is not None) == (ref_error is not None), (ref_error, error)
    if error is not None:
        assert "modified by an inplace operation" in error
        assert "streamed layer '0'" in error
    else:
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert torch.equal(p.grad, q.grad), n
    # Training goes on normally afterwards.
    for m in (ref, model):
        m.zero_grad()
        m(x.detach()).square().sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_a_lazy_module_not_yet_called_is_refused_naming_what_to_do(offload_sim):
    """nn.LazyLinear / LazyConv2d before their first call have no shapes: torch's own
    error came from deep inside offload(); it is refused first, naming the parameters,
    and after one call the model streams."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, 8))
    with pytest.raises(LayerstreamError, match=r"2 parameter\(s\)/buffer\(s\) are not initialized yet .*"
                                               r"0\.weight, 0\.bias\. Run the model once"):
        offload_sim(model)
    x = torch.randn(4, 16)
    want = model(x)  # the model is as it was; this call initializes it
    handle = offload_sim(model)
    assert handle.layers == ["0", "2"]
    assert torch.equal(model(x), want)


# ---------------------------------------------------------------- weights replaced after offload
def test_module_to_other_dtype_after_offload(offload_sim):
    """model.half() after offload() is refused before any part of the model changed (it
    would cut the streamed layers from their host copies); the model keeps working.
    After detach() it converts as usual."""
    model = Named()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    for convert in (model.half, lambda: model.to(torch.bfloat16), lambda: model.big.double()):
        with pytest.raises(LayerstreamError, match=r"streamed layer '\w+'.*detach\(\)"):
            convert()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x = torch.randn(2, 4)
    assert torch.equal(model(x), ref(x))
    handle.detach()
    model.half()
    assert all(p.dtype == torch.float16 for p in model.parameters())


_CONV_INPUT, _IDS = torch.randn(1, 4, 9, 9), torch.tensor([[0, 3, 3, 7], [1, 0, 19, 3]])
_GROUPED_INPUT = torch.randn(1, 8, 9, 9)  # what the conv takes with groups=2


@pytest.mark.parametrize("make, attr, value, x", [
    (lambda: nn.Conv2d(4, 4, 3), "stride", (2, 2), _CONV_INPUT),
    (lambda: nn.Conv2d(4, 4, 3), "padding", (1, 1), _CONV_INPUT),
    (lambda: nn.Conv2d(4, 4, 3), "dilation", (2, 2), _CONV_INPUT),
    (lambda: nn.Conv2d(4, 4, 3), "groups", 2, (_CONV_INPUT, _GROUPED_INPUT)),
    (lambda: nn.Conv2d(4, 4, 3, padding=1), "padding_mode", "reflect", _CONV_INPUT),
    (lambda: nn.Embedding(20, 8), "padding_idx", 3, _IDS),
    (lambda: nn.Embedding(20, 8), "max_norm", 1.0, _IDS),
    (lambda: nn.Embedding(20, 8), "norm_type", 1.0, _IDS),
    (lambda: nn.Embedding(20, 8), "scale_grad_by_freq", True, _IDS),
    (lambda: nn.Embedding(20, 8), "sparse", True, _IDS),
], ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_conv_or_table_attribute_changed_after_offload_is_refused_naming_it(offload_sim, make, attr, value, x,
                                                                              compiled):
    """A conv's stride, padding, dilation, groups or padding_mode, or a table's padding_idx,
    max_norm, norm_type, scale_grad_by_freq or sparse, set after offload(): the engine took
    them at offload(), torch's module reads them at each call. Before, the streamed layer
    computed with the old ones without a word (another output shape, a padding row that got
    gradients). The next call is refused naming the layer and the attribute (under
    torch.compile too); set back, the layer works; after detach() the new value is used."""
    x, x_new = x if isinstance(x, tuple) else (x, x)  # the input before and after the change
    torch.manual_seed(0)
    model = nn.Sequential(make())
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    call = torch.compile(model, backend="aot_eager") if compiled else model
    want = ref(x)
    assert torch.equal(call(x), want)
    old = getattr(model[0], attr)
    setattr(model[0], attr, value)
    with pytest.raises(LayerstreamError, match=re.escape(
            f"streamed layer '0': its {attr} changed after offload() ({old!r} -> {value!r})") + r".*before offload\(\), "
            r"or call handle\.detach\(\) first"):
        call(x_new)
    setattr(model[0], attr, old)
    assert torch.equal(call(x), want)
    handle.detach()
    setattr(model[0], attr, value)
    setattr(ref[0], attr, value)
    assert torch.equal(model(x_new), ref(x_new))


def test_weight_moved_behind_the_engines_back_is_detected(offload_sim):
    """A streamed parameter's data replaced directly (not through model.to()) is still
    caught at the next call."""
    model = Named()
    offload_sim(model)
    model.big.weight.data = model.big.weight.data.half()
    with pytest.raises(LayerstreamError, match="replaced or moved after offload"):
        model(torch.randn(2, 4))


def test_a_streamed_weight_resized_after_offload_is_named_as_such(offload_sim):
    """transformers' resize_token_embeddings() after offload() gives the table and head new
    data of another shape: the error named module.to() and .cuda() instead. It names the
    resize and both shapes; a `.data` swap of the same shape names peft's merges that do that."""
    model = Named()
    offload_sim(model)
    old = model.big.weight.data
    model.big.weight.data = torch.randn(old.shape[0] + 2, old.shape[1])
    shape = lambda t: "[" + ", ".join(map(str, t.shape)) + "]"  # noqa: E731
    with pytest.raises(LayerstreamError, match=re.escape(
            f"was resized after offload() (from {shape(old)} to {shape(model.big.weight)}: e.g. transformers' "
            "resize_token_embeddings())")):
        model(torch.randn(2, 4))
    model.big.weight.data = old.clone()
    with pytest.raises(LayerstreamError, match=re.escape("peft's merge_and_unload() assigns .data with safe_merge=True, "
                                                         "and for DoRA, IA3, HRA, BOFT and trainable tokens always")):
        model(torch.randn(2, 4))


def test_load_state_dict_assign_is_detected(offload_sim):
    model = Named()
    offload_sim(model)
    new = Named()
    model.load_state_dict(new.state_dict(), assign=True)
    x = torch.randn(2, 4)
    try:
        y = model(x)
    except LayerstreamError as e:
        assert "replaced" in str(e) and "detach" in str(e)
    else:  # acceptable only if it computes with the new weights
        assert torch.equal(y, new(x))


def test_layer_subclass_with_its_own_forward_stays_resident(offload_sim):
    """A Linear/conv subclass that overrides forward (or _conv_forward) computes
    something else than the plain layer: it stays resident with a warning naming it
    (before, the streamed forward replaced it and its extra work was silently
    dropped). A subclass that only adds other methods streams."""

    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    class Plain(nn.Linear):
        def extra(self):
            return 1

    class Shifted(nn.Conv1d):
        def _conv_forward(self, x, w, b):
            return super()._conv_forward(x, w, b) + 1

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.scaled, self.plain, self.conv = Scaled(4, 4), Plain(4, 4), Shifted(1, 1, 1)

        def forward(self, x):
            return self.conv(self.plain(self.scaled(x)).unsqueeze(1)).squeeze(1)

    model = Net()
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match=r"2 Linear/conv/embedding subclass layer\(s\) with their own forward "
                                            r"stay resident.*'scaled' \(.*Scaled\); 'conv'"):
        handle = offload_sim(model)
    assert handle.layers == ["plain"]
    x = torch.randn(3, 4)
    assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("how", ["weight_norm", "spectral_norm", "prune"])
def test_layer_with_a_computed_weight_stays_resident(offload_sim, how):
    """A weight computed from other tensors (parametrizations, pruning) is not a plain
    parameter: streaming it froze one computed value, and weight_norm failed at the
    first call claiming the parameters were replaced. It stays resident with a warning;
    training matches the unmodified model."""
    from torch.nn.utils import parametrizations, prune

    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
        if how == "prune":
            prune.l1_unstructured(m[0], "weight", amount=0.5)
        else:
            getattr(parametrizations, how)(m[0])
        return m

    model, ref = make(), make()
    with pytest.warns(RuntimeWarning, match=r"1 layer\(s\) whose weight or bias is not a parameter of "
                                            r"their own .*: '0' \(weight\)"):
        handle = offload_sim(model)
    assert handle.layers == ["2"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(3, 8)
        out, want = model(x), ref(x)
        assert torch.equal(out, want)
        opt.zero_grad(), opt_r.zero_grad()
        out.square().sum().backward(), want.square().sum().backward()
        opt.step(), opt_r.step()



def _train_like_resident(model, ref, x, steps=2):
    """SGD steps on both models: outputs and every gradient equal bit for bit."""
    opt, opt_r = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(steps):
        out, want = model(x), ref(x)
        assert torch.equal(out, want)
        opt.zero_grad(), opt_r.zero_grad()
        out.square().sum().backward(), want.square().sum().backward()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert q.grad is not None and p.grad is not None and torch.equal(p.grad, q.grad), n
        opt.step(), opt_r.step()


@pytest.mark.parametrize("how", ["weight_norm", "spectral_norm", "in_proj", "pruned_in_proj"])
def test_attention_whose_out_proj_weight_is_computed_stays_resident(offload_sim, how):
    """weight_norm / spectral_norm on nn.MultiheadAttention's out_proj: the attention
    streamed as a tensor group without a word, and the parametrization's
    original0/original1 ended every backward with grad None (only the attention's own
    tensors were checked). It stays resident with the warning naming the tensor, and
    trains as the resident model does; so does one with a parametrized or pruned
    in_proj_weight. (Pruning out_proj is no case: torch's attention reads the pruned
    weight without calling out_proj, so its pre-hook never recomputes it.)"""
    from torch.nn.utils import parametrizations, parametrize, prune

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.att = nn.Linear(16, 16), nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x):
            h = self.inp(x)
            return self.att(h, h, h, need_weights=False)[0]

    def make():
        torch.manual_seed(0)
        m = Net()
        if how == "pruned_in_proj":
            prune.l1_unstructured(m.att, "in_proj_weight", amount=0.5)
        elif how == "in_proj":
            parametrize.register_parametrization(m.att, "in_proj_weight", nn.Identity())
        else:
            getattr(parametrizations, how)(m.att.out_proj)
        return m

    model, ref = make(), make()
    tensor = "in_proj_weight" if how.endswith("in_proj") else "out_proj.weight"
    with pytest.warns(RuntimeWarning, match=rf"1 layer\(s\) whose weight or bias is not a parameter of their "
                                            rf"own .*: 'att' \({tensor}\)"):
        handle = offload_sim(model)
    assert handle.layers == ["inp"]
    _train_like_resident(model, ref, torch.randn(2, 5, 16))


def _pruned_bias(layer):
    from torch.nn.utils import prune
    prune.l1_unstructured(layer, "bias", amount=0.5)


def _bias_buffer(layer):
    b = layer.bias.detach().clone()
    del layer.bias
    layer.register_buffer("bias", b)


def _weight_buffer(layer):
    w = layer.weight.detach().clone()
    del layer.weight
    layer.register_buffer("weight", w)


@pytest.mark.parametrize("how,tensor", [
    (_pruned_bias, "bias"),
    (_bias_buffer, "bias"), (_weight_buffer, "weight"),
    (lambda m: torch.nn.utils.parametrize.register_parametrization(m, "bias", nn.Identity()), "bias"),
], ids=["pruned_bias", "bias_buffer", "weight_buffer", "parametrized_bias"])
def test_layer_whose_bias_or_weight_is_not_its_own_parameter_stays_resident(offload_sim, how, tensor):
    """A pruned bias, or a weight or bias registered as a buffer: offload() streamed the
    layer without a word, then every call failed claiming its parameters "were replaced
    after offload()" (only a weight in the instance dict was looked for). It stays
    resident with the warning naming the tensor; outputs and gradients equal the
    resident model's."""
    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
        how(m[2])
        return m

    model, ref = make(), make()
    with pytest.warns(RuntimeWarning, match=rf"1 layer\(s\) whose weight or bias is not a parameter of their "
                                            rf"own .*: '2' \({tensor}\)"):
        handle = offload_sim(model)
    assert handle.layers == ["0"]
    _train_like_resident(model, ref, torch.randn(4, 8))
    handle.detach()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


def test_layers_of_a_dtype_streamed_layers_refuse_stay_resident(offload_sim):
    """A float64 (or complex) Linear/conv takes float64 (complex) input, which streamed
    layers refuse: offload() streamed them without a word and every forward then failed
    ("got a Double input"), and a complex Linear was refused as "an integer weight". They
    stay resident with a warning naming each and what to do; the rest of the model (a
    float64 table and attention stream: their dtype is theirs) streams, and training
    equals the resident model's."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 16)
            self.att = nn.MultiheadAttention(16, 2, batch_first=True)
            self.lin, self.conv = nn.Linear(16, 16), nn.Conv1d(5, 5, 3, padding=1)

        def forward(self, ids):
            h = self.emb(ids)
            return self.conv(self.lin(self.att(h, h, h, need_weights=False)[0]))

    torch.manual_seed(0)
    model = Net().double()
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match=r"2 Linear/conv layer\(s\) whose weight dtype streamed layers do not "
                                            r"compute in stay resident .*model\.float\(\).*: 'lin' \(float64\); "
                                            r"'conv' \(float64\)"):
        handle = offload_sim(model)
    assert handle.layers == ["emb", "att"]
    _train_like_resident(model, ref, torch.randint(0, 10, (2, 5)))
    handle.detach()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, dtype=torch.complex64), nn.Linear(4, 4, dtype=torch.complex64))
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match=r"'0' \(complex64\); '1' \(complex64\)"):
        with pytest.raises(LayerstreamError, match="found no Linear"):  # nothing left to stream
            offload_sim(model)
    x = torch.randn(2, 4, dtype=torch.complex64)
    assert torch.equal(model(x), ref(x))

def test_complex_tables_and_trainable_complex_group_tensors_say_why(offload_sim):
    """A complex (or integer) nn.Embedding stayed resident without a word, and a model whose
    only layer it was got "found no ... Embedding": it is now warned of, with its dtype. A
    trainable complex parameter in groups= was refused by the engine as "tensor #0 is
    undefined, or requires grad and is not a floating-point tensor"; offload() now names it
    before anything changes, and both fixes it names work (frozen, it streams as it is)."""
    model = nn.Sequential(nn.Embedding(20, 8, dtype=torch.complex64),
                          nn.Embedding.from_pretrained(torch.arange(20).view(10, 2)))
    with pytest.warns(RuntimeWarning, match=r"2 embedding layer\(s\) whose table is not floating point stay "
                                            r"resident .*: '0' \(complex64\); '1' \(int64\)"):
        with pytest.raises(LayerstreamError, match="found no Linear"):  # nothing left to stream
            offload_sim(model)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.complex64))

        def forward(self, x):
            return (self.lin(x).to(self.w.dtype) @ self.w).abs()

    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    with pytest.raises(LayerstreamError, match=r"names module '0', whose parameter '0.w' is complex64 and requires "
                                               r"grad: .*floating-point tensors only.*"
                                               r"0.w.requires_grad_\(False\).*leave '0' out of groups="):
        offload_sim(model, groups=["0"])
    assert all("forward" not in m.__dict__ for m in model.modules())
    x = torch.randn(3, 8)
    handle = offload_sim(model)  # out of groups=: its Linear streams, w stays resident
    assert handle.layers == ["0.lin", "1"]
    _train_like_resident(model, ref, x)
    handle.detach()
    model[0].w.requires_grad_(False), ref[0].w.requires_grad_(False)
    handle = offload_sim(model, groups=["0"])
    assert handle.layers == ["0", "1"]
    out, want = model(x), ref(x)
    assert torch.equal(out, want)
    out.sum().backward(), want.sum().backward()
    assert torch.equal(model[0].lin.weight.grad, ref[0].lin.weight.grad)
    handle.detach()
    assert torch.equal(model[0].w, ref[0].w)


def test_pickle_and_deepcopy_of_an_offloaded_model_are_clear_errors(offload_sim):
    """torch.save(model) / deepcopy after offload() say what to do instead (before:
    pickle's "Can't pickle local object"); the model keeps working; its state_dict saves."""
    import io
    import pickle

    model = Named()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    with pytest.raises(LayerstreamError, match=r"cannot be pickled .*state_dict\(\)"):
        torch.save(model, io.BytesIO())
    with pytest.raises(LayerstreamError, match="cannot be pickled"):
        pickle.dumps(handle)
    with pytest.raises(LayerstreamError, match=r"cannot be deep-copied.*before offload\(\)"):
        copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    ref.load_state_dict(torch.load(buf))
    x = torch.randn(2, 4)
    assert torch.equal(model(x), ref(x))


def test_functional_call_with_other_parameters_is_detected(offload_sim):
    """torch.func.functional_call swaps the parameters in for one call; a streamed layer
    would stream its own instead, so it refuses and names the call."""
    model = Named()
    offload_sim(model)
    params = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    with pytest.raises(LayerstreamError, match="functional_call"):
        torch.func.functional_call(model, params, (torch.randn(2, 4),))


def test_jit_trace_of_an_offloaded_model_is_a_clear_error(offload_sim):
    """torch.jit.trace used to record each streamed layer's device weight of that one call
    (a view of a reused slot) as a constant: the traced module computed with whatever the
    slot held later, 0.7 off on a 3-layer model, without a word. It is now an error that
    says to trace before offload() or after detach(), or to use torch.export (which records
    the layerstream operators: test_compile.py). The model still works afterwards, and
    tracing after detach() matches."""
    model = Named()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, slots=2)
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match=r"streamed layer 'small' cannot be recorded by "
                                           r"torch.jit.trace.*before offload\(\) or after handle.detach\(\)"
                                           r".*torch.export"):
        torch.jit.trace(model, x, check_trace=False)
    assert torch.equal(model(x), ref(x))
    handle.detach()
    traced = torch.jit.trace(model, x)
    x2 = torch.randn(2, 4)
    assert torch.equal(traced(x2), ref(x2))


def test_parameter_reassignment_is_detected(offload_sim):
    model = Named()
    offload_sim(model)
    model.big.weight = nn.Parameter(torch.zeros(64, 8))
    x = torch.randn(2, 4)
    try:
        y = model(x)
    except LayerstreamError as e:
        assert "'big'" in str(e)
    else:
        expected = model.out(torch.relu(model.big.bias.expand(2, 64)))
        assert torch.allclose(y, expected)


def test_compute_dtype_must_be_a_float_dtype():
    with pytest.raises(ValueError, match="compute_dtype must be"):
        layerstream.offload(nn.Linear(8, 8), device="sim", compute_dtype=torch.int8)


def test_compute_dtype_and_dequant_dtype_must_agree():
    m = nn.Linear(128, 128)
    m.requires_grad_(False)
    with pytest.raises(ValueError, match="disagree"):
        layerstream.offload(m, device="sim", quantize="int8", dequant_dtype=torch.float16,
                            compute_dtype=torch.bfloat16)


def test_budget_counts_the_compute_dtype_cast_in_each_slot():
    """The planner sizes slots as the engine lays them out: fp32 weight + bias,
    then their bf16 copies. A budget of exactly 2 such slots streams; one byte
    less is refused (2 slots of the copied bytes alone would have fit)."""
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))  # too big to keep any resident
    copied = 256 * 256 * 4 + 256 * 4
    slot = copied + 256 * 256 * 2 + 256 * 2  # all multiples of 256
    streamed = copy.deepcopy(model)
    h = layerstream.offload(streamed, device="sim", compute_dtype=torch.bfloat16, budget=2 * slot)
    with torch.no_grad():
        streamed(torch.randn(2, 256, dtype=torch.bfloat16))
    assert h.layers == ["0", "1", "2", "3"]
    assert h.stats()["slot_bytes"] == slot and h.stats()["slots"] == 2
    with pytest.raises(LayerstreamError, match="written on the device, dequantized or cast"):
        layerstream.offload(copy.deepcopy(model), device="sim", compute_dtype=torch.bfloat16,
                            budget=2 * slot - 1)


def test_cast_at_use_warns_once_and_names_compute_dtype():
    """fp32 weights with bf16 activations: one warning per handle, saying the
    cast is outside the budget and how to avoid it; none with compute_dtype,
    none when the dtypes match."""
    import warnings
    x = torch.randn(2, 8, dtype=torch.bfloat16)

    def warnings_of(model, **kw):
        layerstream.offload(model, device="sim", **kw)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with torch.no_grad():
                for _ in range(3):
                    model(x)
        return [str(m.message) for m in w if "at every use" in str(m.message)]

    got = warnings_of(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    assert len(got) == 1, got
    assert "'0'" in got[0] and "float32 weight to the bfloat16 activations" in got[0]
    assert "compute_dtype=torch.bfloat16" in got[0] and "outside the budget" in got[0]
    assert warnings_of(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), compute_dtype=torch.bfloat16) == []
    assert warnings_of(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(torch.bfloat16)) == []


def test_cast_at_use_of_a_quantized_weight_says_the_numbers_change():
    """A quantized layer dequantized to compute_dtype=bf16 and called with fp32
    activations: the warning said compute_dtype=float32 gives the same numbers, but
    then the weight is dequantized straight to fp32, no longer rounded through bf16
    (the outputs differ)."""
    import warnings
    torch.manual_seed(0)
    x = torch.randn(2, 64)
    outs, said = [], []
    for dtype in (torch.bfloat16, torch.float32):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).requires_grad_(False)
        layerstream.offload(model, device="sim", quantize="int8", compute_dtype=dtype)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with torch.no_grad():
                outs.append(model(x))
        said += [str(m.message) for m in w if "at every use" in str(m.message)]
    assert len(said) == 1, said
    assert "bfloat16 weight to the float32 activations" in said[0] and "the numbers change" in said[0], said[0]
    assert "the numbers are the same" not in said[0]
    assert not torch.equal(outs[0], outs[1])  # what the warning now says


def _sigint_once(at: int):
    """A callable that sends this process SIGINT at its `at`-th call (as a Ctrl-C
    would land: the handler runs at the next check of the running bytecode)."""
    import signal
    calls = [0]

    def maybe():
        calls[0] += 1
        if calls[0] == at:
            signal.raise_signal(signal.SIGINT)
    return maybe


def _plain(model, ref) -> bool:
    """Every Linear computes with its class's forward on its own weights, equal to `ref`'s."""
    return all("forward" not in m.__dict__ and not hasattr(m, "_layerstream_handle")
               for m in model.modules()) and all(torch.equal(p, q) for p, q in
                                                  zip(model.parameters(), ref.parameters()))


def test_a_ctrl_c_while_offload_attaches_a_layer_undoes_it_all(monkeypatch):
    """A Ctrl-C lands when a C++ call returns: in offload(), most likely right after the
    engine took a layer and before the layer is recorded. It is held until the layer is
    recorded (_interrupts.py), then offload() is undone: KeyboardInterrupt out of it, a
    plain model, and offload() works again."""
    import layerstream._attach as off
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    ref = copy.deepcopy(model)
    hit = _sigint_once(2)

    class Interrupted(off._Attached):
        def __init__(self, *args, **kw):
            hit()  # the engine holds the layer; `attached` does not yet
            super().__init__(*args, **kw)
    monkeypatch.setattr(off, "_Attached", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        layerstream.offload(model, device="sim")
    assert _plain(model, ref)
    monkeypatch.undo()
    h = layerstream.offload(model, device="sim")
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    h.detach()


@pytest.mark.parametrize("step", ["detach", "suspend"])
def test_a_ctrl_c_during_detach_or_suspend_lands_after_it(step):
    """detach()'s and suspend()'s time is mostly one C++ call: a Ctrl-C as it returns is
    raised once the modules match the engine (after detach(): a plain model that can be
    offloaded again; after suspend(): suspended, and resume() works)."""
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    ref = copy.deepcopy(model)
    h = layerstream.offload(model, device="sim")
    engine, hit = h._engine, _sigint_once(1)

    class Returning:  # the engine, whose detach()/suspend() is interrupted as it returns
        def __getattr__(self, name):
            return getattr(engine, name)

        def detach(self, devices):
            engine.detach(devices)
            hit()

        def suspend(self):
            engine.suspend()
            hit()
    h._engine = Returning()
    with pytest.raises(KeyboardInterrupt):
        getattr(h, step)()
    x = torch.randn(3, 64)
    if step == "detach":
        assert _plain(model, ref)
        h = layerstream.offload(model, device="sim")
    else:
        assert h.suspended
        h._engine = engine
        h.resume()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    h.detach()


# -------------------------------------------- a Ctrl-C as a C++ call returns
def _sigint_at(event: str, hit):
    """While the block runs: SIGINT sent to this process once, at the first `event` for
    which hit(frame, arg) holds, where CPython runs the handler of a Ctrl-C that came
    just before: 'c_return' of a C++ call (one that came during it: a profile hook),
    'line' of a Python line (a trace hook). signal.raise_signal runs the handler at
    once: an exception then replaces the call's result or the line, as a real Ctrl-C's
    would. Yields a list that holds True once it was sent."""
    import contextlib
    import signal
    import sys
    sent = []

    def hook(frame, ev, arg):
        if not sent and ev == event and hit(frame, arg):
            sent.append(True)
            (sys.settrace if event == "line" else sys.setprofile)(None)
            signal.raise_signal(signal.SIGINT)
        return hook

    @contextlib.contextmanager
    def block():
        install = sys.settrace if event == "line" else sys.setprofile
        install(hook)
        try:
            yield sent
        finally:
            install(None)
    return block()


def _returning(name):
    return lambda frame, arg: getattr(arg, "__name__", "") == name


class _Attending(nn.Module):
    """nn.MultiheadAttention layers: tensor groups (their own forward runs on the
    parameters swapped for a fetched slot's views, _GroupForward.fetched)."""

    def __init__(self, d=32, n=4):
        super().__init__()
        self.att = nn.ModuleList(nn.MultiheadAttention(d, 4, batch_first=True) for _ in range(n))

    def forward(self, x):
        for a in self.att:
            x = a(x, x, x, need_weights=False)[0]
        return x


def _group_swap_back(frame, arg):
    """The first line of _GroupForward.fetched's swap back, while the module holds the
    fetched views."""
    import linecache
    fwd = frame.f_locals.get("self") if frame.f_code.co_name == "fetched" else None
    return (fwd is not None and linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            == "o._parameters[k] = p"
            and all(o._parameters[k] is not p for (o, k), p in zip(fwd._slots, fwd._params)))


@pytest.mark.parametrize("where", ["fetch returns", "the swap back begins"])
def test_a_ctrl_c_in_a_tensor_group_call_lands_after_its_slot_is_released(offload_sim, where):
    """A Ctrl-C as Engine.fetch() returned (most of a tensor group's time outside its
    forward) dropped the slot's token, never released: after as many interrupts as
    slots every call raised "all N device slots are held at once" and detach() refused
    for ever. One as the swap back began left the module holding views of the freed
    slot: every later call raised "parameters ... were replaced". Held now
    (_interrupts.py): raised after the call, and the next calls and detach() work."""
    model = _Attending().eval().requires_grad_(False)
    ref = copy.deepcopy(model)
    h = offload_sim(model)
    assert h.stats()["group_layers"] == 4
    x = torch.randn(2, 5, 32)
    hit = _returning("fetch") if where == "fetch returns" else _group_swap_back
    for _ in range(4):  # more than the slots
        with _sigint_at("c_return" if where == "fetch returns" else "line", hit) as sent, \
                pytest.raises(KeyboardInterrupt), torch.no_grad():
            model(x)
        assert sent
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
    h.detach()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("opt", ["AdamW", "Adafactor"])
@pytest.mark.parametrize("at", [0, 2])
def test_a_ctrl_c_as_the_optimizer_kernel_returns_lands_after_the_step_is_counted(opt, at):
    """layerstream.optim's step is one C++ kernel call per group, and a Ctrl-C is raised
    as it returns: the update was applied but the counts stayed behind it (the first
    step's states dropped), so every later step's bias correction was off, silently.
    Held now: raised once the counts match the update, and training goes on as an
    uninterrupted run (equal numbers, equal counts)."""
    import layerstream.optim as lo
    torch.manual_seed(0)
    init, grads = torch.randn(64, 32), [torch.randn(64, 32) for _ in range(4)]
    kernel = {"AdamW": "optim_adamw_step", "Adafactor": "optim_adafactor_step"}[opt]

    def train(interrupt_at=None):
        p = nn.Parameter(init.clone())
        o = lo.AdamW([p], lr=1e-2) if opt == "AdamW" else lo.Adafactor([p])
        for i, g in enumerate(grads):
            p.grad = g.clone()
            if i != interrupt_at:
                o.step()
                continue
            before = p.detach().clone()
            with _sigint_at("c_return", _returning(kernel)) as sent, pytest.raises(KeyboardInterrupt):
                o.step()
            assert sent and not torch.equal(before, p.detach())  # the kernel's update was applied
            assert int(o.state[p]["step"]) == i + 1  # and counted
        return p.detach(), int(o.state[p]["step"]), o.state_dict()

    want, steps, want_state = train()
    got, got_steps, got_state = train(at)
    assert steps == got_steps == 4
    assert torch.equal(got, want)
    for k, v in want_state["state"][0].items():
        assert torch.equal(torch.as_tensor(got_state["state"][0][k]), torch.as_tensor(v)), k


def test_freeing_a_graph_runs_no_python_code_to_release_its_stashed_activations(offload_sim):
    """offload(activations="host"): a Python __del__ (_Saved) dropped each stashed
    activation's token as autograd freed the graph. A Ctrl-C landing there raised its
    KeyboardInterrupt inside __del__, which Python swallows ("Exception ignored in ...")
    before the drop: the host copy leaked, one per interrupt (a probe's run grew the pool
    from 4 to 48 MiB over 1,400 steps). The token is a C++ object now (StashedActivation),
    dropped by its destructor: freeing the graph runs no layerstream Python code, in which
    a Ctrl-C could land, and the host bytes come back."""
    import gc
    import sys
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.GELU())])
    h = offload_sim(model, activations="host")
    x = torch.randn(256, 64)
    model(x).sum().backward()
    gc.collect()
    held = h.stats()["activation_host_bytes"]
    loss = model(x).sum()
    ran = []

    def trace(frame, event, arg):
        if "layerstream" in frame.f_code.co_filename and "tests" not in frame.f_code.co_filename:
            ran.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.settrace(trace)
    try:
        del loss  # the graph, and its saved activations
    finally:
        sys.settrace(None)
    gc.collect()
    assert not ran, ran
    assert h.stats()["activation_host_bytes"] == held


def test_a_ctrl_c_as_an_activation_is_stashed_does_not_leak_its_host_copy(offload_sim):
    """offload(activations="host"): a Ctrl-C as Engine.stash_activation() returned
    (most of the pack hook's time) dropped its token before a _Saved owned it: that
    activation's host copy was never released, one more per interrupt. Held now: the
    host bytes come back to their value, and training is unchanged."""
    import gc
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.GELU())])
    ref = copy.deepcopy(model)
    h = offload_sim(model, activations="host")
    x = torch.randn(256, 64)  # big enough to leave the device (smaller ones may stay)

    def clean():
        model(x).sum().backward()
        ref(x).sum().backward()
        gc.collect()

    clean()
    held = h.stats()["activation_host_bytes"]
    assert held > 0
    for _ in range(3):
        with _sigint_at("c_return", _returning("stash_activation")) as sent, pytest.raises(KeyboardInterrupt):
            model(x).sum().backward()
        assert sent
        gc.collect()
        clean()
        assert h.stats()["activation_host_bytes"] == held
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
