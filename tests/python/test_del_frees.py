"""An offloaded model is freed by reference counting, as a resident one is: Note [Nothing
offload() puts on a model refers back to it] (_handle.py). Every test runs with Python's
cyclic garbage collector off, so only reference counting frees anything."""
import contextlib
import copy
import gc
import os
import weakref

import pytest
import torch
import torch.nn as nn

import layerstream


@contextlib.contextmanager
def _no_gc():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _threads() -> int:
    """The process's threads (the engine's C++ ones too)."""
    return len(os.listdir("/proc/self/task"))


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")


class Block(nn.Module):
    """An embedding table, an attention (a tensor group) and Linears."""

    def __init__(self, d=32):
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.att = nn.MultiheadAttention(d, 4, batch_first=True)
        self.l1, self.l2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, ids):
        x = self.emb(ids)
        return self.l2(torch.relu(self.l1(self.att(x, x, x, need_weights=False)[0])))


def _model(kind):
    if kind == "block":
        return Block(), torch.randint(0, 50, (2, 5))
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    return model, torch.randn(3, 64)


# (model, offload options): the planner keeps some layers resident and streams the others;
# the tensor groups, the table, quantized layers (a resident one too), saved activations.
CASES = {
    "linears": ("linears", dict(budget="60KiB", prefetch=1)),
    "groups-and-table": ("block", {}),
    "quantized": ("linears", dict(budget="60KiB", quantize="int8")),
    "activations": ("linears", dict(activations="host")),
}


def _train(model, x, steps=3):
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.1) if trainable else None
    outs = []
    for _ in range(steps):
        out = model(x)
        outs.append(out.detach().clone())
        if opt is not None:
            out.pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    return opt, outs


@needs_proc
@pytest.mark.parametrize("case", sorted(CASES))
def test_dropping_the_model_its_optimizer_and_handle_frees_the_engine_without_gc(case):
    """Before, the model referred to itself through what offload() installs on it (its
    _RootApply and _NoToEmpty, the call hooks' _AddedTensorsFollow, the layers' forwards
    and records): `del model, opt, handle` freed nothing until the cyclic collector ran,
    so each model kept its engine's 4 threads, its host store and gradient staging (on a
    GPU, its device slots): a sweep over 30 models held 91 threads."""
    kind, options = CASES[case]
    model, x = _model(kind)
    if options.get("quantize"):
        model.requires_grad_(False)  # quantized weights are frozen
    ref = copy.deepcopy(model)
    _, expected = _train(ref, x)  # the resident run first: torch's threads are up before counting
    with _no_gc():
        before = _threads()
        handle = layerstream.offload(model, device="sim", **options)
        opt, outs = _train(model, x)
        if not options.get("quantize"):
            for a, b in zip(outs, expected):
                assert torch.equal(a, b)
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p.detach(), q.detach()), n
        assert handle.ordering_errors() == []
        assert _threads() > before  # the engine's
        gone = [weakref.ref(o) for o in (model, handle, handle._engine)]
        del model, opt, handle, outs
        assert [r() is None for r in gone] == [True] * 3
        assert _threads() == before


@needs_proc
def test_a_model_whose_handle_was_not_kept_is_freed_with_it():
    """offload(model) on its own line (the handle reachable from the layers'
    _layerstream_handle): dropping the model and its optimizer freed nothing until the
    cyclic collector ran."""
    model, x = _model("linears")
    with _no_gc():
        before = _threads()
        layerstream.offload(model, device="sim", budget="60KiB", prefetch=1)
        opt, _ = _train(model, x)
        streamed = next(m for m in model if "_layerstream_handle" in m.__dict__)
        engine = weakref.ref(streamed._layerstream_handle._engine)
        del streamed
        del model, opt
        assert engine() is None
        assert _threads() == before


