"""The forwards offload() installs: a streamed layer's (_StreamedForward), a streamed
embedding subclass's base (_LookupBase) and a tensor group's (_GroupForward, _GroupFn).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import operator
import threading
import types
import weakref
from typing import Dict, List, Sequence

import torch
import torch.nn as nn

from . import _C, _dynamo_marks, _group_op
from ._discovery import _is_experts, _mode_padding, _reads_routed_experts_only, as_held
from ._interrupts import held_interrupts
from ._standin import StandIn

LayerstreamError = _C.LayerstreamError


_NO_COPY = ("an offloaded model cannot be {what} (its streamed weights live in layerstream's host "
            "store, which this process owns); {instead}, or call handle.detach() first")


class _RefusesCopy:
    """Pickling (torch.save(model)) or deep-copying an object offload() attached to a
    model fails with a message that says what to do instead of pickle's own error."""

    __slots__ = ()

    def __reduce_ex__(self, protocol):
        raise LayerstreamError(_NO_COPY.format(
            what="pickled (e.g. torch.save(model), or sent to a 'spawn' DataLoader worker or process)",
            # torch.save opens its target before it pickles: this refusal cannot come first.
            instead="save model.state_dict() instead (quantized weights are data-less there until "
                    "detach()); torch.save(model, path) has already truncated `path`, so a checkpoint that was "
                    "there is lost: save to a new path and rename it over the old one once written; a worker "
                    "process builds and offloads its own model"))

    def __deepcopy__(self, memo):
        raise LayerstreamError(_NO_COPY.format(what="deep-copied", instead="deep-copy it before offload()"))


def _no_hook(*args) -> None:
    """What a _DroppedInCopies hook is in a copy of its module: nothing."""


def _make_no_hook():
    return _no_hook


class _DroppedInCopies:
    """A hook offload() puts on a module below the model's root (Note [Calls that enter the
    model below its root], _calls.py). A copy of that module (copy.deepcopy, pickle) is a
    plain module, as its streamed layers' copies are (_PlainCopy): there it is _no_hook."""

    __slots__ = ()

    def __deepcopy__(self, memo):
        return _no_hook

    def __reduce_ex__(self, protocol):
        return _make_no_hook, ()


class _PlainCopy:
    """``copy.deepcopy()`` of one streamed module (an instance attribute offload()
    installs): a plain copy, as detach() would leave the module, with its values
    (dense, on the host) and none of layerstream's attachments; added to the model,
    it is a resident module like any other added after offload(). peft's
    ``modules_to_save`` (a classification head, ``lm_head``) copies modules so. A
    whole offloaded model still refuses (its call hooks do). Weights layerstream holds
    packed or in a file (quantize=, GGUF, the disk tier) have no dense values here:
    refused, naming what to do (docs/design/torch-glue.md, "A copy of one streamed
    layer")."""

    __slots__ = ("_attached",)

    def __init__(self, attached):
        self._attached = attached  # _handle._Attached

    def __call__(self, memo):
        a = self._attached
        module = a.module
        held = [n for n, p in module.named_parameters() if isinstance(p, StandIn)]
        if held:
            raise LayerstreamError(
                f"streamed layer '{a.name}' cannot be copied (copy.deepcopy, e.g. by peft's modules_to_save): "
                f"layerstream holds {', '.join(held)} packed or in a file (quantize=, GGUF, the disk tier), "
                f"with no dense values to copy. Keep this layer dense (e.g. quantize={{'{a.name}': None, "
                f"'*': ...}}), or copy it before offload()")
        gone = object()  # what layerstream put on the module (and a group's owners): left out of the copy
        for m in [module] + list(a.owners):
            for key in ("__deepcopy__", "forward", "_apply", "_layerstream_handle"):
                obj = m.__dict__.get(key)
                if obj is not None and (key != "forward" or m is module):
                    memo[id(obj)] = gone
        # What copy.deepcopy() does for an object without __deepcopy__ (the module's
        # class, its __dict__ copied through memo), since this one has one.
        rv = module.__reduce_ex__(4)
        clone = copy._reconstruct(module, memo, *rv)
        for sub in clone.modules():
            for key in [k for k, v in sub.__dict__.items() if v is gone]:
                del sub.__dict__[key]
        if a.had_forward:  # a forward of its own before offload() (e.g. diffusers' layerwise casting)
            clone.__dict__["forward"] = copy.deepcopy(a.old_forward, memo)
        original = type(clone).__dict__.get("_layerstream_original_class")
        if original is not None:  # an Embedding subclass that looked up through super()
            clone.__class__ = original
            clone.__dict__.pop("_layerstream_lookup", None)
        ids = {h.id for h in a.hooks}
        for name, hooks in list(clone.__dict__.items()):
            if name.endswith("_hooks") and isinstance(hooks, dict):
                for i in ids & set(hooks):
                    del hooks[i]
        return clone


