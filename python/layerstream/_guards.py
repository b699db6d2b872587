"""What keeps an offloaded model consistent: model.to()/.half() on streamed layers
(_StreamedApply, _RootApply), to_empty() (_NoToEmpty), model.to("cpu") and back as
suspend and resume (_HostMove), load_state_dict() into packed weights, and
torch.multiprocessing's moves into shared memory (_NoSharing).
"""
from __future__ import annotations

import bisect
import functools
import weakref
from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn

from . import _C

LayerstreamError = _C.LayerstreamError


def quantized_untrainable(layer: str, held: str) -> str:
    """The refusal to train a weight offload() quantized, streamed (_PackedWeight) or kept
    resident (ResidentQuantized): `layer` names it, `held` says how it is held."""
    return (f"the weight of quantized {layer} cannot be trained ({held}); train an adapter over it (LoRA), or "
            f"detach() and offload() again without quantizing this layer")


def _requantize_on_load(engine, index: int, module: nn.Module, parts=None) -> list:
    """load_state_dict() hooks for a layer offload() quantized. Its parameter's
    copy_ re-quantizes too (_PackedWeight), but load_state_dict() would first warn
    that copying into a meta parameter is a no-op. The pre-hook takes the weight
    out of the state dict and re-quantizes it (errors join load_state_dict's
    own); the post-hook removes the key it took from the missing keys. Returns
    the hook handles."""
    taken = []
    # (parameter name, part, owner, key): a layer's weight, or a tensor group's packed
    # parts (the name relative to `module`; the parameter is owner._parameters[key]).
    # The owner weakly: the hooks live on `module` (Note [Nothing offload() puts on a
    # model refers back to it], _handle.py).
    targets = [("weight", None, None, "weight")] if parts is None else [
        (pname, part, weakref.ref(owner), pkey) for pname, part, owner, pkey in parts]

    def pre(mod, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
            error_msgs):
        for pname, part, owner, pkey in targets:
            key = prefix + pname
            if key not in state_dict:
                continue
            value = state_dict.pop(key)
            taken.append(key)
            try:
                if part is None:
                    engine.requantize(index, value)
                else:
                    engine.requantize_part(index, part, value)
                    torch.autograd.graph.increment_version(owner()._parameters[pkey])  # see _PackedWeight
            except LayerstreamError as e:
                error_msgs.append(f'While loading "{key}" into a quantized streamed layer: {e}')

    def post(mod, incompatible_keys):
        for key in taken:
            if key in incompatible_keys.missing_keys:
                incompatible_keys.missing_keys.remove(key)
        taken.clear()

    return [module._register_load_state_dict_pre_hook(pre, with_module=True),
            module.register_load_state_dict_post_hook(post)]