def test_a_model_kept_without_its_handle_keeps_streaming_and_can_be_detached():
    """The model keeps its handle and engine: dropping the handle (and collecting
    whatever is garbage) changes nothing; the handle is still reachable from the layers."""
    model, x = _model("block")
    ref = copy.deepcopy(model)
    with _no_gc():
        handle = layerstream.offload(model, device="sim")
        engine = weakref.ref(handle._engine)
        del handle
        gc.collect()
        assert engine() is not None
        _, outs = _train(model, x)
        _, expected = _train(ref, x)
        for a, b in zip(outs, expected):
            assert torch.equal(a, b)
        model.l1._layerstream_handle.detach()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.detach(), q.detach()), n
        assert "forward" not in model.l1.__dict__ and "_apply" not in model.__dict__
        del model
        assert engine() is None


def test_a_handle_kept_without_its_model_keeps_the_engine_until_detach():
    """The handle holds the engine, not the model: the model goes when dropped; the
    handle's stats() still answer, and its detach() lets the engine go."""
    model, x = _model("linears")
    with _no_gc():
        handle = layerstream.offload(model, device="sim", budget="60KiB", prefetch=1)
        _train(model, x)
        steps = handle.stats()["steps"]
        gone = weakref.ref(model)
        del model
        assert gone() is None
        assert handle.stats()["steps"] == steps and handle.plan is not None
        engine = weakref.ref(handle._engine)
        handle.detach()
        assert engine() is None


def _moe_with_param_lora(transformers, peft, after_offload: bool, **options):
    """A transformers MoE (its experts a tensor group) with peft's LoRA on the experts'
    3-D tensors (target_parameters), before or after offload(); and its resident twin."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    base = transformers.Qwen3MoeForCausalLM(cfg)

    def lora(m):
        torch.manual_seed(1)
        return peft.get_peft_model(m, peft.LoraConfig(
            r=2, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            init_lora_weights=False))

    ref = lora(copy.deepcopy(base))
    if after_offload:
        handle = layerstream.offload(base, device="sim", **options)
        return lora(base), handle, ref
    model = lora(base)
    return model, layerstream.offload(model, device="sim", **options), ref


@pytest.mark.parametrize("after_offload", [False, True], ids=["lora-then-offload", "offload-then-lora"])
def test_a_model_with_peft_lora_on_a_groups_tensors_is_freed_without_gc(after_offload):
    """peft's LoRA on a streamed group's tensors (_peft_params.py): the patched wrapper's
    _activate_lora was a partial holding the wrapper (a cycle), and the handle's record
    (Installed) held the wrappers strongly: `del model, handle` kept the wrappers, the
    experts under them, the handle and its engine until gc, and a handle kept held the
    model's wrappers. Now the model goes at once; a handle kept keeps the engine only."""
    # Imported here, not in a helper: an import that keeps a traceback (bitsandbytes') keeps
    # the frames it ran under, and so a helper's locals.
    transformers, peft = pytest.importorskip("transformers"), pytest.importorskip("peft")
    transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig  # noqa: B018 (imported lazily)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    with _no_gc():
        model, handle, ref = _moe_with_param_lora(transformers, peft, after_offload)
        loss, expected = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
        assert torch.equal(loss, expected)
        loss.backward(), expected.backward()
        del loss, expected
        wrappers = [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]
        assert wrappers and all("_activate_lora" in w.__dict__ for w in wrappers)
        gone = [weakref.ref(o) for o in [model, handle, handle._engine] + wrappers]
        del wrappers, model, handle
        assert [r() is None for r in gone] == [True] * len(gone)

        model, handle, _ = _moe_with_param_lora(transformers, peft, after_offload)
        model(input_ids=ids)
        gone = [weakref.ref(m) for m in model.modules() if type(m).__name__ == "ParamWrapper"]
        del model
        assert [r() is None for r in gone] == [True] * len(gone)
        engine = weakref.ref(handle._engine)
        handle.detach()
        assert engine() is None


