"""peft's LoRA on parameters (``LoraConfig(target_parameters=[...])``, peft's
``ParamWrapper``) over a streamed tensor group: LoRA on a mixture-of-experts
module's 3-D expert tensors.

Note [Adapters on a streamed group's tensors]
peft adds such an adapter for the length of each call by registering a torch
parametrization on the wrapped module (``torch.nn.utils.parametrize``), and
registering computes the adapted value once from the parameter where it is. For
a streamed group that is host memory: on a GPU the registration fails (the
adapter's factors are on the device), and on the host it would compute the whole
expert stack's update on the CPU at every call. So, for a wrapper whose base
module is a streamed group, the wrapper's ``_activate_lora`` is replaced by one
that hands the group's forward (_GroupForward.adapted) the adapter's function and
tensors instead of registering anything: the forward applies the function to the
fetched tensor on the device, with peft's arithmetic (one ``baddbmm`` of the
factors for a single adapter over several experts, otherwise the sum of the
adapters' deltas added), and passes the adapter's tensors to its autograd
function, whose backward recomputes the value and returns their gradients
(_GroupFn). Wrappers present at offload() are patched then; wrappers added
later (get_peft_model after offload()) at the first call of the module that
holds them (a forward pre-hook). detach() undoes both. The patch sits in the
wrapper's __dict__ and holds the wrapper weakly, as Installed does (Note [Nothing
offload() puts on a model refers back to it], _handle.py).

The adapters' own modules (lora_A / lora_B) are never streamed: the wrapper
reads their weights directly, not through their forward (_discovery.py)."""
from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from typing import List, Optional

import torch
import torch.nn as nn

from ._guards import LayerstreamError


# peft tuner layers whose forward reads their base layer's weight or bias itself (not
# through the base layer's forward), by the package under peft.tuners: the label errors
# and warnings show, and, where only some of its layers do, which. A streamed base layer
# has those tensors in host memory (on a GPU the adapter would meet them there: torch's
# device-mismatch error) or as a data-less stand-in (quantize=). Found by running every
# tuner of peft 0.21 over a streamed model, watching which read a streamed tensor, and
# over an int8 one (refused): DoRA (LoRA's use_dora) and these. Not listed: the tuners
# that read the base weight only when the adapter is added (e.g. TinyLoRA's SVD; over a
# quantized layer _packed.py's refusal names them) or read only its shape or dtype.
_PEFT_BASE_READERS = {
    "hra": "HRA", "hira": "HiRA", "glora": "GLoRA", "peanut": "PEANuT", "shira": "SHiRA",
    "supertuning": "SuperTuning",
    "miss": "MiSS",  # with init_weights="bat" only
    "boft": "BOFT", "deft": "DeFT", "frod": "FRoD",  # the bias (BOFT's convolutions: the weight too)
}


def wrapper_class() -> Optional[type]:
    """peft's ParamWrapper when peft is imported (a model holding one has imported it)."""
    mod = sys.modules.get("peft.tuners.lora.layer")
    return getattr(mod, "ParamWrapper", None) if mod is not None else None


def _chain(wrapper: nn.Module, cls: type) -> List[nn.Module]:
    """The ParamWrappers nested from `wrapper` down (one per targeted parameter)."""
    out = []
    m = wrapper
    while isinstance(m, cls):
        out.append(m)
        m = m.base_layer
    return out


def adapter_modules(model: nn.Module) -> set:
    """ids of the modules inside peft ParamWrappers besides the wrapped module itself
    (lora_A, lora_B, ...): the wrapper reads their weights directly."""
    cls = wrapper_class()
    out = set()
    if cls is None:
        return out
    for m in model.modules():
        if isinstance(m, cls):
            out.update(id(sub) for key, child in m._modules.items() if key != "base_layer" and child is not None
                       for sub in child.modules())
    return out


def wrapped_bases(model: nn.Module) -> set:
    """ids of the modules some ParamWrapper wraps (the innermost base layers)."""
    cls = wrapper_class()
    if cls is None:
        return set()
    return {id(_chain(m, cls)[-1].base_layer) for m in model.modules() if isinstance(m, cls)}


def _factors(w, lhs, rhs, *, scaling):
    # A parametrization keeps the tensor's dtype: no autocast (peft's rule too).
    with torch.autocast(device_type=w.device.type, enabled=False):
        return torch.baddbmm(w, lhs, rhs, alpha=scaling)


def _add(w, delta):
    return w + delta


