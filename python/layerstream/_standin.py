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
import torch.nn as nn
import torch.utils._pytree as pytree

from . import _C

# The .device descriptor as __torch_function__ sees its getter, and what packed stand-ins
# (GgufWeight, _PackedWeight) report from it: the host, where their bytes are.
DEVICE = torch._C.TensorBase.__dict__["device"]
HOST = torch.device("cpu")
# The .data descriptor, the same way: a read-only stand-in answers its getter with itself.
DATA = torch._C.TensorBase.__dict__["data"]

# Property getters that compute a view of the values: refused like any computation.
_VIEW_GETTERS = frozenset({"T", "mT", "H", "mH", "real", "imag"})
# Methods that read metadata only.
_METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "stride", "is_contiguous",
    "is_floating_point", "is_complex", "is_signed", "is_inference", "storage_offset",
    "untyped_storage", "_typed_storage", "get_device", "is_pinned", "_is_view", "has_names",
    "__len__", "__repr__", "__format__", "__hash__", "__reduce_ex__", "__deepcopy__", "__getstate__",
    "__setstate__", "_is_zerotensor", "is_conj", "is_neg",
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


def writes_in_place(name: str) -> bool:
    """True for the name of a torch function that writes its first argument's values."""
    if name in ("requires_grad_", "detach_", "share_memory_"):
        return False
    return (name.endswith("_") and not name.startswith("_")) or name in (
        "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
        "__ipow__", "__ilshift__", "__irshift__", "__iand__", "__ior__", "__ixor__")


def computing_message(func) -> str:
    """How a refusal names what was attempted."""
    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__self__", None)
    if owner is not None and name == "__get__":
        name = f".{getattr(owner, '__name__', '?')}"
    elif not name.startswith("__"):
        name += "()"
    if name == "contiguous()":  # what savers call first (diffusers' save_pretrained, safetensors)
        return "computing with it (contiguous(); e.g. saving it: save_pretrained, safetensors' save_file)"
    return f"computing with it ({name})"



class StandIn(nn.Parameter):
    """The base of the packed stand-ins (``_PackedWeight``, ``GgufWeight``): a data-less
    meta tensor of the weight's shape and dtype whose ``.device`` is the host, which
    refuses computing (the rules above) and pickling. Subclasses say, in their own
    words, what the weight is and what to do instead (``_refusal``), and handle the
    calls they give a meaning of their own before calling ``_common``."""

    @classmethod
    def _meta(cls, shape, dtype):
        return torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"), False)

    def _refusal(self, what: str) -> str:
        """The message that refuses `what` ("computing with it (mm())", ...)."""
        raise NotImplementedError

    def _write_refusal(self, what: str) -> str:
        """The message that refuses a write (`what`: "writing into it (add_())", ...);
        a read-only stand-in adds how to change its values."""
        return self._refusal(what)

    @classmethod
    def _common(cls, func, types, args, kwargs):
        """The rules every stand-in shares: ``.device`` is the host; any computation
        with one, in any argument position, is refused; the rest runs as on the meta
        tensor."""
        self = args[0] if args and isinstance(args[0], cls) else None
        if self is not None and getattr(func, "__self__", None) is DEVICE and getattr(func, "__name__", "") == "__get__":
            return HOST  # where the bytes are; is_meta stays True
        other = first_standin(types, args, kwargs, cls)
        if other is not None and not reads_metadata_only(func):
            if getattr(func, "__name__", "") == "data_ptr":
                # A meta tensor's is 0, and a writer that reads the bytes there to save
                # them (safetensors' save_file) failed with an error naming no tensor.
                raise _C.LayerstreamError(other._save_refusal())
            # A meta tensor has no values, and torch would return uninitialised memory.
            raise _C.LayerstreamError(other._refusal(computing_message(func)))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    # Attributes a detached alias keeps (read-only stand-ins: GgufWeight, FileWeight).
    _CARRIED: tuple = ()

    @classmethod
    def _read_only(cls, func, types, args, kwargs):
        """The rules of a stand-in whose bytes nothing writes (a file's): ``.data`` is
        the stand-in itself (a plain meta tensor there took in-place writes without a
        word: peft's merge_and_unload() did ``weight.data += delta``, and the file's
        values streamed as if unchanged); writes into it, ``copy_`` and assigning its
        ``.data`` are refused; ``detach`` / ``alias`` keep the type and its ``_CARRIED``
        attributes (state_dict() holds detached aliases: saving them then raises
        instead of writing a value-less tensor); the rest as ``_common``."""
        kwargs = kwargs or {}
        self = args[0] if args and isinstance(args[0], cls) else None
        name = getattr(func, "__name__", "")
        if self is not None and getattr(func, "__self__", None) is DATA:
            if name == "__get__":
                return self  # metadata reads through it work; writes reach the refusals below
            if name == "__set__" and args[1] is self:
                return None  # an unchanged parameter assigned back
            raise _C.LayerstreamError(self._write_refusal("replacing its .data"))
        if self is not None and writes_in_place(name):
            raise _C.LayerstreamError(self._write_refusal(f"writing into it ({name}())"))
        if name not in ("detach", "alias", "requires_grad_"):
            return cls._common(func, types, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if self is not None and name in ("detach", "alias") and isinstance(out, torch.Tensor):
            alias = torch.Tensor._make_subclass(cls, out, False)
            for attr in cls._CARRIED:
                setattr(alias, attr, getattr(self, attr))
            return alias
        return out

    def _load_refusal(self) -> str:
        """The message that refuses a load_state_dict() into it (_packed.RefusedLoads)."""
        return self._write_refusal(LOADING)

    def _save_refusal(self) -> str:
        """The message that refuses saving it: pickling (torch.save), a writer reading
        its bytes (data_ptr(): safetensors' save_file), or planning a save (DCP)."""
        return self._refusal(f"saving it ({SAVERS})")

    def __reduce_ex__(self, protocol):
        raise _C.LayerstreamError(self._save_refusal())

    def __create_write_items__(self, fqn, obj):
        """torch.distributed.checkpoint.save() asks each tensor of the state dict for its
        write items while it plans the save, before its writer opens a file: refused
        there. Its writer's .cpu() of the stand-in came after it had truncated the data
        file of a checkpoint already in the folder (Note [A refused save writes nothing])."""
        raise _C.LayerstreamError(self._save_refusal())


# Note [A refused save writes nothing]
# A stand-in has no values to save, and each saver is refused before it writes: safetensors'
# save_file reads data_ptr() of every tensor before it opens its file; DCP's save plans
# every tensor (__create_write_items__) before its writer opens one. torch.save is the
# exception: it opens (truncates) its file before it pickles (the README says so).
SAVERS = "torch.save, safetensors' save_file, torch.distributed.checkpoint.save"
LOADING = "loading new values into it (load_state_dict())"
