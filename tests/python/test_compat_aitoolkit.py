"""layerstream.compat driven the way ai-toolkit drives the original: its call sites
(attach with offload_percent and ignore_modules holding modules and parameters),
its LoRA and accuracy-recovery wrappers, .to() after attach, detach; always
against the unoffloaded model. Quantized models: test_compat_quantized.py."""
import pytest
import torch
import torch.nn as nn

from aitoolkit_like import Ara, LoRA, Toy
from layerstream import LayerstreamError
from layerstream.compat import LinearLayerMemoryManager, MemoryManager


def toy():
    torch.manual_seed(0)
    return Toy()


def streamed_names(model):
    return [n for n, m in model.named_modules() if hasattr(m, "_layer_memory_manager")]


def x_input(dtype=torch.float32):
    torch.manual_seed(1)
    return torch.randn(2, 5, 32, dtype=dtype)


def test_ignore_modules_holds_modules_and_parameters():
    """ai-toolkit passes parameters (e.g. a scale-shift table, a layer's weight) in
    ignore_modules next to modules: a layer owning an ignored parameter stays
    resident, a free parameter is accepted; the output equals the resident model's."""
    model, ref = toy(), toy()
    mgr = MemoryManager.attach(model, torch.device("cpu"), offload_percent=1.0,
                               ignore_modules=[model.proj_in, model.scale_shift_table,
                                               model.blocks[1].down.weight])
    assert streamed_names(model) == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "proj_out"]
    assert model.scale_shift_table in mgr.unmanaged_modules
    x = x_input().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y, yr = model(x), ref(xr)
    assert torch.equal(y, yr)
    y.square().sum().backward()
    yr.square().sum().backward()
    assert torch.equal(x.grad, xr.grad)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_ignore_modules_of_another_kind_is_a_clear_error():
    model = toy()
    with pytest.raises(TypeError, match=r"ignore_modules\[1\] is a str"):
        MemoryManager.attach(model, "cpu", ignore_modules=[model.proj_in, "proj_out"])
    assert not hasattr(model, "_memory_manager") and streamed_names(model) == []


@pytest.mark.parametrize("percent", [0.0, 0.3, 0.6, 1.0])
def test_offload_percent_streams_part_of_the_model(percent):
    model, ref = toy(), toy()
    mgr = MemoryManager.attach(model, "cpu", offload_percent=percent, ignore_modules=[model.proj_in])
    names = streamed_names(model)
    # Largest first (ties by name): the two "up" layers, then a "down" one, ...
    assert len(names) == {0.0: 0, 0.3: 2, 0.6: 3, 1.0: 5}[percent]
    assert all(m in mgr.unmanaged_modules for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and n not in names and m is not model.proj_in)
    with torch.no_grad():
        assert torch.equal(model(x_input()), ref(x_input()))


def test_linear_subclass_with_its_own_forward_is_never_streamed():
    """The original streams classes by name and replaces their forward; a Linear
    subclass with its own forward (here: a scale of 3, the case that came out off by
    a factor) keeps it: resident, named in a warning, its output the resident one's.
    A subclass without a forward of its own streams."""
    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 3.0

    class Plain(nn.Linear):
        pass

    def build():
        torch.manual_seed(0)
        return nn.Sequential(Scaled(8, 8), nn.ReLU(), Plain(8, 8), nn.ReLU(), nn.Linear(8, 4))

    model, ref = build(), build()
    with pytest.warns(RuntimeWarning, match=r"own forward.*'0' \(.*Scaled\)"):
        MemoryManager.attach(model, "cpu")
    assert streamed_names(model) == ["2", "4"]
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    with pytest.raises(LayerstreamError, match="own forward"):
        LinearLayerMemoryManager.attach(build()[0], model._memory_manager)