class ResidentQuantized:
    """The quantized layers the planner keeps resident: held dense with their quantized
    values (docs/design/planner.md, "Quantized layers kept resident"), so that the
    budget does not change the numbers. A write into one is quantized too, as a
    streamed layer's is (_requantize_on_load, _PackedWeight): after load_state_dict()
    of its module (a post-hook), and at its module's next eager call when the
    parameter's version counter moved or the parameter was replaced (copy_(), in-place
    ops; a write through .data escapes the counter, as it escapes autograd; a compiled
    call does not look). Only new values are quantized: quantizing quantized values
    again is not the identity with a narrower dequant dtype, so a write of the
    values it holds (load_state_dict() of its own state_dict()) is told apart by their
    checksum (_C.tensor_checksum, as the C++ layers do: layerstream/engine.h). A
    load_state_dict() of values it could not quantize (NaN, Inf) is refused before
    torch writes them (a pre-hook), as a streamed layer's is: the old values stay. One per
    handle; detach() removes its hooks (the values stay, as a streamed layer's do). peft's
    merges into them are refused before any layer is written (_packed.refuse_quantized_merge)."""

    __slots__ = ("_entries", "_hooks", "__weakref__")

    def __init__(self):
        # The layer's module (a tensor group's too) -> [[owner, key, param, version, rows, fmt,
        # dequant dtype, checksum of the values written, layer name, parameter name relative to
        # the module], ...]; modules and owners weakly: the modules' hooks hold this object
        # (Note [Nothing offload() puts on a model refers back to it], _handle.py).
        self._entries = weakref.WeakKeyDictionary()
        self._hooks = []

    def add(self, module: nn.Module, name: str, qualified: str, owner: nn.Module, key: str, rows: int, fmt: str,
            dequant_dtype) -> None:
        self._entries.setdefault(module, []).append([weakref.ref(owner), key, None, -1, rows, fmt, dequant_dtype,
                                                     None, name or "<root>", qualified])

    def arm(self) -> None:
        """After offload() wrote the values: their versions are the quantized ones."""
        for module, entries in self._entries.items():
            for e in entries:
                e[2] = e[0]()._parameters[e[1]]
                e[3] = e[2]._version
                e[7] = _C.tensor_checksum(e[2])
            # (A module's load_state_dict post-hook runs after its children's loads.)
            taken = []  # the keys its pre-hook refused, this load
            self._hooks += [
                module._register_load_state_dict_pre_hook(functools.partial(self._check_load, taken), with_module=True),
                module.register_load_state_dict_post_hook(functools.partial(self._after_load, taken)),
                module.register_forward_pre_hook(self._before_call)]
        if self._entries:
            _RESIDENT_QUANT.add(self)

    @staticmethod
    def held() -> dict:
        """id(module) -> layer name, for the modules that hold a quantized layer kept resident
        (its module, and the owners of a tensor group's tensors), of every handle."""
        out = {}
        for rq in list(_RESIDENT_QUANT):
            for layer, entries in list(rq._entries.items()):
                for e in entries:
                    out[id(layer)] = e[8]
                    owner = e[0]()
                    if owner is not None:
                        out[id(owner)] = e[8]
        return out

    def _check_load(self, taken, module, state_dict, prefix, local_metadata, strict, missing_keys,
                    unexpected_keys, error_msgs):
        """Values it could not quantize are taken out of the state dict before torch writes
        them, the error joining load_state_dict's own (_requantize_on_load's way)."""
        for owner, key, _, _, rows, fmt, dequant_dtype, _, name, qualified in self._entries.get(module, ()):
            value, p = state_dict.get(prefix + qualified), owner()._parameters.get(key)
            if not isinstance(value, torch.Tensor) or p is None or value.is_meta or value.shape != p.shape:
                continue  # torch's own checks
            value = value.detach().to(p.dtype)  # as it would be written
            if bool(torch.isfinite(value).all()):
                continue
            try:
                _C.quantized_values(value, rows, value.numel() // max(rows, 1), fmt, dequant_dtype)
                why = "it has NaN or Inf"
            except LayerstreamError as e:  # the packer's words: where the first one is
                why = str(e)
            del state_dict[prefix + qualified]
            taken.append(prefix + qualified)
            error_msgs.append(f'While loading "{prefix + qualified}" into quantized layer \'{name}\' (kept resident '
                              f'by the budget; its weight is unchanged): {why}')

    def _after_load(self, taken, module, incompatible_keys):
        for key in taken:
            if key in incompatible_keys.missing_keys:
                incompatible_keys.missing_keys.remove(key)
        taken.clear()
        self.refresh(module)

    def _before_call(self, module, args):
        if not torch.compiler.is_compiling():
            for owner, key, *_, name, _ in self._entries.get(module, ()):
                p = owner()._parameters.get(key)
                if p is not None and p.requires_grad:  # unfrozen after offload() (frozen then: _formats.py)
                    raise LayerstreamError(quantized_untrainable(
                        f"layer '{name}' (kept resident by the budget)", "it holds its quantized values, quantized "
                        "again after each write, which would undo a training step") + "; freeze it again "
                        "(requires_grad_(False)) to run the model")
            self.refresh(module)

    def refresh(self, module: nn.Module) -> None:
        for e in self._entries.get(module, ()):
            owner, key, param, version, rows, fmt, dequant_dtype, checksum, _, _ = e
            p = owner()._parameters.get(key)
            if p is None or (p is param and p._version == version):
                continue
            if _C.tensor_checksum(p) != checksum:  # new values (a write of its own ones stays as it is)
                try:
                    values = _C.quantized_values(p.detach(), rows, p.numel() // max(rows, 1), fmt, dequant_dtype)
                except LayerstreamError as err:
                    raise LayerstreamError(f"quantized layer '{e[8]}' (kept resident by the budget) cannot quantize "
                                           f"the values written into it after offload(): {err}") from None
                with torch.no_grad():
                    p.copy_(values)
                e[7] = _C.tensor_checksum(p)
            e[2], e[3] = p, p._version

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self._entries = [], weakref.WeakKeyDictionary()
        _RESIDENT_QUANT.discard(self)


# The ResidentQuantized that hold layers (armed, not yet removed): what held() reads.
_RESIDENT_QUANT: "weakref.WeakSet[ResidentQuantized]" = weakref.WeakSet()


class _StreamedApply:
    """The ``_apply`` offload() installs on a streamed module (an instance attribute;
    ``model.to()``, ``.cuda()``, ``.half()`` ... reach every module through it).

    Streamed weights live in host memory by design, so a move of the model to the
    compute device (what HF Trainer, accelerate's prepare() and pipelines do) is a
    no-op for them, as are conversions that change nothing (``.float()`` on an fp32
    model). Anything else (another device, another dtype) would break the layer's
    link to its host copy: it raises before anything is changed, naming detach().
    Other parameters, buffers and children of the module (rare on a Linear/conv)
    are converted as usual."""

    __slots__ = ("_module_ref", "_compute", "_name", "_verdicts", "_keys", "_remedy")

    # What the refusal tells offload() users to do instead.
    OFFLOAD_REMEDY = ("Convert the model before offload(), or call handle.detach() first (to free "
                      "the device memory for a while: model.to('cpu') on the model given to offload() "
                      "(not a part of it, nor a module made around it later: torch.compile, peft), or "
                      "handle.suspend(); then "
                      "model.to(<compute device>) or handle.resume()).")

    def __init__(self, module: nn.Module, compute_device: torch.device, name: str,
                 keys: Sequence[str] = ("weight", "bias"), remedy: str = OFFLOAD_REMEDY):
        # Weakly: this object is an attribute of the module (Note [Nothing offload() puts on
        # a model refers back to it], _handle.py).
        self._module_ref, self._compute, self._name = weakref.ref(module), compute_device, name
        self._verdicts = None  # dtype -> allowed (and _moved_format's), shared by _RootApply during one conversion
        self._keys = tuple(keys)  # the streamed parameters (a tensor group: all of them)
        self._remedy = remedy  # layerstream.compat names its own ways out

    @property
    def _module(self) -> nn.Module:
        return self._module_ref()

    def _allowed(self, fn, dtype: torch.dtype) -> bool:
        if self._verdicts is not None:
            if dtype not in self._verdicts:
                self._verdicts[dtype] = self._probe(fn, dtype)
            return self._verdicts[dtype]
        return self._probe(fn, dtype)

    def _probe(self, fn, dtype: torch.dtype) -> bool:
        try:  # a move to the meta device (model.to("meta")) is not a no-op: refused
            if fn(torch.empty(0, dtype=dtype)).is_meta:
                return False
        except Exception:  # noqa: BLE001 - e.g. .cuda() without a GPU: decided below
            pass
        try:  # a no-op conversion keeps a meta tensor as it is
            out = fn(torch.empty(0, dtype=dtype, device="meta"))
            if isinstance(out, torch.Tensor) and out.is_meta:
                return out.dtype == dtype
        except Exception:  # noqa: BLE001 - a move: meta tensors cannot be copied out
            pass
        try:  # a move: only to the compute device, in the same dtype
            out = fn(torch.empty(0, dtype=dtype))
        except Exception:  # noqa: BLE001
            return False
        return isinstance(out, torch.Tensor) and out.device == self._compute and out.dtype == dtype

    def _shares(self, fn) -> bool:
        """Whether `fn` moves a host tensor into shared memory in place (model.share_memory()).
        On a GPU the dtype probe refuses it as a move to the host; on the sim device, which
        computes on the host, it took it for a no-op move and left the streamed weights
        unshared, the call returning as if they were shared."""
        verdicts = self._verdicts if self._verdicts is not None else {}
        if "shares" not in verdicts:
            try:
                out = fn(torch.empty(0))
                verdicts["shares"] = isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.is_shared()
            except Exception:  # noqa: BLE001 - not a share (e.g. .cuda() without a GPU)
                verdicts["shares"] = False
        return verdicts["shares"]

    def check(self, fn) -> None:
        module = self._module
        if self._shares(fn):
            detach = "handle.detach()" if self._remedy == self.OFFLOAD_REMEDY else "MemoryManager.detach(model)"
            raise LayerstreamError(
                f"streamed layer '{self._name}' keeps its weights in layerstream's host store, where the engine "
                f"streams them from: share_memory() would move them into shared memory, away from the engine "
                f"(nothing was shared). Streamed weights cannot be shared with other processes: call {detach} "
                f"first (the weights become ordinary tensors), or let each process load and offload() its own "
                f"copy of the model.")
        w = module._parameters.get("weight", module.__dict__.get("weight"))
        for key, p in ((k, w if k == "weight" else module._parameters.get(k)) for k in self._keys):
            # A torch quantized (qint8) weight is probed as the int8 it stores: not
            # floating point, so conversions leave it as it is.
            if p is not None and not self._allowed(fn, torch.int8 if p.is_quantized else p.dtype):
                raise LayerstreamError(
                    f"streamed layer '{self._name}' keeps its weights in host memory and computes on "
                    f"{self._compute}: model.to()/cuda() to that device is fine (the streamed layers "
                    f"stay as they are), but this conversion would move them elsewhere or change "
                    f"their dtype ({key} is {p.dtype}). {self._remedy}")
            if p is not None and p.dim() in (4, 5) and self._relayouts(fn, p):
                raise LayerstreamError(
                    f"streamed layer '{self._name}' keeps its weights in host memory in the layout they had at "
                    f"offload() (strides {tuple(p.stride())}); this conversion would give {key} another memory "
                    f"layout (e.g. model.to(memory_format=torch.channels_last)), which the streamed layer would "
                    f"not take. Convert the model's layout before offload(), or call handle.detach() first")

    def _relayouts(self, fn, p) -> bool:
        """Whether `fn` (a conversion nn.Module._apply hands each tensor) gives a 4-D/5-D
        tensor of p's shape and strides other strides (model.to(memory_format=...): the
        dtype probe's empty tensors have no layout to change). Probed on the meta device;
        a conversion that cannot run there is a move (model.to(device, memory_format=...)),
        whose memory format _moved_format finds, then applied to p's shape and strides on
        the meta device as the form without a move is."""
        try:
            out = fn(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta"))
        except Exception:  # noqa: BLE001 - a move: meta tensors cannot be copied out
            fmt = self._moved_format(fn, p.dim(), torch.float32 if p.is_quantized else p.dtype)
            if fmt is None:
                return False
            return torch.empty_strided(p.shape, p.stride(), device="meta").to(memory_format=fmt).stride() != p.stride()
        return isinstance(out, torch.Tensor) and out.is_meta and out.stride() != p.stride()

    def _moved_format(self, fn, dim: int, dtype: torch.dtype):
        """The memory format a move `fn` gives every `dim`-D tensor (model.to(device,
        memory_format=...)), or None when it keeps each one's own (no memory_format). Probed
        on two host tensors of 2 per dimension, one contiguous and one channels_last (sizes
        at which no tensor is both); a conversion that fails on them is the dtype probe's to
        judge (None). One probe per conversion and dim when _RootApply shares its verdicts."""
        key = ("memory_format", dim)
        if self._verdicts is not None and key in self._verdicts:
            return self._verdicts[key]
        last = torch.channels_last if dim == 4 else torch.channels_last_3d
        outs = []
        for fmt in (torch.contiguous_format, last):
            try:
                outs.append(fn(torch.empty([2] * dim, dtype=dtype, memory_format=fmt)))
            except Exception:  # noqa: BLE001
                outs.append(None)
        found = None
        if all(isinstance(o, torch.Tensor) and o.dim() == dim for o in outs):
            found = next((f for f in (torch.contiguous_format, last)
                          if all(o.is_contiguous(memory_format=f) for o in outs)), None)
        if self._verdicts is not None:
            self._verdicts[key] = found
        return found

    def __call__(self, fn, recurse=True):
        self.check(fn)
        module = self._module
        mine = {k: module._parameters[k] for k in self._keys if module._parameters.get(k) is not None}
        others = [k for k in module._parameters if k not in mine]
        if others or module._buffers or module._modules:
            # Convert the rest with nn.Module's own _apply, the streamed parameters
            # held out (and put back in their places: parameter order is visible).
            order = list(module._parameters)
            for k in mine:
                del module._parameters[k]
            try:
                type(module)._apply(module, fn, recurse)
            finally:
                rest = dict(module._parameters)
                module._parameters.clear()
                for k in order:
                    module._parameters[k] = mine[k] if k in mine else rest.pop(k)
                module._parameters.update(rest)
        return module


class _RootApply:
    """The ``_apply`` offload() installs on the model it was given: checks every
    streamed layer first, so that a refused conversion (``model.half()``) raises
    before any part of the model changed, then converts as nn.Module does (the
    streamed layers' own _StreamedApply keeps their weights as they are)."""

    __slots__ = ("_model_ref", "_layers")

    def __init__(self, model: nn.Module, layers: list):
        # The model weakly, as its layers' _StreamedApply do theirs (Note [Nothing offload()
        # puts on a model refers back to it], _handle.py).
        self._model_ref, self._layers = weakref.ref(model), layers

    @property
    def _model(self) -> nn.Module:
        return self._model_ref()

    def __deepcopy__(self, memo):
        # A copy of a part of the model (copy.deepcopy(model.blocks[0])) is a plain
        # module: its _apply checks nothing (its streamed layers' copies are plain too).
        return _RootApply(memo.get(id(self._model), self._model), [])

    def __reduce__(self):
        return _RootApply, (self._model, [])

    def __call__(self, fn, recurse=True):
        # The verdict depends on the conversion and the dtype only: probe each
        # dtype once for all layers (their own _apply then finds it too).
        verdicts = {}
        for layer in self._layers:
            layer._verdicts = verdicts
        try:
            for layer in self._layers:
                layer.check(fn)
            return type(self._model)._apply(self._model, fn, recurse)
        finally:
            for layer in self._layers:
                layer._verdicts = None


class _NoToEmpty:
    """The ``to_empty`` offload() installs on the model, on the modules between it and
    the streamed ones and on those (instance attributes; install_subtree_checks).

    ``to_empty(device=<compute device>)`` converts through ``_apply`` as a move to
    that device does, and no probe of the conversion tells them apart (a fresh
    ``empty_like`` on the same device is a move's result too): _StreamedApply would
    let it through and keep the streamed weights, while every resident tensor
    (norms, biases, the layers a budget keeps) became uninitialised memory. So it is
    refused here, before anything changes. To the meta device it is the class's own
    method, which the conversion checks refuse as they refuse ``model.to("meta")``."""

    __slots__ = ("_module_ref", "_name")

    def __init__(self, module: nn.Module, name: Optional[str]):
        # name None: a plain copy's, which refuses nothing. The module weakly: this object is
        # its attribute (Note [Nothing offload() puts on a model refers back to it], _handle.py).
        self._module_ref, self._name = weakref.ref(module), name

    @property
    def _module(self) -> nn.Module:
        return self._module_ref()

    def __deepcopy__(self, memo):
        # A copy of the model is a plain module (as _RootApply's copy checks nothing).
        return _NoToEmpty(memo.get(id(self._module), self._module), None)

    def __reduce__(self):
        return _NoToEmpty, (self._module, None)

    def __call__(self, *, device, recurse=True):
        module = self._module
        if self._name is not None and torch.device(device).type != "meta":
            raise LayerstreamError(
                f"to_empty(device={str(device)!r}) of {self._name} after offload() would replace its "
                f"resident tensors (norms, biases, layers kept resident) with uninitialised memory, "
                f"while its streamed layers keep their weights in host memory: the model would compute "
                f"with garbage. To load new values, use load_state_dict() (streamed layers take them "
                f"too); to start from empty tensors, undo the offload first (handle.detach(); "
                f"layerstream.compat: MemoryManager.detach(model)).")
        return type(module).to_empty(module, device=device, recurse=recurse)


def install_subtree_checks(root: nn.Module, layers) -> list:
    """A _RootApply on every module between `root` and its streamed modules (`layers`:
    (name relative to root, the _apply objects of that layer's modules)), so that a
    refused conversion of a part of the model (``model.blocks[0].half()``) raises before
    any of that part changed, as the root's does: nn.Module._apply converts children in
    order, and a LayerNorm before the streamed Linear was already fp16 when the Linear
    refused. Modules with an _apply of their own (streamed ones) are left alone. And a
    _NoToEmpty on those modules, the root and the streamed modules. And the streamed
    parameters' host bytes to the sharing check (_NoSharing). Returns what it
    installed, (weak reference to the module, attribute, object) and the _NoSharing
    (remove_subtree_checks removes them)."""
    below = {}
    for name, applies in layers:
        parts = name.split(".") if name else []
        for i in range(1, len(parts)):
            below.setdefault(".".join(parts[:i]), []).extend(applies)
    installed = []
    for prefix, applies in below.items():
        module = root.get_submodule(prefix)
        if "_apply" in module.__dict__:
            continue
        module._apply = _RootApply(module, applies)
        installed.append((weakref.ref(module), "_apply", module._apply))
    guarded = set()
    for name in [""] + list(below) + [name for name, _ in layers]:
        module = root.get_submodule(name)
        if id(module) in guarded or "to_empty" in module.__dict__:
            continue
        guarded.add(id(module))
        module.to_empty = _NoToEmpty(module, f"'{name}'" if name else "the offloaded model")
        installed.append((weakref.ref(module), "to_empty", module.to_empty))
    installed.append(_NoSharing(layers))
    return installed


def remove_subtree_checks(installed: list) -> None:
    for entry in installed:
        if isinstance(entry, _NoSharing):
            entry.end()
            continue
        module, attr, obj = entry[0](), entry[1], entry[2]
        if module is not None and module.__dict__.get(attr) is obj:
            del module.__dict__[attr]


class _NoSharing:
    """The host bytes of one model's streamed parameters (install_subtree_checks: the
    layers' _StreamedApply name them), which torch.multiprocessing must not move.

    Sending a tensor through torch.multiprocessing (a Queue, a Pipe, a Process's
    arguments: its ForkingPickler) or ``share_memory_()`` moves the tensor's storage
    into shared memory in place: the parameter then points away from the host copy
    the engine streams from, and the model's next call failed with "replaced or moved
    after offload()", which named module.to() and .data, not the send. A state_dict()'s
    tensors are views of the same storages. torch has no hook per storage, so its two
    ways into shared memory (``UntypedStorage._share_fd_cpu_`` and
    ``_share_filename_cpu_``, which both paths end in) check these bytes first, from
    the first offload() of the process on (_guard_torch_sharing); ended by detach()."""

    __slots__ = ("ranges", "starts", "__weakref__")

    def __init__(self, layers):
        from ._standin import StandIn
        self.ranges = []  # (first byte, end, name)
        for _, applies in layers:
            for apply in applies:
                if not isinstance(apply, _StreamedApply):
                    continue
                for key in apply._keys:
                    p = apply._module._parameters.get(key)
                    if p is None or isinstance(p, StandIn) or p.is_meta or p.device.type != "cpu" or not p.numel():
                        continue  # no host bytes of its own (packed, in its file)
                    start = p.data_ptr()
                    self.ranges.append((start, start + p.numel() * p.element_size(),
                                        f"{apply._name}.{key}" if apply._name else key))
        self.ranges.sort()  # by first byte: a tensor's bytes do not overlap another's
        self.starts = [first for first, _, _ in self.ranges]
        _guard_torch_sharing()
        _NO_SHARING.add(self)

    def holding(self, start: int, end: int) -> Optional[str]:
        """The name of a parameter with bytes in [start, end), or None. The last one that
        begins before `end` is such one if any is (they do not overlap)."""
        i = bisect.bisect_left(self.starts, end)
        if i and self.ranges[i - 1][1] > start:
            return self.ranges[i - 1][2]
        return None

    def end(self) -> None:
        _NO_SHARING.discard(self)


_NO_SHARING: "weakref.WeakSet[_NoSharing]" = weakref.WeakSet()


def _refuse_sharing(storage) -> None:
    """Raises when `storage` holds bytes of a streamed parameter (_NoSharing)."""
    if not _NO_SHARING:
        return
    start = storage.data_ptr()
    end = start + storage.nbytes()
    for guard in list(_NO_SHARING):
        name = guard.holding(start, end)
        if name is not None:
            raise LayerstreamError(
                f"streamed parameter '{name}' lives in layerstream's host store, where the engine streams it "
                f"from: torch.multiprocessing would move it into shared memory (a tensor or a state_dict() "
                f"sent through its Queue, Pipe or a Process's arguments, or share_memory_()), away from the "
                f"engine, and the model's next call would fail. Send a copy instead (param.detach().clone(), "
                f"{{k: v.clone() for k, v in model.state_dict().items()}}), or detach() the offload handle "
                f"first (the weights become ordinary tensors).")


def _guard_torch_sharing() -> None:
    """Once per process: torch.UntypedStorage's ways into shared memory refuse a streamed
    parameter's bytes first (_NoSharing)."""
    for attr in ("_share_fd_cpu_", "_share_filename_cpu_"):
        share = getattr(torch.UntypedStorage, attr, None)
        if share is None or getattr(share, "_layerstream_checked", False):
            continue

        def checked(self, *args, _share=share, **kwargs):
            _refuse_sharing(self)
            return _share(self, *args, **kwargs)

        functools.update_wrapper(checked, share)
        checked._layerstream_checked = True
        setattr(torch.UntypedStorage, attr, checked)


def _requested_move(kind: str, args, kwargs) -> Tuple[Optional[torch.device], Optional[torch.dtype], bool]:
    """What ``model.<kind>(*args, **kwargs)`` asks for (kind: "to", "cpu" or
    "cuda"): the device it moves to (None: none), the dtype (None: none), and
    whether it asks for a memory format too."""
    if kind == "cpu":
        return torch.device("cpu"), None, False
    if kind == "cuda":
        index = args[0] if args else kwargs.get("device")
        if isinstance(index, torch.device):
            return index, None, False
        return (torch.device("cuda") if index is None else torch.device("cuda", index)), None, False
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype, memory_format is not None


def _is_compute(device: torch.device, compute: torch.device) -> bool:
    """Whether a requested device is the compute device (a CUDA device named
    without an index is taken as it)."""
    return device.type == compute.type and device.index in (None, compute.index)


class _HostMove:
    """``model.to`` / ``.cpu`` / ``.cuda`` of a model offload() streams on another
    device than the host (instance attributes; docs/design/streaming-core.md,
    "Suspend"): a move of the whole model to the host that converts nothing else
    (no dtype but the one every floating-point parameter has, no memory format;
    what accelerate's and diffusers' CPU offload hooks and training scripts
    freeing memory for sampling call) suspends the handle; a move to the compute
    device resumes it, then converts as usual (``pipe.to("cuda", torch.bfloat16)``);
    anything else is the class's own method (whose refusals stand)."""

    __slots__ = ("_kind", "_model", "_handle", "_compute")

    def __init__(self, kind: str, model: nn.Module, handle, compute: torch.device):
        self._kind = kind
        self._model = weakref.ref(model)
        self._handle = weakref.ref(handle)
        self._compute = compute

    def __call__(self, *args, **kwargs):
        model, handle = self._model(), self._handle()
        if handle is not None and handle._engine is not None:
            device, dtype, memory_format = _requested_move(self._kind, args, kwargs)
            if device is not None and device.type == "cpu" and not memory_format and (
                    dtype is None or all(p.dtype == dtype for p in model.parameters() if p.is_floating_point())):
                handle.suspend()
                return model
            if device is not None and _is_compute(device, self._compute) and handle.suspended:
                handle.resume()
        return getattr(type(model), self._kind)(model, *args, **kwargs)