class _OwnForward(_RefusesCopy):
    """`fn` bound to `module` (a module's forward, as a streamed forward falls back to it,
    or as activation offload puts it in the model's __dict__), with the module held
    weakly: it is an attribute of the module, and a bound method would refer back to it
    (Note [Nothing offload() puts on a model refers back to it], _handle.py). It reads as
    the bound method: __self__, __func__, __code__ (torch.export reads it) and its
    signature (transformers' Trainer keeps the dataset columns it names)."""

    __slots__ = ("_fn", "_module")

    def __init__(self, fn, module: nn.Module):
        self._fn, self._module = fn, weakref.ref(module)

    def __call__(self, *args, **kwargs):
        return self._fn(self._module(), *args, **kwargs)

    @property
    def __self__(self):
        return self._module()

    @property
    def __func__(self):
        return self._fn

    @property
    def __code__(self):
        return self._fn.__code__

    @property
    def __signature__(self):
        import inspect
        return inspect.signature(self._fn.__get__(self._module()))


def _held_weakly(original, module: nn.Module):
    """`original` (the forward a streamed forward falls back to), a bound method of
    `module` as an _OwnForward; anything else (a forward of the module's own that a
    library set before offload()) as it is."""
    if isinstance(original, types.MethodType) and original.__self__ is module:
        return _OwnForward(original.__func__, module)
    return original


class _LookupBase(_RefusesCopy, nn.Embedding):
    """The base offload() slides under a streamed Embedding subclass that calls
    super().forward (see _lookup_through_super): its forward is the streamed
    lookup. Copying or pickling the module is refused, as for every streamed
    module."""

    def forward(self, input):
        return self.__dict__["_layerstream_lookup"](input)


_LOOKUP_CLASSES: Dict[type, type] = {}


def _with_streamed_lookup(cls: type) -> type:
    """cls with _LookupBase after it in the method order (one class per cls,
    same name), so that cls's super().forward reaches the streamed lookup."""
    if cls not in _LOOKUP_CLASSES:
        _LOOKUP_CLASSES[cls] = type(cls.__name__, (cls, _LookupBase),
                                    {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                     "_layerstream_original_class": cls})
    return _LOOKUP_CLASSES[cls]


# "engine id:layer" -> the layer's _StreamedForward, for _call_spec (weak: the entry goes with it).
_STREAMED: Dict[str, "weakref.ref"] = {}


@_dynamo_marks.assume_constant_result
def _call_spec(key: str) -> str:
    """What a traced call of the layer's operator names besides (engine, layer):
    Engine::op_spec, asked when Dynamo traces the call (a constant of the graph, so
    torch's caches key on it), since it names where the weight gradients go then
    (Note [An operator call names its layer's layout], ops_spec.cpp)."""
    fwd = _STREAMED[key]()
    return fwd._op_spec(fwd._index)