def test_wrapped_forward_that_is_not_an_adapter_stays_resident():
    model, ref = toy(), toy()
    inner = model.proj_out.forward
    model.proj_out.forward = lambda x: inner(x) * 2  # e.g. a hook library's wrapper
    ref_inner = ref.proj_out.forward
    ref.proj_out.forward = lambda x: ref_inner(x) * 2
    with pytest.warns(RuntimeWarning, match="replaced on the instance.*'proj_out'"):
        MemoryManager.attach(model, "cpu")
    assert "proj_out" not in streamed_names(model)
    with torch.no_grad():
        assert torch.equal(model(x_input()), ref(x_input()))


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("wrapper", [LoRA, Ara], ids=["lora", "ara"])
def test_lora_and_ara_wrappers_train_like_the_resident_model(wrapper, when):
    """A LoRA module (org_forward = the layer's forward, the layer's forward = its own)
    or an accuracy-recovery adapter (ara_lora_ref), applied before attach (compat
    replaces the adapter's org_forward) or after (it wraps the streamed forward): the
    output and the adapters' gradients equal the resident model's, and the base layers
    really stream."""
    model, ref = toy(), toy()
    model.requires_grad_(False)
    ref.requires_grad_(False)

    def adapters(m):
        out = []
        for i, layer in enumerate(b.up for b in m.blocks):
            torch.manual_seed(10 + i)
            out.append(wrapper(layer))
        return out

    mine, theirs = adapters(model), adapters(ref)
    for a in theirs:
        a.apply_to()
    if when == "before":
        for a in mine:
            a.apply_to()
    mgr = MemoryManager.attach(model, "cpu", offload_percent=1.0, ignore_modules=[model.scale_shift_table])
    if when == "after":
        for a in mine:
            a.apply_to()
    assert streamed_names(model) == ["proj_in", "blocks.0.up", "blocks.0.down", "blocks.1.up",
                                     "blocks.1.down", "proj_out"]
    x = x_input()
    y, yr = model(x), ref(x)
    assert torch.equal(y, yr)
    assert mgr.stats()["acquires"] == 6  # every base layer went through the engine
    y.square().mean().backward()
    yr.square().mean().backward()
    for a, b in zip(mine, theirs):
        assert torch.equal(a.lora_down.weight.grad, b.lora_down.weight.grad)
        assert torch.equal(a.lora_up.weight.grad, b.lora_up.weight.grad)
    MemoryManager.detach(model)
    with torch.no_grad():  # the adapters still wrap the layers' own forwards
        assert torch.equal(model(x), ref(x))


def test_to_dtype_after_attach_works_like_memory_managed_to():
    """ai-toolkit calls model.to(device, dtype=...) after attach (the original's
    memory_managed_to): everything converts, the streamed layers too, which stream
    again in the new dtype; the output equals the resident model converted alike."""
    model, ref = toy(), toy()
    mgr = MemoryManager.attach(model, torch.device("cpu"), ignore_modules=[model.proj_in])
    assert model.to(torch.device("cpu"), dtype=torch.bfloat16) is model
    ref.to(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert streamed_names(model) == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down",
                                     "proj_out"]
    x = x_input(torch.bfloat16)
    with torch.no_grad():
        y = model(x)
    assert torch.equal(y, ref(x))
    bf16_bytes = mgr.stats()["h2d_bytes"]
    streamed_params = sum(p.numel() for n in streamed_names(model)
                          for p in model.get_submodule(n).parameters())
    assert bf16_bytes >= 2 * streamed_params and bf16_bytes < 4 * streamed_params  # 2 bytes each now
    model.to(dtype=torch.float32)  # and back
    ref.to(torch.float32)
    with torch.no_grad():
        assert torch.equal(model(x.float()), ref(x.float()))
    assert mgr.engine.ordering_errors() == []


def test_other_conversions_after_attach_fail_before_changing_anything():
    """model.half() (or a parent's .to(dtype)) reaches the streamed layers through
    _apply: refused before any parameter changed, naming what compat users can do."""
    model, ref = toy(), toy()
    MemoryManager.attach(model, "cpu")
    before = [(p, p.dtype) for p in model.parameters()]
    with pytest.raises(LayerstreamError, match=r"MemoryManager\.detach\(model\)"):
        model.half()
    parent = nn.Sequential(model)
    with pytest.raises(LayerstreamError, match=r"model\.to\(dtype\)"):
        parent.to(torch.float16)
    assert [(p, p.dtype) for p in model.parameters()] == before
    with torch.no_grad():
        assert torch.equal(model(x_input()), ref(x_input()))


