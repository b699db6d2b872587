"""The data-less parameter a layer quantized by offload() keeps (_PackedWeight):
writes re-quantize or are refused, computing with it is refused (see _standin); and
peft's merges (and diffusers' fuses) into any layer offload() quantized, refused up front
(refuse_quantized_merge).
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from typing import Optional

import torch

from . import _C, _standin
from ._guards import ResidentQuantized, quantized_untrainable
from ._peft_params import _PEFT_BASE_READERS

LayerstreamError = _C.LayerstreamError


# The .data / .requires_grad descriptors, as __torch_function__ sees their getters and setters.
_DATA = torch._C.TensorBase.__dict__["data"]


_REQUIRES_GRAD = torch._C.TensorBase.__dict__["requires_grad"]


_CONVERSIONS = {"to", "cuda", "cpu", "half", "float", "double", "bfloat16", "type", "type_as",
                "pin_memory", "share_memory_"}


class _PackedWeight(_standin.StandIn):
    """The parameter a quantized streamed layer keeps: data-less (meta, same shape
    and dtype), because the weight lives packed in the engine's host store.

    A plain meta tensor would swallow writes: ``copy_`` into it, and
    ``w.data += delta`` (peft's merge_and_unload) would leave the packed weight
    as it was without a word, and ``torch.save(model.state_dict())`` would save
    no values. So:
      * ``copy_`` (what load_state_dict() does) re-quantizes the new values into
        the host store (``Engine.requantize``; a lossless-coded weight's is refused
        there: its coded size depends on its values);
      * every other in-place write, assigning ``.data``, converting or moving it
        (``model.to()``, ``.half()``) and pickling it (``torch.save``) raise a
        LayerstreamError that says what to do (``handle.detach()`` restores a
        dense, dequantized weight);
      * reads (shape, dtype, ``detach()`` for state_dict(), ...) behave as on a
        meta tensor; ``.data`` is the parameter itself, so writes through it
        are seen too;
      * ``.device`` is the CPU (``is_meta`` stays True): code that places new
        tensors beside the weight (peft puts a LoRA adapter on its base layer's
        weight's device) puts them in host memory, where streamed parameters
        live, instead of on the meta device, where their values would be lost.
    """

    def __new__(cls, shape, dtype, engine, index: int, name: str, part: Optional[int] = None, fmt: str = ""):
        self = cls._meta(shape, dtype)
        # part: a tensor group's tensor, else None; fmt: the format it is packed in
        # ("lossless" gets other advice: new values cannot be coded into its place).
        self._ls = (engine, index, name, part, fmt)
        return self

    @classmethod
    def _alias(cls, t, ls):
        out = torch.Tensor._make_subclass(cls, t, False)
        out._ls = ls
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0] if args else None
        ls = getattr(self, "_ls", None) if isinstance(self, _PackedWeight) else None
        descr = getattr(func, "__self__", None)
        name = getattr(func, "__name__", "")
        if ls is not None and descr is _DATA:
            if name == "__get__":
                return self  # so that writes through .data reach this handler
            value = args[1]
            if value is self or (isinstance(value, _PackedWeight) and value._ls == ls):
                return None  # Module._apply assigns an unchanged parameter back
            raise LayerstreamError(cls._msg(ls, "its .data cannot be replaced"))
        if ls is not None and descr is _REQUIRES_GRAD and name == "__set__" and not args[1] \
                and _peft_caller() == ("kbit", ""):
            # Its first loop freezes every parameter, its second casts them: refused at the
            # first stand-in of the first loop, before any weight is cast.
            raise LayerstreamError(cls._msg(ls, "it cannot be cast to float32", cast_yet=False))
        if ls is not None and (name == "requires_grad_" and (args[1:] or [kwargs.get("requires_grad", True)])[0]
                               or descr is _REQUIRES_GRAD and name == "__set__" and args[1]):
            if ls[4] == "lossless":
                raise LayerstreamError(
                    f"the weight of streamed layer '{ls[2]}' was frozen at offload(), so it is held coded "
                    f"(quantize='lossless') without what training needs; lossless weights do train: "
                    f"detach(), requires_grad_(True), then offload() again")
            raise LayerstreamError(quantized_untrainable(
                f"streamed layer '{ls[2]}'", "it is packed on the host and dequantized on the device"))
        if ls is not None and name == "copy_":
            engine, index, _, part, _ = ls
            if part is None:
                engine.requantize(index, args[1])
            else:
                engine.requantize_part(index, part, args[1])
                # A write, as far as autograd's version checks go: a tensor group's
                # backward whose forward used the old values raises (_GroupFn).
                torch.autograd.graph.increment_version(self)
            return self
        if ls is not None and name in ("detach", "alias", "detach_", "requires_grad_"):
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return self if out is self else cls._alias(out, ls)
        if ls is not None and name in _CONVERSIONS:
            with torch._C.DisableTorchFunctionSubclass():
                try:
                    out = func(*args, **kwargs)
                except Exception:  # noqa: BLE001 - e.g. "cannot copy out of meta tensor"
                    out = None
            if out is self:
                return self  # a no-op conversion (same dtype and device)
            raise LayerstreamError(cls._msg(ls, f"it cannot be converted or moved ({name}())"))
        if ls is not None and (name.endswith("_") and not name.startswith("_") or
                               name in ("__setitem__", "__iadd__", "__isub__", "__imul__",
                                        "__itruediv__", "__ior__", "__iand__")):
            raise LayerstreamError(cls._msg(ls, f"in-place {name}() cannot reach it"))
        # Any computation with it, in any argument position (x @ w.t(), F.linear(x, w)): refused.
        return cls._common(func, types, args, kwargs)

    def _refusal(self, what: str) -> str:
        caller = _peft_caller()
        if caller is not None:
            return _peft_refusal(self._ls, what, caller, cast_yet=True)
        return self._msg(self._ls, what) + "; run the module itself (it streams the weight), or detach() first"

    @staticmethod
    def _msg(ls, what: str, cast_yet: bool = True) -> str:
        caller = _peft_caller()
        if caller is not None:
            return _peft_refusal(ls, what, caller, cast_yet)
        if ls[4] == "lossless":
            # Its coded size depends on its values: the engine refuses copy_() and
            # load_state_dict() too, so they are not the way to new values here.
            return (f"the weight of streamed layer '{ls[2]}' is held lossless-coded (quantize='lossless', "
                    f"frozen at offload()) in layerstream's host store and this parameter is its data-less "
                    f"(meta) stand-in: {what}. New values cannot be coded into its place (not by "
                    f"load_state_dict() or weight.copy_() either): call handle.detach() (it restores the "
                    f"weight bit for bit), change it, then offload() again")
        return (f"the weight of quantized streamed layer '{ls[2]}' is packed in layerstream's host "
                f"store and this parameter is its data-less (meta) stand-in: {what}. Load new values "
                f"with load_state_dict() or weight.copy_() (they are re-quantized); to change it "
                f"otherwise (e.g. merge a LoRA adapter into it) or move the model, call "
                f"handle.detach() first (it restores the dense, dequantized weight)")

    def _save_refusal(self) -> str:
        return (self._msg(self._ls, f"it cannot be saved ({_standin.SAVERS})") +
                "; state_dict() of an offloaded model has no values for it: save only the trainable "
                "parameters (peft's save_pretrained does), or detach() first")

    def __deepcopy__(self, memo):
        raise LayerstreamError(self._msg(self._ls, "it cannot be deep-copied"))

    def __repr__(self):
        return (f"layerstream packed weight of '{self._ls[2]}' (meta stand-in, shape "
                f"{tuple(self.shape)}, {self.dtype})")


def _peft_caller() -> Optional[tuple]:
    """Which peft code is refused (the stack, read only on a refusal or a freeze):
    ("kbit", "") inside prepare_model_for_kbit_training(); (adapter type, peft's
    function) inside a peft tuner's code while it adds an adapter (inject_adapter) or
    runs one (forward); else None (merges and the rest get the general advice)."""
    f, tuner, adding = sys._getframe(1), None, False
    while f is not None:
        module = f.f_globals.get("__name__", "")
        if module.startswith("peft."):
            if f.f_code.co_name == "prepare_model_for_kbit_training":
                return ("kbit", "")
            # A tuner's own package (peft.tuners.hra.layer), not the code they share
            # (peft.tuners.tuners_utils: inject_adapter, modules_to_save's copies).
            in_tuner = module.startswith("peft.tuners.") and module.count(".") >= 3
            if in_tuner and tuner is None:
                tuner = f
            adding = adding or f.f_code.co_name == "inject_adapter" or in_tuner and f.f_code.co_name == "forward"
        f = f.f_back
    if tuner is None or not adding:
        return None
    module, where = tuner.f_globals["__name__"], tuner.f_code.co_qualname
    package = module.split(".")[2]
    label = ("DoRA" if package == "lora" and ("dora" in module or "Dora" in where) else
             _PEFT_BASE_READERS.get(package, package))
    return (label, where)


def _peft_refusal(ls, what: str, caller: tuple, cast_yet: bool) -> str:
    """_PackedWeight._msg for a refusal _peft_caller() recognises: what to do instead."""
    held = "lossless-coded" if ls[4] == "lossless" else "quantized"
    head = (f"the weight of streamed layer '{ls[2]}' is held {held} in layerstream's host store and this "
            f"parameter is its data-less (meta) stand-in: {what}")
    if caller[0] == "kbit":
        state = ("nothing was cast yet" if not cast_yet else
                 "parameters before it in model.parameters() may be cast already: handle.detach(), then call it "
                 "again, which casts the rest")
        return (f"{head}. peft's prepare_model_for_kbit_training() casts the model's weights to float32 through "
                f".data, which a streamed weight cannot take ({state}). Call it before offload(), or leave it "
                f"out: for a model offload() quantizes, it only freezes the weights and casts the others to "
                f"float32; for gradient checkpointing call model.gradient_checkpointing_enable() and "
                f"model.enable_input_require_grads()")
    label, where = caller
    if label == "DoRA" or label in _PEFT_BASE_READERS.values():  # reads it at every forward too
        return (f"{head}. peft's {label} adapter ({where}) reads its base layer's weight itself, and {label} over "
                f"a layer quantized by offload() is not supported. Add the adapter before offload() "
                f"(get_peft_model(), then offload()): offload() keeps the base layers of such adapters resident, "
                f"unquantized")
    return (f"{head}. peft's {label} adapter ({where}) reads its base layer's weight when it is added, which a "
            f"layer quantized by offload() does not have. Add the adapter before offload() (get_peft_model(), "
            f"then offload() with the adapter's own modules left dense: a quantize= dict, e.g. "
            f"{{'*lora_*': None, '*': '{ls[4] or 'nf4'}'}} for LoRA)")


# The adapters the peft merge under way writes (its adapter_names; None: each layer's
# active ones), set by merge_adapter() and merge_and_unload() for the check inside them; a
# merge entered another way, every adapter of each layer (_EVERY).
_EVERY = object()
_MERGING = contextvars.ContextVar("layerstream_peft_merging", default=_EVERY)


# Who writes adapters into base layers: (who, what it did not do, what to do instead).
_PEFT_MERGE = ("peft's merge", "merged", "Merge before offload() (merge_and_unload(), then offload() the merged model)")
_DIFFUSERS_FUSE = ("diffusers' fuse_lora()", "fused", "Fuse before offload() (fuse_lora(), then unload_lora_weights(), "
                   "which keeps the fused weights, then offload())")
# Who takes merged adapters back out (adapter_names: _UNMERGING, each layer's merged_adapters).
_UNMERGING = object()
_PEFT_UNMERGE = ("peft's unmerge_adapter()", "unmerged", "Call handle.detach() first (the weights dense again), "
                 "unmerge_adapter(), then offload() again; or, to keep the merged weights without the adapter, "
                 "merge_and_unload() before offload()")
_DIFFUSERS_UNFUSE = ("diffusers' unfuse_lora()", "unfused", "Call handle.detach() first (the weights dense again), "
                     "unfuse_lora(), then offload() again; or, to keep the fused weights without the adapter, "
                     "unload_lora_weights() before offload()")


def refuse_quantized_merge(model: torch.nn.Module, adapter_names=_EVERY, by: tuple = _PEFT_MERGE) -> None:
    """Before peft merges adapters into `model`: refused, before any layer is written, when
    a layer the merge writes (one that holds an adapter it merges: `adapter_names`, None
    for each layer's active ones, as peft's merges take them) has a base layer with a
    weight offload() quantized. peft writes each base weight through .data in turn; a
    streamed one (_PackedWeight) refuses its write, but one the budget keeps resident
    (ResidentQuantized) is a dense tensor that takes it, so the layers before the first
    streamed one were merged: the adapter half merged, and disable_adapter() no longer gave
    the base. Runs inside peft's own pre-merge check (guard_peft_merges), and before diffusers'
    fuses (`by`: _DIFFUSERS_FUSE; guard_diffusers_fuses). LN tuning's layers are left alone:
    their merge swaps the base layer with its tuned copy and writes no weight, so it computes
    the adapter's numbers over a quantized base too. With `adapter_names` _UNMERGING (`by`:
    _PEFT_UNMERGE, _DIFFUSERS_UNFUSE), before an unmerge of the adapters merged before offload():
    peft pops each layer's merged flag before it writes, so the refused streamed layer was
    left flagged unmerged with the adapter still in its weight, the layers before it unmerged."""
    layer_cls = getattr(sys.modules.get("peft.tuners.tuners_utils"), "BaseTunerLayer", None)
    if layer_cls is None:
        return
    swapping = getattr(sys.modules.get("peft.tuners.ln_tuning.layer"), "LNTuningLayer", ())
    resident = ResidentQuantized.held()
    for m in model.modules():
        if not isinstance(m, layer_cls) or isinstance(m, swapping):
            continue
        merging = _merged_into(m, adapter_names)
        if not merging:
            continue
        who, undone, instead = by
        what = f"{who} cannot write adapter {', '.join(map(repr, merging))} into it (nothing was {undone})"
        if adapter_names is _UNMERGING:
            what = (f"{who} cannot take adapter {', '.join(map(repr, merging))}, merged before offload(), back out "
                    f"of it (nothing was {undone})")
        for sub in m.get_base_layer().modules():
            for p in sub._parameters.values():
                if isinstance(p, _PackedWeight) and adapter_names is _UNMERGING:
                    held = "lossless-coded" if p._ls[4] == "lossless" else "quantized"
                    raise LayerstreamError(f"the weight of streamed layer '{p._ls[2]}' is held {held} in layerstream's "
                                           f"host store and this parameter is its data-less (meta) stand-in: {what}. "
                                           f"{instead}")
                if isinstance(p, _PackedWeight):
                    raise LayerstreamError(f"{p._msg(p._ls, what)}. Or: {instead}")
            name = resident.get(id(sub))
            if name is not None and adapter_names is _UNMERGING:
                raise LayerstreamError(f"the weight of quantized layer '{name}' (kept resident by the budget) holds "
                                       f"its quantized values: {what}. {instead}")
            if name is not None:
                raise LayerstreamError(
                    f"the weight of quantized layer '{name}' (kept resident by the budget) holds its quantized "
                    f"values: {what}. {instead}, or call handle.detach() first (the weights stay dense, with the "
                    f"values offload() quantized them to), or offload() without quantizing the layers the adapter "
                    f"is on")


def _merged_into(layer, adapter_names) -> list:
    """The adapters a peft merge given `adapter_names` writes into `layer` (a BaseTunerLayer):
    as its merge() picks them (peft's check_adapters_to_merge: the named ones, None for its
    active ones, less those merged already), those it holds (its adapter_layer_names)."""
    if adapter_names is _UNMERGING:
        return list(layer.merged_adapters)
    held = {n for attr in layer.adapter_layer_names for n in getattr(layer, attr, {})}
    if adapter_names is _EVERY:
        return sorted(held)
    names = layer.active_adapters if adapter_names is None else adapter_names
    merged = set(layer.merged_adapters)
    return [n for n in names if n in held and n not in merged]


def guard_peft_merges() -> None:
    """From an offload() while peft is imported, or from the first call of an offloaded model
    after peft was (Note [Tensors added after offload() follow to the compute device],
    _calls.py: its adapters are added tensors): peft's check before it merges
    (BaseTuner._check_merge_allowed: merge_adapter(), merge_and_unload()) runs
    refuse_quantized_merge too, for the adapters those merge (_MERGING). A tuner's own
    merge_and_unload() that neither runs that check nor BaseTuner's (PeftMixedModel's
    MixedModel: LoRA and LoHa merged one layer after another, the resident quantized layers
    before the first streamed one written) runs refuse_quantized_merge first. BaseTuner's
    unmerge_adapter() runs it over the adapters merged before offload() (_PEFT_UNMERGE)."""
    guard_diffusers_fuses()
    tuner = getattr(sys.modules.get("peft.tuners.tuners_utils"), "BaseTuner", None)
    check = getattr(tuner, "_check_merge_allowed", None)
    if check is None:
        return
    if not getattr(check, "_layerstream_checked", False):
        def checked(self, *args, **kwargs):
            check(self, *args, **kwargs)
            refuse_quantized_merge(self.model, _MERGING.get())

        functools.update_wrapper(checked, check)
        checked._layerstream_checked = True
        tuner._check_merge_allowed = checked
        for entry in ("merge_adapter", "_unload_and_optionally_merge"):  # merge_and_unload()'s
            if hasattr(tuner, entry):
                setattr(tuner, entry, _telling_adapters(getattr(tuner, entry)))
        # Tuners' own unmerge_adapter() (OSF's) refuses to unmerge; their unload() unwraps, unmerges nothing.
        if hasattr(tuner, "unmerge_adapter"):
            tuner.unmerge_adapter = _checked_fuse(tuner.unmerge_adapter, lambda args: [args["self"].model],
                                                  _PEFT_UNMERGE)
    # Each call: a tuner defined since (peft imports its own with itself) is seen next time.
    pending = list(tuner.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        own = cls.__dict__.get("_unload_and_optionally_merge")
        if own is None or getattr(own, "_layerstream_checked", False):
            continue
        names = getattr(getattr(own, "__code__", None), "co_names", ())
        if "_check_merge_allowed" in names or "_unload_and_optionally_merge" in names:
            continue  # checks itself, or ends in BaseTuner's (IA3, ShadowPEFT: super())
        cls._unload_and_optionally_merge = _telling_adapters(own, check_first=True)


def _telling_adapters(merge, check_first: bool = False):
    """peft's `merge` (an entry of its merges, with an adapter_names argument), which sets
    _MERGING to the adapters it merges while it runs; with `check_first` (a tuner's own
    _unload_and_optionally_merge, which peft's pre-merge check does not run in), it runs
    refuse_quantized_merge first when it merges."""
    signature = inspect.signature(merge)

    @functools.wraps(merge)
    def telling(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            names = bound.arguments.get("adapter_names")
        except TypeError:  # peft's own call raises it
            bound, names = None, _EVERY
        if check_first and bound is not None and bound.arguments.get("merge", True):
            refuse_quantized_merge(self.model, names)
        token = _MERGING.set(names)
        try:
            return merge(self, *args, **kwargs)
        finally:
            _MERGING.reset(token)
    telling._layerstream_checked = True
    return telling


def _fused_models(args) -> list:
    """The models a diffusers pipeline's fuse_lora() fuses: its named `components`."""
    pipe = args.get("self")
    return [getattr(pipe, c, None) for c in args.get("components") or () if isinstance(c, str)]


# diffusers' fuses call each peft layer's merge() in turn (after its scale_layer() when
# lora_scale is not 1), which runs no pre-merge check of peft's: over a quantized base
# they wrote the resident layers before the first streamed one refused (the model, or the
# pipeline's components before the refused one, left fused). Each is checked whole first.
# (module, class or None for a module function, name, the models its arguments fuse)
_DIFFUSERS_FUSES = (
    ("diffusers.loaders.peft", "PeftAdapterMixin", "fuse_lora", lambda args: [args.get("self")]),
    ("diffusers.loaders.lora_base", "LoraBaseMixin", "fuse_lora", _fused_models),
    ("diffusers.loaders.lora_base", None, "fuse_text_encoder_lora", lambda args: [args.get("text_encoder")]),
)
# Their unfuses (each layer's unmerge() in turn) likewise, over the adapters fused before offload().
_DIFFUSERS_UNFUSES = (
    ("diffusers.loaders.peft", "PeftAdapterMixin", "unfuse_lora", lambda args: [args.get("self")]),
    ("diffusers.loaders.lora_base", "LoraBaseMixin", "unfuse_lora", _fused_models),
    ("diffusers.loaders.lora_base", None, "unfuse_text_encoder_lora", lambda args: [args.get("text_encoder")]),
)


def guard_diffusers_fuses() -> None:
    """With guard_peft_merges (whichever of diffusers' loaders are imported by then): diffusers'
    fuse_lora() of a model or a pipeline and its fuse_text_encoder_lora() run
    refuse_quantized_merge over every model they fuse before they fuse any; their unfuses
    (_DIFFUSERS_UNFUSES) before they unfuse any."""
    fuses = [entry + (_DIFFUSERS_FUSE,) for entry in _DIFFUSERS_FUSES]
    for module_name, cls_name, name, models, by in fuses + [e + (_DIFFUSERS_UNFUSE,) for e in _DIFFUSERS_UNFUSES]:
        owner = sys.modules.get(module_name)
        if owner is not None and cls_name is not None:
            owner = getattr(owner, cls_name, None)
        fuse = getattr(owner, name, None) if owner is not None else None
        if fuse is None or getattr(fuse, "_layerstream_checked", False):
            continue
        setattr(owner, name, _checked_fuse(fuse, models, by))


def _checked_fuse(fuse, models, by=_DIFFUSERS_FUSE):
    """diffusers' `fuse` (or peft's unmerge_adapter()), which first refuses a fuse into a
    quantized layer of any of the models `models` picks from its arguments (_DIFFUSERS_FUSES); with `by` an unmerge
    (_DIFFUSERS_UNFUSE, _PEFT_UNMERGE), an unmerge of the adapters merged into one."""
    signature = inspect.signature(fuse)

    @functools.wraps(fuse)
    def checked(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:  # diffusers' own call raises it
            return fuse(*args, **kwargs)
        bound.apply_defaults()
        for model in models(bound.arguments):
            if isinstance(model, torch.nn.Module):
                names = _UNMERGING if by in (_DIFFUSERS_UNFUSE, _PEFT_UNMERGE) else bound.arguments.get("adapter_names")
                refuse_quantized_merge(model, names, by)
        return fuse(*args, **kwargs)
    checked._layerstream_checked = True
    return checked


# Note [A refused load writes nothing]
# torch's load_state_dict() copies key by key (a module's pre-hooks, its own tensors, then
# its children's) and gathers per-key errors to raise at the end. A key refused there (a
# quantized weight that cannot take new values: lossless-coded, pre-packed, in a store the
# node's ranks share, its handle detached; a read-only stand-in: a FileWeight the disk tier
# streams or load_safetensors() left for offload(), a GgufWeight before offload()) came
# after the keys before it were written: the model held parts of two checkpoints (torch
# also warned that copying into a meta parameter "is a no-op" and suggested assign=True).
# So the model's own pre-hook, which runs before any key is copied, asks the engine of
# every key that names a quantized streamed weight whether it would refuse any values
# (Engine::requantize_refusal, the rule requantize() itself applies), refuses every key
# that names a read-only stand-in (unless assign=True, which replaces it: before offload()
# that is a way to new values), and raises what it refuses. offload() installs it, and so
# do load_safetensors() and load_gguf() when they leave stand-ins. Values refused for
# themselves (a shape, NaN or Inf) still fail per key, as torch's own shape errors do. A
# load_state_dict() of a module below the model is not checked first.
class RefusedLoads:
    """The model's load_state_dict() pre-hook (the note above)."""

    __slots__ = ()

    def __call__(self, module, state_dict, prefix, local_metadata, *args):
        assign = local_metadata.get("assign_to_params_buffers", False)
        refused = []
        for name, p in module.named_parameters(remove_duplicate=False):
            key = prefix + name
            if key not in state_dict or not isinstance(p, _standin.StandIn):
                continue
            if isinstance(p, _PackedWeight):
                engine, index, _, part, _ = p._ls
                why = engine.requantize_refusal(index, -1 if part is None else part)
                if why:
                    refused.append(f"{key!r} names a quantized streamed weight that cannot take new values: {why}")
            elif not assign:
                refused.append(p._load_refusal())  # it names the weight
        if refused:
            more = f" ({len(refused) - 1} more key(s) likewise)" if len(refused) > 1 else ""
            raise LayerstreamError(f"load_state_dict() refused before writing anything: {refused[0]}{more}")


def install_refused_loads(model: torch.nn.Module):
    """RefusedLoads on `model` unless it has one already; its hook handle, or None."""
    hooks = getattr(model, "_load_state_dict_pre_hooks", {}).values()  # torch wraps each (_WrappedHook)
    if any(isinstance(getattr(h, "hook", h), RefusedLoads) for h in hooks):
        return None
    return model.register_load_state_dict_pre_hook(RefusedLoads())