@contextlib.contextmanager
def _activate(wrapper: nn.Module, fwd, active_adapters):
    """ParamWrapper._activate_lora for a wrapper over a streamed group."""
    adapters = [a for a in active_adapters if a in wrapper.lora_A]
    if not adapters:
        yield
        return
    slot = fwd.slot_index(wrapper.get_base_layer(), wrapper.parameter_name)
    p = fwd._params[slot]
    if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise LayerstreamError(
            f"streamed layer '{fwd._name}': a LoRA adapter on its {p.dtype} tensor "
            f"'{wrapper.parameter_name}' (target_parameters) is not supported; keep this module resident "
            f"(offload(exclude=[...])) or stream it in float32, bfloat16 or float16")
    if len(adapters) == 1 and wrapper.num_experts > 1:
        lhs, rhs, scaling = wrapper.get_delta_factors(adapters[0])
        fn, tensors = functools.partial(_factors, scaling=scaling), (lhs, rhs)
    else:
        delta = None
        for a in adapters:
            d = wrapper.get_delta_weight(a)
            delta = d if delta is None else delta + d
        # peft puts the delta where the parameter is (host memory here): back to the device.
        fn, tensors = _add, (delta.to(fwd._device),)
    with fwd.adapted(slot, fn, tensors):
        yield


class _Activate:
    """A patched wrapper's _activate_lora: _activate with the wrapper held weakly (a
    partial of it in the wrapper's __dict__ was a cycle that kept a dropped model, its
    handle and engine until gc). A copy of the wrapper (copy.deepcopy: its base is copied
    plain, _forward._PlainCopy) gets one without `fwd`: it activates as peft's own does."""

    __slots__ = ("_wrapper", "_fwd")

    def __init__(self, wrapper: nn.Module, fwd=None):
        self._wrapper, self._fwd = weakref.ref(wrapper), fwd

    def __call__(self, active_adapters):
        w = self._wrapper()
        if self._fwd is None:
            return type(w)._activate_lora(w, active_adapters)
        return _activate(w, self._fwd, active_adapters)

    def __deepcopy__(self, memo):
        copied = memo.get(id(self._wrapper()))
        return self if copied is None else _Activate(copied)

    def __reduce__(self):
        if self._fwd is not None:  # refuses, saying what to do (_forward._RefusesCopy)
            return self._fwd.__reduce_ex__(2)
        return _Activate, (self._wrapper(),)


def _is_patched(wrapper: nn.Module) -> bool:
    """Whether `wrapper` activates through a streamed group (a copy's patch does not)."""
    patch = wrapper.__dict__.get("_activate_lora")
    return patch is not None and getattr(patch, "_fwd", True) is not None


class Installed:
    """What install() changed: removed by detach(). The wrappers weakly: the handle
    keeps it, and a handle kept does not keep its model."""

    def __init__(self, cls, fwds):
        self._cls = cls
        self._fwds = fwds  # id(group module) -> its _GroupForward
        self._patched: List[weakref.ref] = []
        self._hooks = []

    def patch(self, top: nn.Module) -> None:
        """Patches the wrappers from `top` down when their base is a streamed group."""
        chain = _chain(top, self._cls)
        fwd = self._fwds.get(id(chain[-1].base_layer)) if chain else None
        if fwd is None:
            return
        for w in chain:
            if not _is_patched(w):
                w._activate_lora = _Activate(w, fwd)
                self._patched.append(weakref.ref(w))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        for w in (r() for r in self._patched):
            if w is not None:
                w.__dict__.pop("_activate_lora", None)
        self._hooks, self._patched = [], []


def install(model: nn.Module, group_forwards: dict) -> Optional[Installed]:
    """Patches the ParamWrappers over streamed groups (`group_forwards`: id(module) ->
    _GroupForward) and hooks the module holding each group (or its outermost wrapper)
    to patch wrappers added later. None without peft."""
    cls = wrapper_class()
    if cls is None or not group_forwards:
        return None
    inst = Installed(cls, group_forwards)
    for parent in model.modules():
        if isinstance(parent, cls):
            continue
        for key, child in parent._modules.items():
            base = _chain(child, cls)[-1].base_layer if isinstance(child, cls) else child
            if id(base) not in group_forwards:
                continue
            if child is not base:
                inst.patch(child)

            def hook(mod, args, key=key):
                top = mod._modules.get(key)
                if isinstance(top, inst._cls) and not _is_patched(top):
                    inst.patch(top)

            inst._hooks.append(parent.register_forward_pre_hook(hook))
    return inst
