"""Drop-in API of the original memory manager (RamTorch-derived, ai-toolkit's
``toolkit.memory_management``), on layerstream.

Code written for the original system keeps working::

    from layerstream.compat import MemoryManager
    MemoryManager.attach(model, torch.device("cuda"), offload_percent=0.5,
                         ignore_modules=[model.head, model.scale_shift_table])
    model.to(device, dtype=torch.bfloat16)   # the original's memory_managed_to
    ...
    MemoryManager.detach(model)              # undoes attach()

Observable behaviour kept from the original:
  * ``MemoryManager.attach(module, device, offload_percent=1.0, ignore_modules=[])``
    sets ``module._memory_manager`` and manages the Linear / conv layers below
    it; ``ignore_modules`` holds modules (with everything below them) and
    parameters (the layer owning one stays resident); both stay on the device;
  * after attach, ``module.to(...)`` is ``MemoryManager.memory_managed_to``:
    what is not streamed moves / converts as ``nn.Module.to`` would; the
    streamed weights stay in host memory, and a dtype converts them too (they
    are streamed again in the new dtype; float64 and complex, which streamed
    layers do not compute in, are refused);
  * ``MemoryManager.detach(module)`` undoes attach: the original forwards, the
    streamed weights as ordinary tensors where they were before attach, the
    original ``.to``; what attach moved to the device stays there;
  * ``LinearLayerMemoryManager.attach(m, manager)`` / ``ConvLayerMemoryManager.attach(m, manager)``
    attach one layer (a second attach of the same module is a no-op), tag its
    parameters ``_is_memory_managed = True`` and set
    ``m._memory_management_device``;
  * a call with extra arguments falls back to the module's original forward;
  * a layer exposing ``ara_lora_ref()`` (an accuracy-recovery adapter) gets that
    adapter's ``org_forward`` replaced instead of its own ``forward``; so does a
    layer whose forward a LoRA wrapper replaced (``module.forward`` is the
    wrapper's, the wrapper's ``org_forward`` the layer's own), as ai-toolkit's
    LoRA modules do; a wrapper added after attach calls the streamed forward;
  * quantized weights stream packed and are dequantized on the device:
    optimum-quanto qint8 / qfloat8 (frozen ``QLinear``, weight-only), torchao
    int8 / float8 weight-only tensors, torch qint8, int8 with ``weight_scale``.
    The layer computes what the library computes (_prequant._library_linear):
    its output equals the resident quantized model's, except quanto's CPU
    kernels for bfloat16 x int8 (torch._weight_int8pack_mm), which round
    differently from quanto's own GPU path that layerstream follows.

Class rules and safety (the original manages ``Linear``, ``LoRACompatibleLinear``,
``QLinear``, ``Conv2d``, ``LoRACompatibleConv``, ``QConv2d`` by class name and
replaces their forward): a layer streams only when the streamed op computes
what its forward computes, by the rule offload() uses
(_discovery._resident_reason, _activation_dtype); a Linear / conv subclass with its own forward
(``LoRACompatibleLinear``, ``QConv2d``, your own), a wrapped forward that is
not an adapter's ``org_forward``, a float64 or complex weight, a quantized
weight layerstream does not know, stays resident on the device and is named in one warning per reason.
No forward is dropped.

Differences (fixes): ``offload_percent`` picks layers by bytes, largest
first, deterministically (ties by name), not at random; weights are
prefetched in the traced order; gradients are complete when backward
returns; quantized weights stream frozen (no weight gradient; a warning says
so when one requires grad); a CPU ``device`` runs on layerstream's simulated
device; a model already offloaded by ``layerstream.offload()`` is refused (one
model, one handle), as offload() refuses a model attached here; an adapter's
own layers (``ara_lora_ref()``) stay resident rather than being streamed;
the manager and the layers' records (``manager.module``, ``managed``,
``unmanaged_modules``) refer to the model weakly, so a dropped model goes
with its engine at once (Note [A model attached here is freed with its last
reference]).
"""
from __future__ import annotations