# What a streamed conv or table's engine layer took at offload() (add_conv's stride, padding,
# dilation, groups, and padding_mode's F.pad; add_embedding's padding_idx, scale_grad_by_freq,
# sparse; max_norm and its norm_type keep a table resident): torch's modules read them at
# every call, the engine does not, so a change after offload() is refused at the next call.
_TAKEN_AT_OFFLOAD = {"conv": ("stride", "padding", "dilation", "groups", "padding_mode"),
                     "embedding": ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")}


def _restates(name: str, was, now, dims: int) -> bool:
    """Whether `now`, a value of the _TAKEN_AT_OFFLOAD attribute `name` set after offload(),
    computes as `was` (offload()'s) in torch's conv or lookup: a list for a tuple of the same
    ints ([1, 1] for (1, 1)), and for a conv's stride, padding or dilation (`dims` of them)
    one int for a tuple that repeats it once per dimension (1 for (1, 1): F.conv2d expands it
    so), either way round. An int is what torch's conv takes for one (a numpy int too); a
    float or a bool equal to it ((1.0, 1.0) == (1, 1) in Python) torch refuses, so it counts
    as a change, as does anything else (the streamed layer would compute with `was`)."""
    if name in _INTS_PER_DIM and not isinstance(was, str) and not isinstance(now, str):
        return _per_dim(now, dims) == _per_dim(was, dims) is not None
    if name in ("groups", "padding_idx") and now is not None:
        return _as_int(now) == was
    if name in ("scale_grad_by_freq", "sparse"):
        return isinstance(now, bool) and now == was
    if isinstance(was, (list, tuple)) and isinstance(now, (list, tuple)):
        return tuple(now) == tuple(was)
    return was == now


# A conv's attributes that hold an int per spatial dimension, or one int for all of them.
_INTS_PER_DIM = ("stride", "padding", "dilation")


def _as_int(v):
    """`v` as torch's conv and lookup take an int argument (an int, a numpy int, a 0-dim
    integer tensor), None for what they refuse (a float, a bool, anything else)."""
    if isinstance(v, (bool, float)):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def _per_dim(v, dims: int):
    """A conv's stride, padding or dilation `v` as the tuple of ints torch's conv reads
    (one int repeated `dims` times), None for one it refuses."""
    ints = tuple(map(_as_int, v)) if isinstance(v, (list, tuple)) else (_as_int(v),) * dims
    return None if None in ints else ints


_REPLACED = ("the parameters of streamed layer '{name}' were replaced after offload() (e.g. by accelerate's "
             "cpu_offload() or dispatch_model(), load_state_dict(assign=True), assigning a new nn.Parameter, "
             "or torch.func.functional_call); layerstream streams the original ones. Copy new values in place "
             "(load_state_dict() without assign, or param.data.copy_()), or call handle.detach() first.")


def _exported_as(original, current) -> bool:
    """Whether `current`, a module's tensor while non-strict torch.export traces it, stands
    for offload()'s `original`: export swaps each parameter for a fake tensor made from it,
    which the fake mode's converter remembers (a parameter replaced before the export has
    a fake of its own; the program would stream the original's values)."""
    if current is original:
        return True
    mode = getattr(current, "fake_mode", None)
    return original is not None and mode is not None and mode.fake_tensor_converter._get_memo(original) is current


class _StreamedForward(_RefusesCopy):
    """The forward offload() installs on a streamed module (an instance attribute).

    A small callable object rather than a closure, so that pickling the model
    (torch.save(model)) or deep-copying it fails with a message that says what
    to do instead of pickle's "Can't pickle local object"."""

    __slots__ = ("_run", "_index", "_original", "_weight", "_bias", "_params", "_module_ref", "_name",
                 "_lookup", "_op", "_engine_id", "_op_spec", "_key", "_standin", "_bias_standin", "_pad",
                 "_frozen", "_taken", "_taken_at", "__weakref__")

    def __init__(self, engine, index: int, kind: str, original, module: nn.Module, name: str):
        self._lookup = kind == "embedding"
        self._run = {"linear": engine.linear, "conv": engine.conv, "embedding": engine.embedding}[kind]
        # What torch.compile / torch.export record instead (Note [Streamed layers as custom ops]).
        self._op = {"linear": torch.ops.layerstream.linear, "conv": torch.ops.layerstream.conv,
                    "embedding": torch.ops.layerstream.embedding}[kind]
        self._engine_id = engine.id
        self._op_spec, self._key = engine.op_spec, f"{engine.id}:{index}"
        _STREAMED[self._key] = weakref.ref(self, lambda _, key=self._key: _STREAMED.pop(key, None))
        # A packed, GGUF or file stand-in is frozen, and Dynamo must not trace into it.
        self._standin = isinstance(module.weight, StandIn)
        self._bias_standin = isinstance(getattr(module, "bias", None), StandIn)  # e.g. a bias left in its file
        # The stand-ins, which no gradient reaches: unfreezing one after offload() is an error (_unfrozen).
        self._frozen = tuple(p for p in (module.weight, getattr(module, "bias", None)) if isinstance(p, StandIn))
        self._index, self._original, self._name = index, _held_weakly(original, module), name
        self._weight, self._bias = module.weight, getattr(module, "bias", None)
        # Direct dict access is cheaper than nn.Module.__getattr__; a weight that is
        # not a Parameter (e.g. a torch quantized tensor) lives in the instance dict,
        # read through the module, held weakly (this object is in that dict).
        self._params, self._module_ref = module._parameters, weakref.ref(module)
        self._pad = _mode_padding(module) if kind == "conv" else None  # padded as torch's _conv_forward pads
        self._taken = _TAKEN_AT_OFFLOAD.get(kind)  # None for a Linear
        self._taken_at = None if self._taken is None else self._taken_now()  # their values at offload()

    def __call__(self, x, *args, **kwargs):
        if args or kwargs:  # an unusual call signature: use the module's own forward
            return self._original(x, *args, **kwargs)
        if torch.compiler.is_compiling():
            return self._traced(x)
        self._check_own()
        if self._frozen:  # only layers with stand-ins pay for the check (the disk tier, GGUF)
            self._unfrozen()
        # By identity: a value set again, even an equal one ((1.0, 1.0) == (1, 1)), is checked.
        if self._taken is not None and any(map(operator.is_not, self._taken_now(), self._taken_at)):
            self._retaken()
        if self._pad is not None:  # the hot path: no call for the usual zero padding
            x = self._padded(x)
        # A parameter with gradient hooks gets its gradient through autograd
        # (synchronously) so that the hooks fire: the engine checks (EngineImpl::stages_grads).
        return self._run(self._index, x)

    def _check_own(self, now=None) -> None:
        """Raises when the module's parameters are no longer offload()'s: the engine would
        compute with the original values, and no gradient would reach the new tensors.
        `now`: (weight, bias) stand-ins for them (non-strict torch.export's, _exported_as)."""
        params, weight, bias = self._params, self._weight, self._bias
        if now is not None:
            if not (_exported_as(weight, now[0]) and _exported_as(bias, now[1])):
                raise LayerstreamError(_REPLACED.format(name=self._name))
        elif ((params["weight"] if "weight" in params else self._attr("weight")) is not weight or
                (params["bias"] if "bias" in params else self._attr("bias")) is not bias):
            raise LayerstreamError(_REPLACED.format(name=self._name))

    def _attr(self, key: str):
        """The module's instance attribute `key` (a weight that is not a Parameter), or None."""
        return self._module_ref().__dict__.get(key)

    def _unfrozen(self) -> None:
        """Raises when a stand-in of this layer (a weight the disk tier streams from its
        file, a GGUF weight) was unfrozen after offload(): no gradient can reach it, and
        torch would leave its .grad None (or fail with "element 0 of tensors does not
        require grad") without saying why."""
        for p in self._frozen:
            if not p.requires_grad:
                continue
            which = f"'{self._name}.{'weight' if p is self._weight else 'bias'}'"
            if getattr(p, "_disk_tier", False):
                raise LayerstreamError(
                    f"{which} requires grad, but offload() left it frozen in its file ({p.file_range.path}): the "
                    f"disk tier streams it from there and no gradient reaches it. To train it, unfreeze it before "
                    f"offload() (handle.detach(), requires_grad_(True), offload() again), so that it is read into "
                    f"RAM (host_budget must hold it); or keep it frozen (requires_grad_(False)), e.g. to train "
                    f"LoRA adapters over it")
            raise LayerstreamError(
                f"{which} requires grad, but layerstream holds it as a frozen stand-in ({type(p).__name__}) that no "
                f"gradient reaches; keep it frozen (requires_grad_(False)), or train an adapter over it (LoRA)")

    def _taken_now(self) -> list:
        """The module's current values of the attributes _TAKEN_AT_OFFLOAD names for it (a
        list comprehension: Dynamo traces it, and guards the graph on them)."""
        module = self._module_ref()
        return [getattr(module, name) for name in self._taken]

    def _retaken(self) -> None:
        """Raises naming the conv or table attribute (_TAKEN_AT_OFFLOAD) changed since offload();
        returns when each change only restates its value as torch's conv reads it (_restates)."""
        dims = len(getattr(self._module_ref(), "kernel_size", ()))
        changed = [(n, a, b) for n, a, b in zip(self._taken, self._taken_at, self._taken_now())
                   if not _restates(n, a, b, dims)]
        if not changed:
            return
        name, was, new = changed[0]
        raise LayerstreamError(
            f"streamed layer '{self._name}': its {name} changed after offload() ({was!r} -> {new!r}), but the "
            f"streamed layer computes with the one it had at offload(). Set it before offload(), or call "
            f"handle.detach() first (and offload() again)")

    def _padded(self, x):
        """The input of a conv whose padding_mode is not zeros, padded as torch pads it."""
        return x if self._pad is None else torch.nn.functional.pad(x, self._pad[0], mode=self._pad[1])

    def _traced(self, x):
        """The call as torch.compile / torch.export record it: one layerstream operator,
        given the parameters that require grad when a gradient is recorded (their
        gradients' edges; Note [Compiled weight gradients are staged], ops_compiled.cpp)."""
        weight, bias = self._weight, self._bias
        if torch.compiler.is_exporting() and not torch.compiler.is_dynamo_compiling():
            # Non-strict export swaps the module's parameters for its own tensors (the
            # program's PARAMETER inputs): the op's gradient edges go to those; the cached
            # ones would be lifted as constants, and no weight gradient would reach them.
            params = self._params
            weight = params["weight"] if "weight" in params else self._attr("weight")
            bias = params["bias"] if "bias" in params else self._attr("bias")
            self._check_own((weight, bias))
        else:
            # Under Dynamo (torch.compile, strict export) the check reads the module's
            # parameter entries, so the graph is guarded on them: a parameter replaced
            # after tracing recompiles, and raises here as the eager call does, instead of
            # the graph streaming the original weights while the new ones get no gradient.
            self._check_own()
        grad = torch.is_grad_enabled()
        if self._taken is not None:
            self._retaken()  # read under Dynamo (while tracing only): the graph is guarded on the attributes
        w = None if self._standin or not (grad and weight.requires_grad) else weight
        # A str key: Dynamo cannot hand assume_constant_result an int attribute (torch 2.14 keeps
        # it a lazy constant; blocks compiled one by one make the layer index a SymInt).
        spec = _call_spec(self._key)
        x = self._padded(x)
        if self._lookup:
            return self._op(x, w, self._engine_id, self._index, spec)
        b = None if self._bias_standin or not (grad and bias is not None and bias.requires_grad) else bias
        return self._op(x, w, b, self._engine_id, self._index, spec)


class _GroupForward(_RefusesCopy):
    """The forward offload() installs on a streamed tensor group (a mixture-of-experts
    module, _is_experts): the module's own forward runs with its parameters swapped,
    for the call, for views of a device slot that holds all of them (Engine.fetch /
    release). When a gradient is needed, _GroupFn runs it without a graph and runs it
    again in backward on the fetched weights (as activation checkpointing does), so no
    slot memory is saved for backward. A callable object for the reasons given in
    _StreamedForward. Two threads calling the same module take turns: the swap is on
    the module, so it is held under the group's lock (Note [Two threads and one tensor
    group])."""

    __slots__ = ("_engine", "_index", "_original", "_module_ref", "_slot_refs", "_params", "_name", "_device", "_experts",
                 "_averaged", "_experts_module", "_dense", "_adapted", "_layout", "_swap_lock", "__weakref__")

    def __init__(self, engine, index: int, original, module: nn.Module, slots: Sequence[tuple], name: str,
                 experts: int = 0):
        # The module and the owners of its tensors weakly: this object is the module's
        # attribute (Note [Nothing offload() puts on a model refers back to it], _handle.py).
        self._engine, self._index, self._name = engine, index, name
        self._original, self._module_ref = _held_weakly(original, module), weakref.ref(module)
        self._averaged = False  # gradients averaged over a process group (Handle._set_group)
        self._slot_refs = tuple((weakref.ref(o), k) for o, k, _ in slots)  # see _slots
        self._params = tuple(o._parameters[k] for o, k, _ in slots)
        self._device = torch.device(engine.compute_device)
        self._experts = experts  # > 0: the group was added indexed by expert (offload(experts="routed"))
        self._experts_module = _is_experts(module)
        # Which tensors are parameters, not packed stand-ins (frozen; Dynamo must not trace them).
        self._dense = tuple(i for i, p in enumerate(self._params) if not isinstance(p, StandIn))
        # Adapters active for the call (Note [Adapters on a streamed group's tensors],
        # _peft_params.py): (tensor index, function, its tensors), innermost last.
        self._adapted: List[tuple] = []
        self._layout = _group_op.layout(module, self._params)  # named by its operator's calls
        self._swap_lock = threading.RLock()  # held while the module holds the fetched views
        _group_op.register(self)  # reachable from its operator (Note [A tensor group as an operator])

    @property
    def _module(self) -> nn.Module:
        return self._module_ref()

    @property
    def _slots(self) -> tuple:
        """(owner, key) of each tensor (_group_slots)."""
        return tuple((o(), k) for o, k in self._slot_refs)

    def routed_experts(self, args, kwargs) -> List[int]:
        """The experts this call reads (its routing ids), when fewer than all of them may
        cross the bus: [] = all. One device-to-host sync (the ids are on the device)."""
        if not self._experts or not _reads_routed_experts_only(self._module):
            return []
        ids = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
        # The thresholds: core/offload_policy.h. Too many picks: skip the sync (whole group).
        if (not isinstance(ids, torch.Tensor) or ids.is_floating_point()
                or not _C.picks_may_route(ids.numel(), self._experts)):
            return []
        hit = torch.unique(ids.detach()).tolist()
        # Ids outside the experts (expert-parallel sentinels, which batched_mm clamps
        # onto the last expert) or too many of them: the whole group.
        if hit[0] < 0 or hit[-1] >= self._experts or not _C.fetch_some_experts(len(hit), self._experts):
            return []
        return hit

    def check_output(self, out, views) -> None:
        """A result that is a view of a fetched tensor would point into a slot that the
        next layers reuse: refused, as the group's limits say."""
        held = {v.untyped_storage().data_ptr() for v in views}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_nested and t.untyped_storage().data_ptr() in held:
                raise LayerstreamError(
                    f"streamed layer '{self._name}' returned a view of one of its parameters; a streamed "
                    f"tensor group's parameters are views of a device slot that the next layers reuse. "
                    f"Return a copy (e.g. .clone()), or keep this module resident (offload(exclude=[...])).")

    def slot_index(self, owner: nn.Module, key: str) -> int:
        """The index of `owner`'s tensor `key` among the group's tensors."""
        for i, (o, k) in enumerate(self._slot_refs):
            if o() is owner and k == key:
                return i
        raise LayerstreamError(f"streamed layer '{self._name}' holds no tensor '{key}' of that module")

    @contextlib.contextmanager
    def adapted(self, slot: int, fn, tensors: Sequence[torch.Tensor]):
        """While the block runs, the module's forward sees fn(fetched tensor #slot,
        *tensors) for that tensor (an adapter, _peft_params.py)."""
        self._adapted.append((slot, fn, tuple(tensors)))
        try:
            yield
        finally:
            self._adapted.pop()

    @contextlib.contextmanager
    def fetched(self, requires_grad=None, experts: Sequence[int] = (), adapters: Sequence[tuple] = ()):
        """The module's parameters swapped for views of the fetched slot while the
        block runs (work on them must be enqueued inside it); `requires_grad`: per
        tensor, whether the view is a leaf that requires grad (backward's recompute);
        `experts`: the only experts the block reads (routed_experts), [] = all;
        `adapters`: (tensor index, function, tensors): the module sees the function of
        the view instead (its result; the views yielded stay the fetched tensors)."""
        # Note [Two threads and one tensor group]
        # The module's own forward reads its parameters from the module, so for the
        # call they are swapped there for views of the slot: state every caller of this
        # module shares. Two threads calling it at once (two requests served by one
        # model) would each find the other's views in place of the parameters, and
        # whichever restored first would pull them from under the other. So the swap,
        # and the check that the parameters are still offload()'s, are held under one
        # lock per group: the calls take turns on this module (the layers around it
        # run in parallel, as a resident model's would). Reentrant: the same thread
        # entering again meets the check below, not a deadlock. The lock is taken
        # eagerly only (under torch.compile inside the group's operator, whose body
        # Dynamo does not trace).
        slots = self._slots
        with self._swap_lock:
            if any(o._parameters.get(k) is not p for (o, k), p in zip(slots, self._params)):
                raise LayerstreamError(
                    f"the parameters of streamed layer '{self._name}' were replaced after offload(); "
                    f"layerstream streams the original ones. Copy new values in place, or call "
                    f"handle.detach() first.")
            # A Ctrl-C lands once the call is done (Note [A Ctrl-C as a C++ call returns]): as
            # fetch() returned it dropped the slot's token, in the swap back it left the
            # module holding views of a freed slot.
            with held_interrupts():
                token, views = self._engine.fetch(self._index, list(experts))
                try:
                    if requires_grad is not None:
                        views = [v.detach().requires_grad_(bool(r)) for v, r in zip(views, requires_grad)]
                    seen = list(views)
                    for slot, fn, tensors in adapters:
                        seen[slot] = fn(seen[slot], *tensors)
                    try:
                        for (o, k), p, v in zip(slots, self._params, seen):
                            o._parameters[k] = as_held(p, v)
                        held = [o._parameters[k] for o, k in slots]
                        versions = [_group_op.version_of(t) for t in held]
                        yield views
                        for i, (t, version) in enumerate(zip(held, versions)):
                            if _group_op.version_of(t) != version:
                                raise self._written(i)
                    finally:
                        for (o, k), p in zip(slots, self._params):
                            o._parameters[k] = p
                finally:
                    self._engine.release(token)

    def _written(self, i: int, grad: bool = False) -> LayerstreamError:
        """The error for a forward that wrote the group's tensor #i in place: it wrote the
        slot's copy, and the write would be lost (the parameter, state_dict() and
        detach() never see it). `grad`: with grad mode on, to a tensor that requires grad,
        which torch refused (_group_op._own_tensor_written found it)."""
        owner, key = self._slots[i]
        where = next(n for n, m in self._module.named_modules() if m is owner)
        if grad:
            return LayerstreamError(
                f"streamed tensor group '{self._name}' writes its own parameter '{where + '.' if where else ''}{key}' "
                f"in place in its forward with grad enabled (e.g. a weight's clamp_() outside torch.no_grad()), which "
                f"torch refuses for a parameter that requires grad, resident or not; and the group's forward runs "
                f"on copies of its tensors in a device slot, so even under torch.no_grad() the write would be lost. "
                f"Write the parameter outside the forward, under torch.no_grad() (e.g. clamp it after "
                f"optimizer.step()), or write it under torch.no_grad() in the forward and keep the module "
                f"resident: offload(exclude=[{self._name!r}])")
        return LayerstreamError(
            f"streamed tensor group '{self._name}' writes its tensor '{where + '.' if where else ''}{key}' in place "
            f"in its forward (e.g. nn.Embedding(max_norm=...) renormalizing the rows it reads, or a weight's "
            f"clamp_()); the group's forward runs on copies of its tensors in a device slot, so the write would be "
            f"lost. Leave the module out of the group: offload(exclude=[{self._name!r}])")

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            # The eager paths check the parameters in fetched(); the operator's body is not
            # traced, so the traced call checks them here, as _StreamedForward._traced does
            # (Dynamo guards on the entries read; non-strict export reads its fakes).
            exporting = torch.compiler.is_exporting() and not torch.compiler.is_dynamo_compiling()
            if any(not _exported_as(p, o._parameters.get(k)) if exporting else o._parameters.get(k) is not p
                   for (o, k), p in zip(self._slots, self._params)):
                raise LayerstreamError(_REPLACED.format(name=self._name))
            if self._adapted:
                return _group_adapted_eagerly(self, args, kwargs)
            if _group_op.describable(args, kwargs):
                return _group_op.traced(self, args, kwargs)
            return _group_eagerly(self, args, kwargs)
        return self._run(*args, **kwargs)

    def _run(self, *args, **kwargs):
        for o, k in self._slots:
            if k in getattr(o, "parametrizations", {}):
                raise LayerstreamError(
                    f"streamed layer '{self._name}': its tensor '{k}' is parametrized during the call "
                    f"(torch.nn.utils.parametrize), so its value is computed from the tensor by code "
                    f"layerstream cannot stream, and whose gradients it could not return. peft's LoRA on "
                    f"expert parameters (LoraConfig(target_parameters=...)) is supported; for another "
                    f"parametrization keep this module resident (offload(exclude=[...])).")
        flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        positions = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        inputs = [flat[i] for i in positions]
        adapters = tuple(self._adapted)
        extras = [t for _, _, ts in adapters for t in ts]
        if not torch.is_grad_enabled() or not (any(t.requires_grad for t in inputs) or
                                                any(p.requires_grad for p in self._params) or
                                                any(t.requires_grad for t in extras)):
            with self.fetched(experts=self.routed_experts(args, kwargs), adapters=adapters) as views:
                out = self._original(*args, **kwargs)
                self.check_output(out, views)
                return out
        taken = set(positions)
        skeleton = [None if i in taken else a for i, a in enumerate(flat)]
        shape = tuple((slot, fn, len(ts)) for slot, fn, ts in adapters)
        box = [None]
        outs = _GroupFn.apply(self, (skeleton, spec, positions), shape, box, *inputs, *extras, *self._params)
        return torch.utils._pytree.tree_unflatten(list(outs), box[0])


@_dynamo_marks.disable(reason=(
    "a streamed tensor group (a mixture-of-experts module, nn.MultiheadAttention) called with arguments "
    "other than tensors and plain constants (None, bool, int, float, str) runs eagerly under "
    "torch.compile, with a graph break around it; pass such arguments as tensors or constants, or "
    "keep the module resident: offload(exclude=[...])"))
def _group_eagerly(fwd: _GroupForward, args, kwargs):
    """A tensor group's call under torch.compile that cannot be one operator (its arguments
    do not fit layerstream::group's description, _group_op.describable): it runs eagerly
    (Note [A tensor group as an operator], _group_op.py)."""
    return fwd._run(*args, **kwargs)


@_dynamo_marks.disable(reason=(
    "a streamed tensor group with a peft LoRA adapter on its tensors (LoraConfig(target_parameters=...)) "
    "runs eagerly under torch.compile, with a graph break around it (Note [Adapters on a streamed "
    "group's tensors])"))
def _group_adapted_eagerly(fwd: _GroupForward, args, kwargs):
    """A tensor group's call under torch.compile while an adapter is active on its tensors."""
    return fwd._run(*args, **kwargs)


def _rebuild(layout, tensors):
    skeleton, spec, positions = layout
    flat = list(skeleton)
    for i, t in zip(positions, tensors):
        flat[i] = t
    return torch.utils._pytree.tree_unflatten(flat, spec)


# What autograd's version check says (torch/csrc/autograd/saved_variable.cpp); its other
# errors on unpacking (a graph already freed, ...) are passed on as they are.
_INPLACE_ERROR = "modified by an inplace operation"


class _GroupFn(torch.autograd.Function):
    """A tensor group's computation when a gradient is needed, eagerly: forward without a
    graph (the slot is released right after); backward fetches the tensors again,
    re-runs the module's forward with the saved inputs (same RNG and autocast state)
    and differentiates it (_group_op.forward_without_graph / recompute_gradients, which
    the compiled path's operators share). Gradients of trainable group tensors are
    copied to the host and returned to autograd, which accumulates them into .grad."""

    @staticmethod
    def forward(ctx, fwd, layout, adapters, box, *tensors):
        # tensors: the call's, then the adapters' (`adapters`: (tensor index, function,
        # how many of them) each, _GroupForward.adapted), then the group's. `box`: a
        # one-entry list that gets the outputs' tree spec (the module's container).
        n_in, n_ex = len(layout[2]), sum(n for _, _, n in adapters)
        inputs, extras = tensors[:n_in], tensors[n_in:n_in + n_ex]
        ctx.fwd, ctx.layout, ctx.adapters = fwd, layout, adapters
        dev = fwd._device
        ctx.rng = _group_op.rng_state(dev)
        kind = dev.type
        ctx.autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind),
                        torch.is_autocast_cache_enabled())
        # Which inputs autocast would cast once (Note [Autocast casts a leaf once]); asked
        # here: the saved tensors come back as other objects (activations=, checkpointing).
        ctx.leaf = [_group_op.cast_once(t) for t in tensors[:n_in + n_ex]]
        # The parameters are saved too (no copy: host tensors, or the packed ones' stand-ins,
        # whose version a re-quantization bumps), so that a write between forward and
        # backward raises autograd's version error, as for a resident module, instead of
        # recomputing with other values. A tensor passed at several positions is saved
        # once: non-reentrant checkpointing unpacks each saved tensor as its own object,
        # and nn.MultiheadAttention's recompute took the path of query is not key (its
        # gradients a few ulps off the resident's); backward puts the positions back.
        distinct: Dict[int, torch.Tensor] = {}
        for t in tensors:
            distinct.setdefault(id(t), t)
        order = {k: i for i, k in enumerate(distinct)}
        ctx.where = [order[id(t)] for t in tensors]
        ctx.save_for_backward(*distinct.values())
        args, kwargs = _rebuild(layout, inputs)
        ctx.experts = fwd.routed_experts(args, kwargs)  # the recompute reads the same ones
        ctx.written = {}  # the buffers the forward wrote, as they were (Note [A group's buffers and the recompute])
        out = _group_op.forward_without_graph(fwd, functools.partial(_rebuild, layout), inputs, ctx.experts,
                                              adapters, extras, ctx.written)
        outs, box[0] = _group_op.flatten_outputs(fwd, out)  # the caller rebuilds the module's own container
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        fwd = ctx.fwd
        if torch.is_grad_enabled():
            raise LayerstreamError(f"layer '{fwd._name}': backward with create_graph=True (double "
                                   f"backward) is not supported through a streamed layer; keep it "
                                   f"resident (offload(exclude=[...]))")
        try:
            distinct = ctx.saved_tensors
        except RuntimeError as e:
            if _INPLACE_ERROR not in str(e):
                raise  # e.g. a second backward through a freed graph: torch's own message
            raise LayerstreamError(f"streamed layer '{fwd._name}': a tensor its backward needs (an input "
                                   f"or a parameter) was modified in place after the forward pass (e.g. "
                                   f"`h += attn(h, h, h)[0]`, or an optimizer step before this backward). A "
                                   f"streamed tensor group runs its forward again in backward from its inputs "
                                   f"and parameters, so they must stay unwritten until then, even where the "
                                   f"resident module would not need them: write `h = h + a` instead of "
                                   f"`h += a`. {e}") from None
        saved = [distinct[i] for i in ctx.where]
        n_in = len(ctx.layout[2])
        n_ex = sum(n for _, _, n in ctx.adapters)
        ins, ex, host = _group_op.recompute_gradients(
            fwd, functools.partial(_rebuild, ctx.layout), saved[:n_in], ctx.needs_input_grad[4:], ctx.rng,
            ctx.autocast, ctx.experts, grads, ctx.adapters, saved[n_in:n_in + n_ex], ctx.written,
            ctx.leaf)
        return (None, None, None, None, *ins, *ex, *host)