def test_to_a_device_moves_what_is_not_streamed_only():
    model, ref = toy(), toy()
    MemoryManager.attach(model, "cpu", offload_percent=0.5)
    weights = {n: p for n, p in model.named_parameters()}
    assert model.to("cpu") is model
    assert {n: p for n, p in model.named_parameters()} == weights
    with torch.no_grad():
        assert torch.equal(model(x_input()), ref(x_input()))


def test_to_the_cpu_frees_the_slots_and_back_to_the_gpu_resumes():
    """ai-toolkit's low-VRAM sampling moves models to the CPU and back: on a model
    attached for a GPU, model.to("cpu") also suspends the engine (its slots freed;
    the original kept no device memory there) and a move back to that device
    resumes it. Here the engine computes on the host (sim), so it is made to report
    another compute device (meta)."""
    model, ref = toy(), toy()
    mgr = MemoryManager.attach(model, "cpu")

    class Elsewhere:  # the engine, reporting a compute device other than the host
        compute_device = "meta"

        def __init__(self, engine):
            self._engine = engine

        def __getattr__(self, name):
            return getattr(self._engine, name)

    engine = mgr.engine
    mgr.engine = Elsewhere(engine)
    assert model.to("cpu") is model
    assert engine.suspended and engine.stats()["device_bytes"] == 0
    with pytest.raises(LayerstreamError, match=r"suspended.*model\.to\(<compute device>\)"):
        with torch.no_grad():
            model(x_input())
    # Back to the compute device: resumed first, then the rest moves (which torch
    # refuses here: a CPU parameter's data cannot become a meta tensor).
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        model.to("meta")
    assert not engine.suspended and engine.stats()["device_bytes"] > 0
    mgr.engine = engine
    with torch.no_grad():
        assert torch.equal(model(x_input()), ref(x_input()))
    MemoryManager.detach(model)


def test_detach_undoes_attach_and_a_new_attach_works():
    model, ref = toy(), toy()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    MemoryManager.attach(model, "cpu", offload_percent=0.7, ignore_modules=[model.proj_in])
    with torch.no_grad():
        model(x_input())
    MemoryManager.detach(model)
    assert not hasattr(model, "_memory_manager")
    assert "to" not in model.__dict__ and "_apply" not in model.__dict__
    for m in model.modules():
        assert not {"forward", "_apply", "_layer_memory_manager", "_memory_management_device"} & set(m.__dict__)
    for n, p in model.named_parameters():
        assert type(p) is nn.Parameter and not hasattr(p, "_is_memory_managed")
        assert torch.equal(p, weights[n]) and p.device == weights[n].device, n
    x = x_input()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    model.double()  # an ordinary module again (and back, exactly)
    model.float()
    MemoryManager.detach(model)  # not attached: nothing to do
    mgr = MemoryManager.attach(model, "cpu")
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    assert mgr.stats()["acquires"] == 6


def test_detach_keeps_an_adapter_applied_before_attach():
    """A layer whose forward was an adapter's keeps that adapter after detach, its
    org_forward the layer's own forward again."""
    model, ref = toy(), toy()
    lora, ref_lora = LoRA(model.proj_out), LoRA(ref.proj_out)
    ref_lora.load_state_dict(lora.state_dict())
    lora.apply_to()
    ref_lora.apply_to()
    MemoryManager.attach(model, "cpu")
    MemoryManager.detach(model)
    assert model.proj_out.forward == lora.forward and lora.org_forward.__func__ is nn.Linear.forward
    with torch.no_grad():
        assert torch.equal(model(x_input()), ref(x_input()))


def test_a_call_that_skips_the_first_streamed_layer_still_begins_a_step():
    """As with offload() (test_training.py): attach() hooks the model, so a call that
    skips the layer the steps began with (a conditional first block) does not reuse the
    weights the call before left in the slots; a write through `.data` between two
    inference calls (what ai-toolkit's EMA or a merged adapter does) is seen."""
    import copy

    from conftest import FirstLayerSometimes, assert_data_writes_between_calls_are_seen

    torch.manual_seed(0)
    model = FirstLayerSometimes(d=32, n=3)
    ref = copy.deepcopy(model)
    mgr = MemoryManager.attach(model, torch.device("cpu"), slots=6)  # every layer stays in its slot
    assert_data_writes_between_calls_are_seen(model, ref, x_input(), layer=0)
    assert mgr.stats()["steps"] == 4
    MemoryManager.detach(model)
    assert not model._forward_pre_hooks