import types
import warnings
import weakref
from typing import Iterable, List, Optional

import torch
import torch.nn as nn

from . import _C, _peft_params
from ._discovery import (_RESIDENT_REASONS, _activation_dtype, _conv_args, _dora_layers, _is_diffusers_gguf,
                         _is_streamable, _pad_for_mode, _resident_label, _resident_reason, _takes_activations, _warn_resident)
from ._file_weight import FileWeight
from ._forward import _RefusesCopy
from ._guards import _RootApply, _StreamedApply, _is_compute, install_subtree_checks, remove_subtree_checks
from ._calls import CallHooks
from ._attach import _move_resident
from ._prequant import _library_linear, _prequantized

LayerstreamError = _C.LayerstreamError

__all__ = ["MemoryManager", "LinearLayerMemoryManager", "ConvLayerMemoryManager",
           "BaseLayerMemoryManager"]

# What a refused model.half() / parent.to(dtype) tells compat users to do.
_REMEDY = ("Call model.to(dtype) on the model given to MemoryManager.attach (it streams the "
           "layers again in that dtype), or MemoryManager.detach(model) first.")


def _engine_device(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return str(device) if device.index is not None else "cuda"
    if device.type == "cpu":
        return "sim"
    raise ValueError(f"layerstream.compat: unsupported device {device}; use cuda or cpu")


def _adapter_of(module: nn.Module):
    """The adapter whose ``org_forward`` is this layer's own forward: an
    accuracy-recovery adapter (``module.ara_lora_ref()``), or a LoRA wrapper that
    replaced ``module.forward`` by its own bound method and kept the layer's
    forward as ``org_forward``. None when there is none (or it is not the layer's
    own forward, e.g. wrappers stacked on wrappers)."""
    if hasattr(module, "ara_lora_ref"):
        adapter = module.ara_lora_ref()
    else:
        adapter = getattr(module.__dict__.get("forward"), "__self__", None)
    org = getattr(adapter, "org_forward", None) if adapter is not None else None
    if (getattr(org, "__self__", None) is module
            and getattr(org, "__func__", None) is type(module).forward):
        return adapter
    return None


def _is_quanto_qlinear(module: nn.Module) -> bool:
    fwd = type(module).forward
    return (getattr(fwd, "__module__", "") == "optimum.quanto.nn.qlinear"
            and getattr(fwd, "__qualname__", "") == "QLinear.forward")


# The reasons _resident_reason() gives, as the sentence compat's warning shows (the others:
# offload()'s own sentence, _RESIDENT_REASONS).
_REASON_TEXT = {
    "computed": "its weight is computed (parametrize, pruning) or a plain tensor attribute",
    "custom": "a Linear/conv subclass with its own forward, which a streamed layer would drop",
    "wrapped": "its forward was replaced on the instance (a wrapper the streamed forward would drop)",
    "dora": "a base layer of a peft adapter that reads its weights directly (DoRA, HRA, ...)",
    "cast_trainable": "a trainable layer under diffusers' layerwise casting (frozen ones stream)",
    "diffusers_gguf": "a diffusers GGUF layer (layerstream.offload() streams it, as a tensor group)",
    "dtype": ("its weight is float64 or complex, which streamed layers do not compute in (torch's Linear/conv "
              "takes its input in its weight's dtype; a streamed one would refuse it at every call); to "
              "stream it, convert the model to float32, bfloat16 or float16 before attach"),
}


def _why_resident(module: nn.Module, kind: str, dora: set) -> Optional[str]:
    """None when the layer streams (its forward computes what the streamed op
    computes), else why it stays resident, as a sentence."""
    if _is_quanto_qlinear(module):
        if not getattr(module, "frozen", False):
            return ("optimum-quanto QLinear not frozen: it quantizes its float weight at every call; "
                    "call optimum.quanto.freeze(model) before attach")
        if getattr(module, "activation_qtype", None) is not None:
            return "optimum-quanto QLinear that quantizes its activations (weight-only streams)"
        if "forward" in module.__dict__ and _adapter_of(module) is None:
            return _REASON_TEXT["wrapped"]
        return None
    reason = _resident_reason(module, kind, dora)
    if reason == "wrapped" and _adapter_of(module) is not None:
        reason = None  # the adapter's org_forward is replaced instead
    if reason is None and _activation_dtype(module, kind) is not None:
        reason = "dtype"  # offload()'s rule (_discover), so both leave the same layers resident
    return None if reason is None else _REASON_TEXT.get(reason) or _RESIDENT_REASONS[reason][1]


def _foreign_weight(module: nn.Module, pre) -> Optional[str]:
    """Why a weight that is a tensor subclass layerstream does not know (neither a
    quantized format _prequantized() reads nor a plain tensor) cannot stream."""
    w = module._parameters.get("weight", module.__dict__.get("weight"))
    if pre is None and type(w) not in (torch.Tensor, nn.Parameter):
        return (f"its weight is a {type(w).__module__}.{type(w).__qualname__} tensor, which layerstream "
                f"does not stream (it streams plain tensors, torch qint8, optimum-quanto qint8/qfloat8, "
                f"torchao int8/float8 weight-only, bitsandbytes nf4 and GGUF weights)")
    return None


def _held(fn, owner):
    """A getter of `fn`: weakly when it is a bound method of `owner`, whose __dict__ (or
    its layer's) holds what holds `fn`: a strong one was a cycle."""
    if isinstance(fn, types.MethodType) and fn.__self__ is owner:
        return weakref.WeakMethod(fn)
    return lambda: fn


# Note [A model attached here is freed with its last reference]
# As offload()'s (Note [Nothing offload() puts on a model refers back to it], _handle.py):
# the references run from the model to the manager (model._memory_manager, model.to, the
# call hooks; each layer's _layer_memory_manager, whose `manager` keeps it for layers
# attached one by one) and on to the engine, and nothing of the manager's or the layers'
# records holds a module, an adapter, a record or a bound method of theirs strongly (a
# cycle kept a dropped model and its engine until the cyclic collector ran). A layer
# dropped from the model goes with its record; detach() hands back the layers left.
class MemoryManager(_RefusesCopy):
    """Owns one layerstream engine for the layers attached through it."""

    def __init__(self, module: nn.Module, process_device, **engine_options):
        self._module = weakref.ref(module)
        self.process_device = torch.device(process_device)
        self._engine_options = {"device": _engine_device(self.process_device)}
        self._engine_options.update(engine_options)
        self.engine = _C.Engine(self._engine_options)
        self._layer_refs: List[weakref.ref] = []  # the layers' records (BaseLayerMemoryManager), in engine order
        self._unmanaged: List[weakref.ref] = []
        self._root_apply = None  # what attach installs on the model (_install_root)
        self._subtree_checks = []  # and on the modules between it and the streamed layers
        self._call_hook = None  # the hooks on its calls (_calls.CallHooks): a call begins a step
        self._had_to, self._old_to = False, None

    @property
    def module(self) -> Optional[nn.Module]:
        """The module given to attach (None once it was freed)."""
        return self._module()

    @property
    def _layers(self) -> List["BaseLayerMemoryManager"]:
        return [lm for lm in (r() for r in self._layer_refs) if lm is not None]

    @property
    def managed(self) -> List[nn.Module]:
        """The streamed layers, in engine order."""
        return [m for m in (lm.module for lm in self._layers) if m is not None]

    @property
    def unmanaged_modules(self) -> list:
        """The original's name: what attach() leaves resident (ignore_modules entries,
        layers offload_percent did not pick, layers that cannot stream)."""
        return [m for m in (r() for r in self._unmanaged) if m is not None]

    @unmanaged_modules.setter
    def unmanaged_modules(self, modules: list) -> None:
        self._unmanaged = [weakref.ref(m) for m in modules]

    # ------------------------------------------------------------------ attach
    @classmethod
    def attach(cls, module: nn.Module, device, offload_percent: float = 1.0,
               ignore_modules: Optional[Iterable] = None, **engine_options):
        if hasattr(module, "_memory_manager"):
            return module._memory_manager
        taken = [name or "<root>" for name, sub in module.named_modules()
                 if getattr(sub, "_layerstream_handle", None) is not None]
        if taken:
            raise LayerstreamError(
                f"MemoryManager.attach: the model is already offloaded by layerstream.offload() "
                f"({len(taken)} streamed layer(s), e.g. '{taken[0]}'); one model is streamed by one "
                f"handle. Call handle.detach() on the offload() handle first, or keep using it.")
        in_file = [name for name, p in module.named_parameters() if isinstance(p, FileWeight)]
        if in_file:
            raise LayerstreamError(
                f"MemoryManager.attach: {len(in_file)} parameter(s) of this model are still in their checkpoint "
                f"file (loaded by layerstream.load_safetensors(), e.g. '{in_file[0]}'), which MemoryManager does "
                f"not read. Stream it with layerstream.offload(model, ...), which reads them from the file, or "
                f"load the weights into a model in memory (load_state_dict) before attach; nothing was changed.")
        if not 0.0 <= float(offload_percent) <= 1.0:
            raise ValueError(f"offload_percent must be in [0, 1], got {offload_percent}")
        ignored_modules, ignored_params, ignore_list = set(), set(), list(ignore_modules or [])
        for i, m in enumerate(ignore_list):
            if isinstance(m, nn.Module):
                ignored_modules.update(id(sub) for sub in m.modules())
            elif isinstance(m, torch.Tensor):
                ignored_params.add(id(m))
            else:
                raise TypeError(f"MemoryManager.attach: ignore_modules[{i}] is a {type(m).__name__}; "
                                f"it holds modules and parameters (nn.Module, nn.Parameter)")

        # Which layers can stream, decided before anything changes.
        dora = _dora_layers(module)
        # peft's LoRA on parameters reads its adapters' weights directly and
        # parametrizes its base's weight during each call (as offload()'s _discover).
        adapters, wrapped = _peft_params.adapter_modules(module), _peft_params.wrapped_bases(module)
        layers, resident, cannot = [], {}, []  # cannot: the modules of `resident`
        for name, sub in module.named_modules():
            if id(sub) in ignored_modules or id(sub) in adapters:
                continue
            kind = _is_streamable(sub)
            if kind == "group" and _is_diffusers_gguf(sub):
                resident.setdefault(_REASON_TEXT["diffusers_gguf"], []).append(_resident_label(name, sub, "custom"))
                continue
            if kind not in ("linear", "conv"):
                continue
            if any(id(p) in ignored_params for p in sub.parameters(recurse=False)):
                continue
            w = sub._parameters.get("weight", sub.__dict__.get("weight"))
            if isinstance(w, torch.Tensor) and w.numel() == 0:
                continue
            if hasattr(sub, "_layer_memory_manager"):
                raise LayerstreamError(
                    f"MemoryManager.attach: layer '{name}' is already attached to another "
                    f"MemoryManager; detach that model first (MemoryManager.detach(model))")
            why = _REASON_TEXT["computed"] if id(sub) in wrapped else _why_resident(sub, kind, dora)
            pre = None
            if why is None and kind == "linear":
                try:
                    pre = _prequantized(name, sub)
                except LayerstreamError as e:  # its message names the layer; the warning does
                    why = f"a quantized weight layerstream cannot stream: {e}".replace(f"layer '{name}': ", "")
            if why is None:
                why = _foreign_weight(sub, pre)
            if why is not None:
                resident.setdefault(why, []).append(_resident_label(name, sub, "custom"))
                cannot.append(sub)
                continue
            if pre is not None:
                nbytes = pre.codes.numel() * pre.codes.element_size() + pre.scales.numel() * 4
            else:
                nbytes = sum(p.numel() * p.element_size() for p in sub.parameters(recurse=False))
            layers.append((nbytes, name, sub, kind, pre))
        # Deterministic choice by bytes: largest first, ties by name.
        layers.sort(key=lambda t: (-t[0], t[1]))
        target = float(offload_percent) * sum(t[0] for t in layers)
        chosen, acc = {}, 0
        for nbytes, name, sub, kind, pre in layers:
            if acc >= target or offload_percent <= 0:
                break
            chosen[id(sub)] = pre
            acc += nbytes

        manager = cls(module, device, **engine_options)
        manager.unmanaged_modules = ignore_list + [t[2] for t in layers if id(t[2]) not in chosen] + cannot
        for why, names in resident.items():
            _warn_resident(names, "layer(s) that MemoryManager.attach cannot stream",
                           manager.process_device, why, stacklevel=3)
        frozen_needed = [f"'{t[1]}'" for t in layers if id(t[2]) in chosen and t[4] is not None
                         and t[4].library is not None and t[2].weight.requires_grad]
        if frozen_needed:
            warnings.warn(
                f"layerstream: {len(frozen_needed)} quantized layer(s) stream frozen and get no weight "
                f"gradient, though their weight has requires_grad=True (optimum-quanto's freeze() "
                f"leaves it so): {'; '.join(frozen_needed)}. Call model.requires_grad_(False) "
                f"(adapters train as usual) to silence this.", RuntimeWarning, stacklevel=2)
        try:
            # Attach in module order so the engine's layer order follows execution order.
            for name, sub in module.named_modules():
                if id(sub) in chosen:
                    layer_cls = LinearLayerMemoryManager if _is_streamable(sub) == "linear" \
                        else ConvLayerMemoryManager
                    layer_cls._attach(sub, manager, name, chosen[id(sub)])
            manager._install_root()
        except BaseException:  # undo what was done, then report
            if module.__dict__.get("_memory_manager") is manager:
                cls.detach(module)
            else:
                manager._release()
            raise
        return manager

    def _install_root(self) -> None:
        """After the layers are attached: model.to() is memory_managed_to, the
        model's _apply checks the streamed layers first, and what is not streamed
        runs on the process device (adapters of streamed layers included)."""
        module = self.module
        module._memory_manager = self
        this = weakref.ref(self)  # the hooks are this manager's (_call_hook): a lambda over self was a cycle
        self._call_hook = CallHooks(module, lambda: this().engine, self._streamed_ids(),
                                    {id(m) for m in self.managed})
        if not isinstance(module.__dict__.get("_apply"), _StreamedApply):
            self._root_apply = _RootApply(module, [lm.module._apply for lm in self._layers])
            module._apply = self._root_apply
        self._install_subtree_checks()
        self._had_to = "to" in module.__dict__
        self._old_to = module.__dict__.get("to")
        module.to = self.memory_managed_to
        compute = torch.device(self.engine.compute_device)
        streamed = self._streamed_ids()
        _move_resident(module, streamed, compute)
        for lm in self._layers:
            if lm._adapter is not None:
                _move_resident(lm._adapter, streamed, compute)

    def _install_subtree_checks(self) -> None:
        """A refused conversion of a part of the model changes nothing (guards.install_subtree_checks);
        again after the layers were attached anew (memory_managed_to)."""
        remove_subtree_checks(self._subtree_checks)
        self._subtree_checks = install_subtree_checks(self.module, [(lm.name, [lm.module._apply])
                                                                    for lm in self._layers])

    def _streamed_ids(self) -> set:
        """ids of the parameters the engine holds."""
        return {id(p) for lm in self._layers for p in lm._streamed_params()}

    # ------------------------------------------------------------- detach, to
    @classmethod
    def detach(cls, module: nn.Module) -> None:
        """Undoes MemoryManager.attach(module, ...): each streamed layer gets its own
        forward back (or its adapter's org_forward) and its weights as ordinary
        tensors on the device they were on before attach, bit-identical;
        ``module.to`` is nn.Module's again and ``_memory_manager`` and the tags are
        removed. What attach moved to the process device stays there (move it with
        ``module.to(...)``). Layers attached one by one below `module`
        (``LinearLayerMemoryManager.attach``) are handed back with all the layers of
        their managers; a module with neither is left as it is."""
        manager = module.__dict__.get("_memory_manager")
        if manager is None:  # layers attached below it: by MemoryManager.attach(child), or one by one
            for m in dict.fromkeys(sub.__dict__["_layer_memory_manager"].manager for sub in module.modules()
                                   if "_layer_memory_manager" in sub.__dict__):
                if getattr(m.module, "__dict__", {}).get("_memory_manager") is m:
                    cls.detach(m.module)  # its module's to/_apply/_memory_manager go too
                else:
                    m._release()
            return
        manager._release()
        if manager._call_hook is not None:
            manager._call_hook.remove()
            manager._call_hook = None
        if manager._root_apply is not None and module.__dict__.get("_apply") is manager._root_apply:
            del module.__dict__["_apply"]
        remove_subtree_checks(manager._subtree_checks)
        manager._subtree_checks = []
        if module.__dict__.get("to") == manager.memory_managed_to:
            if manager._had_to:
                module.to = manager._old_to
            else:
                del module.__dict__["to"]
        del module._memory_manager

    def _release(self, to_host: bool = False) -> None:
        """Hands every streamed layer back (engine detach, forwards, tags): their
        weights to the devices they were on before attach, or (to_host) to the CPU."""
        if self.engine is None:
            return
        layers = [r() for r in self._layer_refs]  # a layer dropped from the model: its weights go nowhere
        self.engine.detach(["cpu" if to_host or lm is None else lm._device for lm in layers])
        for lm in layers:
            if lm is not None:
                lm._uninstall()
        self._layer_refs, self.engine = [], None

    def memory_managed_to(self, *args, **kwargs):
        """``module.to(...)`` after attach, as the original's: a device moves what is not
        streamed (streamed weights stay in host memory; a move to the CPU of a model
        attached for a GPU also frees the engine's slots until a move back to that
        GPU, and the model cannot run meanwhile); a dtype converts everything,
        the streamed layers too, which are then streamed again in that dtype (while
        that runs, their weights are held twice in host memory). Quantized streamed
        layers keep their dtype (their libraries refuse to change it): a dtype other
        than theirs raises before anything changes, as does float64 or a complex dtype
        (streamed layers do not compute in it). Returns the module."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
            raise TypeError(f"nn.Module.to only accepts floating point or complex dtypes, but got "
                            f"desired dtype={dtype}")
        if self.engine is None:
            raise LayerstreamError("this MemoryManager was detached; attach the model again")
        if dtype is not None and self._layers and not _takes_activations(dtype):
            # attach's rule (_why_resident): such layers would refuse their input at every call.
            raise LayerstreamError(
                f"model.to({dtype}): layer '{self._layers[0].name}' streams, and streamed layers do not compute "
                f"in {dtype} (their activations must be float32, bfloat16 or float16); nothing was changed. "
                f"Convert to one of those, or call MemoryManager.detach(model) first (the layers then run "
                f"resident in {dtype}).")
        stale = []
        if dtype is not None:
            for lm in self._layers:
                dtypes = {p.dtype for p in lm.module.parameters(recurse=False) if p.is_floating_point()}
                if lm._pre is not None:
                    if lm._pre.dense_dtype != dtype:
                        raise LayerstreamError(
                            f"layer '{lm.name}' streams a quantized weight computed in "
                            f"{lm._pre.dense_dtype}; its dtype cannot change to {dtype} (quantized "
                            f"weights keep the dtype they were quantized in). Quantize the model in "
                            f"{dtype}, or call MemoryManager.detach(model) first.")
                elif dtypes - {dtype}:
                    stale.append(lm)
        if stale:  # stream every layer again, in engine order, from a new engine
            layers = [(lm.name, lm.module, type(lm), lm._device) for lm in self._layers]
            self._release(to_host=True)  # not onto the GPU they may have come from
            with torch.no_grad():
                for _, sub, _, _ in layers:
                    for p in sub.parameters(recurse=False):
                        if p.is_floating_point() and p.dtype != dtype:
                            p.data = p.data.to(dtype)
            self.engine = _C.Engine(self._engine_options)
            for name, sub, layer_cls, before in layers:
                pre = _prequantized(name, sub) if layer_cls is LinearLayerMemoryManager else None
                layer_cls._attach(sub, self, name, pre)._device = before  # where detach() returns it
            if self._root_apply is not None:
                self._root_apply = _RootApply(self.module, [lm.module._apply for lm in self._layers])
                self.module._apply = self._root_apply
            self._install_subtree_checks()
        compute = torch.device(self.engine.compute_device)
        if device is not None and compute.type != "cpu":  # docs/design/streaming-core.md, "Suspend"
            if device.type == "cpu":  # the original kept no device memory there: free the slots too
                self.engine.suspend()
            elif _is_compute(device, compute):
                self.engine.resume()
        _move_resident(self.module, self._streamed_ids(), device, dtype=dtype, non_blocking=non_blocking)
        return self.module

    # --------------------------------------------------------------- helpers
    def stats(self):
        return dict(self.engine.stats())

    def synchronize(self):
        self.engine.synchronize()


class BaseLayerMemoryManager(_RefusesCopy):
    """One streamed layer's record (module._layer_memory_manager). It and its manager
    refuse a deep copy (of a layer, say) with the message a streamed model gives, as they
    did when they held the model."""

    kind = ""

    def __init__(self, module: nn.Module, manager: MemoryManager, name: Optional[str] = None):
        # The layer and its adapter weakly (Note [A model attached here is freed with its
        # last reference]); the manager strongly: a layer attached one by one keeps it.
        self._module = weakref.ref(module)
        self.manager = manager
        self.name = name or f"{type(module).__name__}@{id(module):x}"
        self._pre = None  # the packed weight, when it arrives quantized
        self._adapter_ref = None
        self._device = "cpu"

    @property
    def module(self) -> Optional[nn.Module]:
        """The layer (None once it was freed)."""
        return self._module()

    @property
    def _adapter(self):
        return None if self._adapter_ref is None else self._adapter_ref()

    @classmethod
    def attach(cls, module: nn.Module, manager: MemoryManager, name: Optional[str] = None):
        """Streams one layer through `manager`. A layer whose forward the streamed op
        would drop (a subclass with its own forward, a wrapped forward) is refused."""
        if hasattr(module, "_layer_memory_manager"):
            return module._layer_memory_manager
        kind = _is_streamable(module)
        if kind is None or (cls.kind and kind != cls.kind):
            raise LayerstreamError(f"{cls.__name__}.attach: {type(module).__qualname__} is not a "
                                   f"{cls.kind or 'Linear/conv'} layer layerstream streams")
        why = _why_resident(module, kind, _dora_layers(module))
        if why is not None:
            raise LayerstreamError(
                f"{cls.__name__}.attach: layer '{name or type(module).__qualname__}' cannot stream: "
                f"{why}; leave it resident (it runs its own forward)")
        pre = _prequantized(name or "<layer>", module) if kind == "linear" else None
        why = _foreign_weight(module, pre)
        if why is not None:
            raise LayerstreamError(f"{cls.__name__}.attach: layer '{name or type(module).__qualname__}' "
                                   f"cannot stream: {why}")
        return cls._attach(module, manager, name, pre)

    @classmethod
    def _attach(cls, module: nn.Module, manager: MemoryManager, name: Optional[str], pre):
        lm = cls(module, manager, name)
        lm._pre = pre
        lm._install()
        module._layer_memory_manager = lm
        for p in module.parameters(recurse=False):
            p._is_memory_managed = True
        return lm

    def _register(self) -> int:
        raise NotImplementedError

    def _streamed_params(self) -> list:
        """The parameters the engine holds (a library-quantized layer's bias is not
        one: the library adds it after the product, on the device)."""
        keep_bias = self._pre is None or self._pre.library is None
        return [p for k, p in self.module._parameters.items()
                if p is not None and (k != "bias" or keep_bias)]

    def _run(self, index: int, x):
        raise NotImplementedError

    def _install(self):
        w = self.module._parameters.get("weight", self.module.__dict__.get("weight"))
        self._device = str(w.device)
        index = self._register()
        self.index = index
        self.manager._layer_refs.append(weakref.ref(self))
        adapter = _adapter_of(self.module)
        self._adapter_ref = None if adapter is None else weakref.ref(adapter)
        target, attr = (adapter, "org_forward") if adapter is not None else (self.module, "forward")
        self._target, self._attr = weakref.ref(target), attr
        self._had_attr = attr in target.__dict__
        original = getattr(target, attr)
        self._original_forward = _held(original, self.module)
        fallback = _held(original, target)  # an adapter keeps its layer as before attach

        def _mm_forward(x, *args, **kwargs):
            # Released (MemoryManager.detach): a wrapper installed after attach that
            # still holds this forward gets the layer's own (_uninstall).
            if args or kwargs or self.manager.engine is None:
                return fallback()(x, *args, **kwargs)
            return self._run(index, x)

        self._mm_forward = weakref.ref(_mm_forward)  # it holds this record
        setattr(target, attr, _mm_forward)
        self.module._memory_management_device = self.manager.process_device
        self.module._apply = _StreamedApply(self.module, torch.device(self.manager.engine.compute_device),
                                            self.name, remedy=_REMEDY)

    def _uninstall(self):
        """Undoes _install (the engine was detached). A wrapper installed after attach
        (its org_forward is the streamed forward) keeps wrapping: its org_forward
        becomes the layer's own forward again."""
        target, mm, m = self._target(), self._mm_forward(), self.module
        if m is None:
            return
        if target is not None and mm is not None and target.__dict__.get(self._attr) is mm:
            if self._had_attr:
                setattr(target, self._attr, self._original_forward())
            else:
                del target.__dict__[self._attr]
        elif mm is not None:
            holder = getattr(m.__dict__.get("forward"), "__self__", None)
            if getattr(holder, "org_forward", None) is mm:
                holder.org_forward = self._original_forward()
        m.__dict__.pop("_apply", None)
        for attr in ("_layer_memory_manager", "_memory_management_device"):
            m.__dict__.pop(attr, None)
        for p in m.parameters(recurse=False):
            if hasattr(p, "_is_memory_managed"):
                del p._is_memory_managed


class LinearLayerMemoryManager(BaseLayerMemoryManager):
    kind = "linear"

    def _register(self) -> int:
        e, name, m, pre = self.manager.engine, self.name, self.module, self._pre
        if pre is None:
            return e.add_linear(name, m.weight, m.bias)
        if pre.library is not None:
            # The library adds the bias after its product: the bias stays resident.
            if pre.out_scale is not None:
                pre.out_scale = pre.out_scale.to(e.compute_device)
            index = e.add_linear_packed(name, pre.format, pre.codes, pre.scales, None, pre.rows, pre.cols,
                                        pre.dense_dtype)
            pre.codes = pre.scales = None  # the engine copied them
            return index
        if pre.format == "int8":
            return e.add_linear_int8(name, pre.codes, pre.scales, m.bias, pre.dense_dtype)
        return e.add_linear_packed(name, pre.format, pre.codes, pre.scales, m.bias, pre.rows, pre.cols,
                                   pre.dense_dtype)

    def _run(self, index, x):
        pre = self._pre
        if pre is None or pre.library is None:
            return self.manager.engine.linear(index, x)
        engine = self.manager.engine
        return _library_linear(pre, lambda t: engine.linear(index, t), x, self.module.bias, pre.out_scale)


class ConvLayerMemoryManager(BaseLayerMemoryManager):
    kind = "conv"

    def _register(self) -> int:
        return self.manager.engine.add_conv(self.name, self.module.weight, self.module.bias,
                                            **_conv_args(self.module))

    def _run(self, index, x):
        return self.manager.engine.conv(index, _pad_for_mode(self.module, x))