class _Recovery(nn.Module):
    """An accuracy-recovery adapter as compat sees one (ai-toolkit's, less its own cycle):
    it keeps the layer's forward as org_forward; the layer points back to it weakly."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.up = nn.Linear(layer.in_features, layer.out_features, bias=False)
        self.org_forward = layer.forward
        layer.ara_lora_ref = weakref.ref(self)

    def forward(self, x):
        return self.org_forward(x) + self.up(x)


@needs_proc
@pytest.mark.parametrize("how", ["attach", "attach-then-to-bfloat16", "one-by-one", "recovery-adapters"])
def test_a_model_attached_by_compat_is_freed_without_gc(how):
    """layerstream.compat: the manager held its model (module, managed), the layers'
    records held their layers, adapters and bound forwards, the manager its records and
    its call hooks a lambda over it: `del model, mgr` kept the model, the engine and its
    threads until gc. Now they go at once (the adapters, which keep their layers as
    before attach, with the adapters); a layer attached one by one keeps its manager."""
    from layerstream.compat import LinearLayerMemoryManager, MemoryManager

    torch.manual_seed(0)
    model, x = _model("linears")
    ref = copy.deepcopy(model)
    if how == "attach-then-to-bfloat16":
        ref.to(torch.bfloat16)
    # The resident run first: torch's threads are up before counting, and what its first
    # optimizer imports (keeping the frames it ran under) is imported.
    _, expected = _train(ref, x.to(torch.bfloat16) if how == "attach-then-to-bfloat16" else x)
    with _no_gc():
        before = _threads()
        adapters = []
        if how == "one-by-one":
            mgr = MemoryManager(model, "cpu")
            LinearLayerMemoryManager.attach(model[0], mgr)
            LinearLayerMemoryManager.attach(model[1], mgr)
            del mgr  # the layers keep it
        else:
            if how == "recovery-adapters":
                torch.manual_seed(1)
                adapters = [_Recovery(layer) for layer in model]
                torch.manual_seed(1)
                ref_adapters = [_Recovery(layer) for layer in ref]
            mgr = MemoryManager.attach(model, torch.device("cpu"), offload_percent=0.5)
        if how == "attach-then-to-bfloat16":
            model.to(torch.bfloat16)
            x = x.to(torch.bfloat16)
        _, outs = _train(model, x)
        for a, b in zip(outs, expected):
            assert torch.equal(a, b)
        for a, b in zip(adapters, ref_adapters if adapters else []):
            with torch.no_grad():
                assert torch.equal(a(x), b(x))
        assert _threads() > before
        engine = weakref.ref(model[0]._layer_memory_manager.manager.engine)
        gone = [weakref.ref(o) for o in [model] + list(model)]
        del model, outs
        if adapters:
            assert engine() is not None and all(r() is not None for r in gone[1:])  # the adapters hold theirs
            del adapters, a, b
        mgr = None
        assert [r() is None for r in gone] == [True] * len(gone)
        assert engine() is None
        assert _threads() == before


def test_holding_signals_leaves_nothing_to_the_cyclic_collector():
    """Every block that holds signals (offload(), detach(), and on the hot paths each
    group fetch, saved activation, call turn: _interrupts.py) made a HeldSignals that kept
    its recorder, a bound method of itself: a cycle, so each was left to the cyclic
    collector (5 per offload(), more per step). Now none outlives its block."""
    from layerstream._interrupts import HeldSignals, held_interrupts

    def held() -> int:
        return sum(type(o) is HeldSignals for o in gc.get_objects())

    model, x = _model("block")
    ref = copy.deepcopy(model)
    _, expected = _train(ref, x)
    with _no_gc():
        gc.collect()
        before = held()
        with held_interrupts() as received:
            assert received == []
        handle = layerstream.offload(model, device="sim", activations="host")
        _, outs = _train(model, x)
        for a, b in zip(outs, expected):
            assert torch.equal(a, b)
        handle.detach()
        del handle
        assert held() == before
