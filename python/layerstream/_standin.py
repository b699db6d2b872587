"""What a packed stand-in parameter may be used for.

A weight that layerstream holds packed (``_PackedWeight``: quantized by offload();
``GgufWeight``: kept as a GGUF file's blocks by load_gguf()) is a data-less meta tensor
beside its bytes. Torch computes with meta tensors without complaint, and a CPU tensor
times a meta one even yields a CPU tensor of uninitialised memory, so every torch
function given a stand-in in any argument position is refused, except the ones that
read only metadata (shape, dtype, size(), numel(), ...), which code around a model
(optimizers, peft, state_dict(), printing) relies on. Each stand-in class handles the
few calls it gives a meaning of its own (detach(), copy_(), .device) before asking here.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

# The .device descriptor as __torch_function__ sees its getter, and what packed stand-ins
# (GgufWeight, _PackedWeight) report from it: the host, where their bytes are.
DEVICE = torch._C.TensorBase.__dict__["device"]
HOST = torch.device("cpu")

# Property getters that compute a view of the values: refused like any computation.
_VIEW_GETTERS = frozenset({"T", "mT", "H", "mH", "real", "imag"})
# Methods that read metadata only.
_METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "stride", "is_contiguous",
    "is_floating_point", "is_complex", "is_signed", "is_inference", "storage_offset", "data_ptr",
    "untyped_storage", "_typed_storage", "get_device", "is_pinned", "_is_view", "has_names",
    "__len__", "__repr__", "__format__", "__hash__", "__reduce_ex__", "__deepcopy__", "__getstate__",
    "__setstate__", "_is_zerotensor",
})


def first_standin(types, args, kwargs, cls):
    """The first instance of `cls` among the (nested) arguments, or None."""
    if not any(issubclass(t, cls) for t in types):
        return None
    for a in pytree.tree_leaves((args, kwargs or {})):
        if isinstance(a, cls):
            return a
    return None


def reads_metadata_only(func) -> bool:
    """True for a torch function that reads no values of its tensor arguments."""
    name = getattr(func, "__name__", "")
    owner = getattr(func, "__self__", None)
    if owner is not None and name in ("__get__", "__set__", "__delete__"):
        # A property of the tensor (shape, dtype, grad, requires_grad, ...); the
        # stand-in classes handle the setters that matter to them.
        return getattr(owner, "__name__", "") not in _VIEW_GETTERS
    return name in _METADATA


def computing_message(func) -> str:
    """How a refusal names what was attempted."""
    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__self__", None)
    if owner is not None and name == "__get__":
        name = f".{getattr(owner, '__name__', '?')}"
    elif not name.startswith("__"):
        name += "()"
    return f"computing with it ({name})"

