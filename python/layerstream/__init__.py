"""layerstream: stream layer weights from host RAM to the GPU, ahead of use.

Quick use::

    import layerstream
    handle = layerstream.offload(model, budget="8GiB", prefetch=2)
    loss = model(x).sum(); loss.backward()     # param.grad complete on return
    print(handle.stats())
    handle.detach()                             # weights back, bit-identical

The engine is C++ (``layerstream._C``); this module only finds the layers,
hands them to the engine and swaps their ``forward``.
"""
from __future__ import annotations

import contextlib
import fnmatch
import functools
import itertools
import re
import warnings
import weakref
from typing import Dict, Iterable, List, Optional, Sequence, Union

import torch
import torch.nn as nn

from . import _C, _standin
from ._gguf import _DEVICE, _HOST, GgufLoad, GgufWeight, load_gguf

__all__ = ["offload", "Handle", "LayerstreamError", "parse_bytes", "load_gguf", "GgufLoad", "GgufWeight",
           "__version__"]
__version__ = "0.1.0"

LayerstreamError = _C.LayerstreamError

_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def parse_bytes(value: Union[int, float, str]) -> int:
    """Parses 123, 1.5e9, "500MB", "12GiB" into bytes (whole bytes: "0.5" is refused)."""
    fraction, nbytes, _ = _C.parse_budget(value)
    if fraction:
        raise ValueError(f"{value!r} is a share, not a size in bytes")
    return nbytes


def _quant_for(name: str, quantize) -> Optional[str]:
    """The quantization format for layer `name`: quantize is None, a format
    name, or a dict of glob pattern -> format (None = keep dense); the first
    matching pattern wins."""
    if quantize is None:
        return None
    if isinstance(quantize, str):
        return quantize
    if isinstance(quantize, dict):
        for pattern, fmt in quantize.items():
            if fnmatch.fnmatchcase(name, pattern):
                return fmt
        return None
    raise TypeError(f"quantize must be None, a format name or a dict of pattern -> format, "
                    f"got {type(quantize).__name__}")


class _Packed:
    """A weight that arrives already packed: stored byte for byte."""

    __slots__ = ("format", "codes", "scales", "rows", "cols", "dense_dtype", "bnb_stats", "gguf")

    def __init__(self, format, codes, scales, rows, cols, dense_dtype, bnb_stats=None, gguf=False):
        self.format, self.codes, self.scales = format, codes, scales
        self.rows, self.cols, self.dense_dtype = int(rows), int(cols), dense_dtype
        self.bnb_stats = bnb_stats  # bitsandbytes: what detach() needs to rebuild Params4bit
        self.gguf = gguf  # load_gguf()'s bytes: detach() restores the dequantized weight


def _is_packed_only_format(fmt: str) -> bool:
    """A format the engine streams but does not quantize to (GGUF's q8_0 .. q6_k)."""
    try:
        _C.quant_packed_bytes(fmt, 0, 256)
        return True
    except LayerstreamError:
        return False


_DEQUANT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _bnb_nf4(name: str, w) -> Optional[_Packed]:
    """A bitsandbytes Params4bit weight (Linear4bit), quantized: its NF4 codes
    (2 per byte, high nibble first) and fp32 absmax per block of 64 are our
    nf4 layout, so they are taken as they are."""
    qs = getattr(w, "quant_state", None)
    if qs is None:
        if getattr(w, "bnb_quantized", True) is False:
            raise LayerstreamError(
                f"layer '{name}': its bitsandbytes 4-bit weight is not quantized yet (bitsandbytes "
                f"quantizes when the module moves to a device); move it first, or offload the "
                f"unquantized model with offload(quantize='nf4')")
        return None
    if qs.quant_type != "nf4" or qs.blocksize != 64:
        raise LayerstreamError(
            f"layer '{name}': bitsandbytes {qs.quant_type} weights with blocksize {qs.blocksize} are "
            f"not supported (layerstream takes nf4 with blocks of 64); dequantize the model or load "
            f"it unquantized and use offload(quantize='nf4')")
    code = qs.code.detach().float().cpu()
    if code.numel() != 16 or not torch.equal(code, torch.tensor(_C.nf4_codes(), dtype=torch.float32)):
        raise LayerstreamError(f"layer '{name}': its bitsandbytes nf4 code table is not the standard one")
    if qs.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise LayerstreamError(f"layer '{name}': bitsandbytes dtype {qs.dtype} is not supported")
    absmax = qs.absmax
    if qs.nested:  # double quantization: absmax itself is blockwise-quantized
        import bitsandbytes.functional as bnbF
        absmax = bnbF.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    rows, cols = int(qs.shape[0]), int(qs.shape[1])
    stats = {k: (v.detach().cpu() if torch.is_tensor(v) else v)
             for k, v in qs.as_dict(packed=True).items()}
    return _Packed("nf4", w.detach().reshape(-1).cpu(), absmax.detach().float().cpu(), rows, cols,
                   qs.dtype, stats)


def _prequantized(name: str, module: nn.Module) -> Optional[_Packed]:
    """The weight when it is already quantized: a torch quantized tensor
    (qint8, zero points 0) or an int8 tensor with a `weight_scale` attribute
    (int8, dense float32), or a bitsandbytes nf4 Params4bit. None for float
    weights."""
    w = module.weight
    if type(w).__name__ == "Params4bit":
        return _bnb_nf4(name, w)
    if isinstance(w, GgufWeight):
        return _Packed(w.gguf_format, w.gguf_bytes, torch.empty(0), w.shape[0], w.shape[1], w.dtype, gguf=True)
    rows = w.shape[0]
    if w.is_quantized:
        if w.dtype != torch.qint8:
            raise LayerstreamError(f"quantized weight dtype {w.dtype} is not supported; use qint8")
        scheme = w.qscheme()
        if scheme in (torch.per_channel_affine, torch.per_channel_symmetric):
            if w.q_per_channel_axis() != 0 or bool((w.q_per_channel_zero_points() != 0).any()):
                raise LayerstreamError(
                    "per-channel quantized weights must use axis 0 and zero points 0 (symmetric); "
                    "dequantize them first or use offload(quantize='int8')")
            return _Packed("int8", w.int_repr(), w.q_per_channel_scales().float(), rows,
                           w.numel() // max(rows, 1), torch.float32)
        if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            if w.q_zero_point() != 0:
                raise LayerstreamError(
                    "per-tensor quantized weights must use zero point 0; dequantize them first or "
                    "use offload(quantize='int8')")
            return _Packed("int8", w.int_repr(), torch.tensor([w.q_scale()], dtype=torch.float32), rows,
                           w.numel() // max(rows, 1), torch.float32)
        raise LayerstreamError(f"unsupported quantization scheme {scheme}")
    if not w.dtype.is_floating_point:
        scale = getattr(module, "weight_scale", None)
        if w.dtype != torch.int8 or scale is None:
            raise LayerstreamError(
                f"an integer weight ({w.dtype}) needs dtype int8 and a `weight_scale` attribute "
                f"(one fp32 scale per output row, or one for the tensor) to be streamed")
        return _Packed("int8", w.detach(), torch.as_tensor(scale, dtype=torch.float32), rows,
                       w.numel() // max(rows, 1), torch.float32)
    return None


def _is_experts(module: nn.Module) -> bool:
    """transformers' mixture-of-experts modules (the ``use_experts_implementation``
    decorator gives them ``has_gate`` and ``is_transposed``), whose expert weights
    are 3-D parameters (``gate_up_proj`` [experts, 2 * inter, hidden], ``down_proj``,
    optional biases) that the module indexes itself: Qwen2/3-MoE, Mixtral, GPT-OSS,
    DeepSeek, ... They stream as a tensor group (see _GroupForward)."""
    params = [p for p in module._parameters.values() if p is not None]
    return (hasattr(module, "has_gate") and hasattr(module, "is_transposed") and bool(params)
            and all(p.is_floating_point() for p in params) and any(p.dim() == 3 for p in params))


_TRANSFORMERS_EXPERTS_FORWARDS = ("batched_mm_experts_forward", "grouped_mm_experts_forward")


def _reads_routed_experts_only(module: nn.Module) -> bool:
    """True when the experts module's forward reads only the experts its routing ids
    name, so that the others need not be in the slot: transformers' dispatching forward
    (use_experts_implementation) running the class's own "eager" forward (every one in
    transformers loops over the experts hit) or transformers' own "batched_mm" /
    "grouped_mm" (they index the weights by the ids, or skip experts without tokens).
    Checked at every call (the implementation can be switched at run time); any other
    implementation (e.g. a registered kernel) gets every expert."""
    fwd = type(module).forward  # functools.wraps copied the names: ask where its code lives
    if getattr(fwd, "__globals__", {}).get("__name__") != "transformers.integrations.moe" or \
            not hasattr(fwd, "__wrapped__"):
        return False
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if impl is None or impl == "eager":
        return True
    try:
        from transformers.integrations import moe
    except ImportError:  # pragma: no cover - the module comes from transformers
        return False
    fn = moe.ALL_EXPERTS_FUNCTIONS.get(impl)
    return any(fn is getattr(moe, name, None) for name in _TRANSFORMERS_EXPERTS_FORWARDS)


# Modules offload(groups=...) streams whole (while offloaded): _group_slots() lists every
# parameter below them. Weak: a module dropped without detach() leaves nothing behind.
_WHOLE_GROUPS = weakref.WeakSet()


def _group_slots(module: nn.Module) -> List[tuple]:
    """(owner, key, name) of each parameter of a tensor group: the module's own, and for
    nn.MultiheadAttention its out_proj's too (its forward reads out_proj.weight directly,
    so they stream together); for a module offload(groups=...) named, every parameter of
    it and of its descendants (named relative to it)."""
    if module in _WHOLE_GROUPS:  # offload(groups=...): every parameter below it
        return [(owner, k, f"{mname}.{k}" if mname else k) for mname, owner in module.named_modules()
                for k, p in owner._parameters.items() if p is not None]
    slots = [(module, k, k) for k, p in module._parameters.items() if p is not None]
    if isinstance(module, nn.MultiheadAttention):
        out = module.out_proj
        slots += [(out, k, f"out_proj.{k}") for k, p in out._parameters.items() if p is not None]
    return slots


def _is_mha(module: nn.Module) -> bool:
    """torch's nn.MultiheadAttention with its own forward and floating-point weights: its
    forward reads the projection weights directly (no Linear to swap), so it streams as a
    tensor group, its out_proj with it."""
    return (type(module).forward is nn.MultiheadAttention.forward
            and type(module.out_proj).forward is nn.Linear.forward
            and all(o._parameters[k].is_floating_point() for o, k, _ in _group_slots(module)))


def _is_streamable(module: nn.Module) -> Optional[str]:
    """Returns 'linear', 'conv', 'embedding', 'group' (mixture-of-experts weights,
    nn.MultiheadAttention) or None."""
    if _is_experts(module):
        return "group"
    if isinstance(module, nn.MultiheadAttention):
        return "group" if _is_mha(module) else None
    # MultiheadAttention reads out_proj.weight directly instead of calling it.
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return None
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, _CONV_TYPES):
        return "conv"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return None


def _stock_forward(module: nn.Module, kind: str) -> bool:
    """True when the module computes what a streamed layer computes: torch's own
    Linear / ConvNd forward (a subclass may add only other methods), or a
    bitsandbytes Linear4bit (its nf4 weight streams packed; see _bnb_nf4); or an
    Embedding subclass whose forward does its lookup through super().forward
    (see _lookup_through_super)."""
    cls = type(module)
    if kind == "group":
        return True  # its own forward runs, on the fetched tensors
    if kind == "embedding":
        return cls.forward is nn.Embedding.forward or _lookup_through_super(cls)
    if kind == "linear":
        return cls.forward is nn.Linear.forward or type(module.weight).__name__ == "Params4bit"
    base = next(t for t in _CONV_TYPES if isinstance(module, t))
    return cls.forward is base.forward and cls._conv_forward is base._conv_forward


def _lookup_through_super(cls: type) -> bool:
    """True for an nn.Embedding subclass each of whose own forward methods calls
    ``super().forward`` (and reads no other forward), as the scaled word
    embeddings of Gemma, Bart, M2M100, ... do (``super().forward(ids) *
    embed_scale``). Such a module streams with its own forward kept: offload()
    puts _LookupBase between the subclass and nn.Embedding in its class, so that
    super().forward is the streamed lookup and whatever the subclass adds runs
    on its result. A forward without super() (its own F.embedding call, which
    would read the weight directly) is not recognized: the module stays
    resident, as before."""
    for klass in cls.__mro__:
        if klass is nn.Embedding:
            return True
        f = klass.__dict__.get("forward")
        if f is None:
            continue
        code = getattr(f, "__code__", None)
        if code is None or "super" not in code.co_names or "forward" not in code.co_names:
            return False
    return False


_NO_COPY = ("an offloaded model cannot be {what} (its streamed weights live in layerstream's host "
            "store, which this process owns); {instead}, or call handle.detach() first")


class _RefusesCopy:
    """Pickling (torch.save(model)) or deep-copying an object offload() attached to a
    model fails with a message that says what to do instead of pickle's own error."""

    __slots__ = ()

    def __reduce_ex__(self, protocol):
        raise LayerstreamError(_NO_COPY.format(
            what="pickled (e.g. torch.save(model))",
            instead="save model.state_dict() instead (quantized weights are data-less there until "
                    "detach())"))

    def __deepcopy__(self, memo):
        raise LayerstreamError(_NO_COPY.format(what="deep-copied", instead="deep-copy it before offload()"))


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


def _computed_weight(module: nn.Module) -> bool:
    """True when the module's weight is not a parameter of its own but computed
    (torch.nn.utils.parametrize: weight_norm, spectral_norm, ...; pruning's
    forward pre-hook): streaming would freeze one computed value. A torch
    quantized or int8 weight (pre-quantized, streamed as it is) is not."""
    if torch.nn.utils.parametrize.is_parametrized(module):
        return True
    w = module.__dict__.get("weight")
    return "weight" not in module._parameters and isinstance(w, torch.Tensor) and w.is_floating_point()


def _dora_layers(model: nn.Module) -> set:
    """ids of the modules inside a peft LoRA layer with a DoRA adapter: DoRA reads
    base_layer.weight and the lora_A/lora_B weights directly (its weight norm), not
    through their forward."""
    out = set()
    for m in model.modules():
        use_dora = getattr(m, "use_dora", None)
        if isinstance(use_dora, dict) and any(use_dora.values()):
            out.update(id(sub) for sub in m.modules() if sub is not m)
    return out


def _check_no_meta(model: nn.Module) -> None:
    """offload() needs every weight's values: refuses data-less (meta) parameters and
    buffers with the names of the first few, before anything changes."""
    meta = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers())
            if t.is_meta and not isinstance(t, (_PackedWeight, GgufWeight))]  # offloaded; packed bytes
    if meta:
        raise LayerstreamError(
            f"{len(meta)} parameter(s)/buffer(s) have no data (meta tensors): "
            f"{', '.join(meta[:5])}{', ...' if len(meta) > 5 else ''}. The model was built without "
            f"weights (torch.device('meta'), accelerate's init_empty_weights) or its weights are "
            f"offloaded by accelerate hooks (a device_map with 'cpu'/'disk' entries). Load real "
            f"weights into host memory first (e.g. from_pretrained(...) without device_map, or "
            f"model.to_empty(device='cpu') then load_state_dict()), then call offload().")


def _check_no_shared_storage(model: nn.Module, candidates: list) -> None:
    """Refuses, before anything changes, streamed parameters that share memory with another
    tensor of the model (views of one flat buffer, as some trainers build): offload() moves
    each streamed parameter into host memory of its own, and detach() could not restore
    the sharing. The same tensor in several places (tied weights) is not refused here."""
    owners = {}  # storage address -> names of the distinct tensors on it
    seen = set()
    for n, t in itertools.chain(model.named_parameters(remove_duplicate=True),
                                model.named_buffers(remove_duplicate=True)):
        if t is None or t.is_meta or id(t) in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(id(t))
        owners.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(n)
    streamed = []
    for name, module, kind in candidates:
        params = ([(qn, o._parameters[k]) for o, k, qn in _group_slots(module)] if kind == "group" else
                  [(k, module._parameters.get(k)) for k in ("weight", "bias")])
        streamed += [(f"{name}.{pn}" if name else pn, p) for pn, p in params if p is not None and not p.is_meta]
    for qn, p in streamed:
        names = owners.get((p.device, p.untyped_storage().data_ptr()), [])
        if len(names) > 1:
            raise LayerstreamError(
                f"parameter '{qn}' shares its memory with {', '.join(repr(n) for n in names if n != qn)} "
                f"(views of one flat buffer); offload() moves each streamed parameter into host memory of "
                f"its own, so that sharing would be lost for good after detach(). Give the parameters "
                f"memory of their own before offload() (e.g. p.data = p.data.clone() for each), or keep "
                f"these layers resident (offload(exclude=[...])).")


def _selected(name: str, include, exclude) -> bool:
    def match(patterns):
        if patterns is None:
            return False
        if isinstance(patterns, str):
            patterns = [patterns]
        return any(fnmatch.fnmatchcase(name, p) for p in patterns)

    if include is not None and not match(include):
        return False
    return not match(exclude)


def _split_tied(model: nn.Module, candidates: list, compute_device: torch.device):
    """Tied weights: a parameter of several distinct modules (e.g. an lm_head
    sharing the embedding's weight). Returns (kept candidates, groups), groups
    being the lists of candidate names that share one weight.

    When the shared tensor is the weight of every module that has it and all of
    them are candidates, they stream together: the engine keeps one host copy
    for all of them (the table looks it up, the lm_head streams it) and returns
    their gradients through autograd, which sums them into the one .grad as it
    does for a resident tied weight. Otherwise (a shared bias, or a module that
    stays resident uses it) those layers stay resident, with one warning:
    streaming one would move the tensor to the host under the other module (on
    CUDA a device mismatch), which keeps it on the device anyway."""
    owners: Dict[int, List[tuple]] = {}  # parameter id -> (module id, parameter name, qualified name)
    seen_modules = set()
    for mname, m in model.named_modules(remove_duplicate=False):
        if id(m) in seen_modules:  # one module reachable under two names is not a tie
            continue
        seen_modules.add(id(m))
        for pname, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((id(m), pname, f"{mname}.{pname}" if mname else pname))
    streamable = {id(module) for _, module, _ in candidates}
    while True:  # a layer kept resident keeps the modules it shares a weight with resident too
        kept, tied, groups = [], [], {}
        for name, module, kind in candidates:
            why = []
            params = ([(qn, o._parameters[k]) for o, k, qn in _group_slots(module)] if kind == "group" else
                      [("weight", module._parameters.get("weight")), ("bias", module._parameters.get("bias"))])
            for pn, p in params:
                who = owners.get(id(p), ()) if p is not None else ()
                if len(who) < 2:
                    continue
                if kind != "group" and pn == "weight" and all(o[1] == "weight" and o[0] in streamable
                                                              for o in who):
                    groups.setdefault(id(p), []).append(name)
                    continue
                own = f"{name}.{pn}" if name else pn
                why.append(f"{pn} shared with " + ", ".join(f"'{o[2]}'" for o in who if o[2] != own))
            if why:
                tied.append(f"'{name or '<root>'}' (" + "; ".join(why) + ")")
            else:
                kept.append((name, module, kind))
        still = {id(module) for _, module, _ in kept}
        if still == streamable:
            break
        streamable = still
    _warn_resident(tied, "layer(s) with tied weights", compute_device,
                   "another module that stays resident, or a bias, shares the tensor; a streamed "
                   "copy would move it under that module", stacklevel=4)
    return kept, [g for g in groups.values() if len(g) > 1]


def _warn_resident(names: list, what: str, compute_device: torch.device, why: str,
                   stacklevel: int = 3) -> None:
    """One warning for the layers offload() keeps resident for one reason
    (stacklevel 3: the caller of offload(), when called from offload())."""
    if names:
        warnings.warn(f"layerstream: {len(names)} {what} stay resident on {compute_device} ({why}): "
                      + "; ".join(names), RuntimeWarning, stacklevel=stacklevel)


def _conv_args(module: nn.Module) -> dict:
    dims = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}[next(t for t in (nn.Conv1d, nn.Conv2d, nn.Conv3d) if isinstance(module, t))]
    pad = module.padding
    same = False
    if isinstance(pad, str):
        if pad == "same":
            same, pad = True, (0,) * dims
        elif pad == "valid":
            pad = (0,) * dims
        else:
            raise ValueError(f"unknown conv padding {pad!r}")
    return dict(dims=dims, stride=list(module.stride), padding=list(pad), same=same,
                dilation=list(module.dilation), groups=int(module.groups))


class _Attached:
    """What offload() changed on one module, to undo it in detach()."""

    __slots__ = ("name", "module", "kind", "index", "had_forward", "old_forward", "devices",
                 "prequantized", "bnb_stats", "hooks", "strides", "packed_parts", "owners")

    def __init__(self, name, module, kind, index, had_forward, old_forward, devices,
                 prequantized=False, bnb_stats=None, hooks=(), strides=None):
        self.name, self.module, self.kind, self.index = name, module, kind, index
        self.had_forward, self.old_forward, self.devices = had_forward, old_forward, devices
        self.prequantized = prequantized
        self.bnb_stats = bnb_stats
        self.hooks = list(hooks)
        # A weight quantized by offload() whose memory layout was not the contiguous one
        # (channels_last): detach() restores its dequantized values in that layout.
        self.strides = strides
        # A tensor group quantized by offload(): (parameter name, part, owner module, key)
        # of its packed tensors (the name relative to the module: "out_proj.weight").
        self.packed_parts = []
        # Other modules that own some of a tensor group's parameters (an attention's
        # out_proj): they got a _StreamedApply too.
        self.owners = []


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
    targets = [("weight", None, module, "weight")] if parts is None else list(parts)

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
                    torch.autograd.graph.increment_version(owner._parameters[pkey])  # see _PackedWeight
            except LayerstreamError as e:
                error_msgs.append(f'While loading "{key}" into a quantized streamed layer: {e}')

    def post(mod, incompatible_keys):
        for key in taken:
            if key in incompatible_keys.missing_keys:
                incompatible_keys.missing_keys.remove(key)
        taken.clear()

    return [module._register_load_state_dict_pre_hook(pre, with_module=True),
            module.register_load_state_dict_post_hook(post)]


# The .data / .requires_grad descriptors, as __torch_function__ sees their getters and setters.
_DATA = torch._C.TensorBase.__dict__["data"]
_REQUIRES_GRAD = torch._C.TensorBase.__dict__["requires_grad"]
_CONVERSIONS = {"to", "cuda", "cpu", "half", "float", "double", "bfloat16", "type", "type_as",
                "pin_memory", "share_memory_"}


class _PackedWeight(nn.Parameter):
    """The parameter a quantized streamed layer keeps: data-less (meta, same shape
    and dtype), because the weight lives packed in the engine's host store.

    A plain meta tensor would swallow writes: ``copy_`` into it, and
    ``w.data += delta`` (peft's merge_and_unload) would leave the packed weight
    as it was without a word, and ``torch.save(model.state_dict())`` would save
    no values. So:
      * ``copy_`` (what load_state_dict() does) re-quantizes the new values into
        the host store (``Engine.requantize``);
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

    def __new__(cls, shape, dtype, engine, index: int, name: str, part: Optional[int] = None):
        self = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"), False)
        self._ls = (engine, index, name, part)  # part: a tensor group's tensor, else None
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
        if ls is not None and descr is _DEVICE and name == "__get__":
            return _HOST  # where the packed bytes are (see the class docstring)
        if ls is not None and descr is _DATA:
            if name == "__get__":
                return self  # so that writes through .data reach this handler
            value = args[1]
            if value is self or (isinstance(value, _PackedWeight) and value._ls == ls):
                return None  # Module._apply assigns an unchanged parameter back
            raise LayerstreamError(cls._msg(ls, "its .data cannot be replaced"))
        if ls is not None and (name == "requires_grad_" and (args[1:] or [kwargs.get("requires_grad", True)])[0]
                               or descr is _REQUIRES_GRAD and name == "__set__" and args[1]):
            raise LayerstreamError(
                f"the weight of quantized streamed layer '{ls[2]}' cannot be trained (it is packed "
                f"on the host and dequantized on the device); train an adapter over it (LoRA), or "
                f"detach() and offload() again without quantizing this layer")
        if ls is not None and name == "copy_":
            engine, index, _, part = ls
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
        other = _standin.first_standin(types, args, kwargs, _PackedWeight)
        if other is not None and not _standin.reads_metadata_only(func):
            # Any computation with it, in any argument position (x @ w.t(), F.linear(x, w)):
            # a meta tensor has no values, and torch would return uninitialised memory.
            raise LayerstreamError(cls._msg(other._ls, _standin.computing_message(func)) +
                                   "; run the module itself (it streams the weight), or detach() first")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @staticmethod
    def _msg(ls, what: str) -> str:
        return (f"the weight of quantized streamed layer '{ls[2]}' is packed in layerstream's host "
                f"store and this parameter is its data-less (meta) stand-in: {what}. Load new values "
                f"with load_state_dict() or weight.copy_() (they are re-quantized); to change it "
                f"otherwise (e.g. merge a LoRA adapter into it) or move the model, call "
                f"handle.detach() first (it restores the dense, dequantized weight)")

    def __reduce_ex__(self, protocol):
        raise LayerstreamError(self._msg(self._ls, "it cannot be saved (pickled)") +
                               "; state_dict() of an offloaded model has no values for it: save "
                               "only the trainable parameters (peft's save_pretrained does), or "
                               "detach() first")

    def __deepcopy__(self, memo):
        raise LayerstreamError(self._msg(self._ls, "it cannot be deep-copied"))

    def __repr__(self):
        return (f"layerstream packed weight of '{self._ls[2]}' (meta stand-in, shape "
                f"{tuple(self.shape)}, {self.dtype})")


def _has_grad_hooks(p) -> bool:
    return p is not None and bool(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None))


class _StreamedForward(_RefusesCopy):
    """The forward offload() installs on a streamed module (an instance attribute).

    A small callable object rather than a closure, so that pickling the model
    (torch.save(model)) or deep-copying it fails with a message that says what
    to do instead of pickle's "Can't pickle local object"."""

    __slots__ = ("_run", "_index", "_original", "_weight", "_bias", "_params", "_attrs", "_name",
                 "_lookup")

    def __init__(self, engine, index: int, kind: str, original, module: nn.Module, name: str):
        self._lookup = kind == "embedding"
        self._run = {"linear": engine.linear, "conv": engine.conv, "embedding": engine.embedding}[kind]
        self._index, self._original, self._name = index, original, name
        self._weight, self._bias = module.weight, getattr(module, "bias", None)
        # Direct dict access is cheaper than nn.Module.__getattr__; a weight that is
        # not a Parameter (e.g. a torch quantized tensor) lives in the instance dict.
        self._params, self._attrs = module._parameters, module.__dict__

    def __call__(self, x, *args, **kwargs):
        if args or kwargs:  # an unusual call signature: use the module's own forward
            return self._original(x, *args, **kwargs)
        params, attrs, weight, bias = self._params, self._attrs, self._weight, self._bias
        if ((params["weight"] if "weight" in params else attrs.get("weight")) is not weight or
                (params["bias"] if "bias" in params else attrs.get("bias")) is not bias):
            raise LayerstreamError(
                f"the parameters of streamed layer '{self._name}' were replaced after offload() (e.g. "
                f"by load_state_dict(assign=True), assigning a new nn.Parameter, "
                f"torch.func.functional_call, or torch.export, which cannot capture a streamed "
                f"layer); layerstream streams the original ones. Copy new "
                f"values in place (load_state_dict() without assign, or param.data.copy_()), or "
                f"call handle.detach() first.")
        if self._lookup:  # a table's gradient goes through autograd (hooks fire)
            return self._run(self._index, x)
        # Gradient hooks on the parameters: hand their gradients to autograd
        # (synchronously) so that the hooks fire.
        return self._run(self._index, x, _has_grad_hooks(weight) or _has_grad_hooks(bias))


class _GroupForward(_RefusesCopy):
    """The forward offload() installs on a streamed tensor group (a mixture-of-experts
    module, _is_experts): the module's own forward runs with its parameters swapped,
    for the call, for views of a device slot that holds all of them (Engine.fetch /
    release). When a gradient is needed, _GroupFn runs it without a graph and runs it
    again in backward on the fetched weights (as activation checkpointing does), so no
    slot memory is saved for backward. A callable object for the reasons given in
    _StreamedForward. Not safe for two threads calling the same module at once (the
    swap is on the module)."""

    __slots__ = ("_engine", "_index", "_original", "_module", "_slots", "_params", "_name", "_device", "_experts")

    def __init__(self, engine, index: int, original, module: nn.Module, slots: Sequence[tuple], name: str,
                 experts: int = 0):
        self._engine, self._index, self._original, self._module, self._name = engine, index, original, module, name
        self._slots = tuple((o, k) for o, k, _ in slots)  # (owner, key) of each tensor (_group_slots)
        self._params = tuple(o._parameters[k] for o, k in self._slots)
        self._device = torch.device(engine.compute_device)
        self._experts = experts  # > 0: the group was added indexed by expert (offload(experts="routed"))

    def routed_experts(self, args, kwargs) -> List[int]:
        """The experts this call reads (its routing ids), when fewer than all of them may
        cross the bus: [] = all. One device-to-host sync (the ids are on the device)."""
        if not self._experts or not _reads_routed_experts_only(self._module):
            return []
        ids = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
        # More than twice as many (token, expert) picks as experts nearly always reach more
        # than half of them: skip the sync and fetch the whole group (prefetched).
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or not 0 < ids.numel() <= 2 * self._experts:
            return []
        hit = torch.unique(ids.detach()).tolist()
        # Ids outside the experts (expert-parallel sentinels, which batched_mm clamps
        # onto the last expert) or more than half of them: the whole group.
        if hit[0] < 0 or hit[-1] >= self._experts or 2 * len(hit) > self._experts:
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

    @contextlib.contextmanager
    def fetched(self, requires_grad=None, experts: Sequence[int] = ()):
        """The module's parameters swapped for views of the fetched slot while the
        block runs (work on them must be enqueued inside it); `requires_grad`: per
        tensor, whether the view is a leaf that requires grad (backward's recompute);
        `experts`: the only experts the block reads (routed_experts), [] = all."""
        token, views = self._engine.fetch(self._index, list(experts))
        try:
            if requires_grad is not None:
                views = [v.detach().requires_grad_(bool(r)) for v, r in zip(views, requires_grad)]
            try:
                for (o, k), v in zip(self._slots, views):
                    o._parameters[k] = v
                yield views
            finally:
                for (o, k), p in zip(self._slots, self._params):
                    o._parameters[k] = p
        finally:
            self._engine.release(token)

    def __call__(self, *args, **kwargs):
        for o, k in self._slots:
            if k in getattr(o, "parametrizations", {}):
                raise LayerstreamError(
                    f"streamed layer '{self._name}': its tensor '{k}' is parametrized during the call "
                    f"(torch.nn.utils.parametrize; e.g. peft's LoRA on expert parameters, "
                    f"LoraConfig(target_parameters=...)), so its value is computed from the tensor by "
                    f"code layerstream cannot stream, and whose gradients it could not return. Put the "
                    f"adapters on Linear layers (target_modules), or keep this module resident "
                    f"(offload(exclude=[...])).")
        if any(o._parameters.get(k) is not p for (o, k), p in zip(self._slots, self._params)):
            raise LayerstreamError(
                f"the parameters of streamed layer '{self._name}' were replaced after offload(); "
                f"layerstream streams the original ones. Copy new values in place, or call "
                f"handle.detach() first.")
        flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        positions = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        inputs = [flat[i] for i in positions]
        if not torch.is_grad_enabled() or not (any(t.requires_grad for t in inputs) or
                                                any(p.requires_grad for p in self._params)):
            with self.fetched(experts=self.routed_experts(args, kwargs)) as views:
                out = self._original(*args, **kwargs)
                self.check_output(out, views)
                return out
        taken = set(positions)
        skeleton = [None if i in taken else a for i, a in enumerate(flat)]
        return _GroupFn.apply(self, (skeleton, spec, positions), *inputs, *self._params)


def _rebuild(layout, tensors):
    skeleton, spec, positions = layout
    flat = list(skeleton)
    for i, t in zip(positions, tensors):
        flat[i] = t
    return torch.utils._pytree.tree_unflatten(flat, spec)


def _leaves(tensors, requires_grad) -> list:
    """Detached copies of `tensors` (no data copied) with the given requires_grad, one per
    distinct tensor: a tensor passed twice stays one object (nn.MultiheadAttention takes
    another path when query is key is value)."""
    seen = {}
    for t, r in zip(tensors, requires_grad):
        if id(t) not in seen:
            seen[id(t)] = t.detach().requires_grad_(bool(r))
    return [seen[id(t)] for t in tensors]


# What autograd's version check says (torch/csrc/autograd/saved_variable.cpp); its other
# errors on unpacking (a graph already freed, ...) are passed on as they are.
_INPLACE_ERROR = "modified by an inplace operation"


class _GroupFn(torch.autograd.Function):
    """A tensor group's computation when a gradient is needed: forward without a
    graph (the slot is released right after); backward fetches the tensors again,
    re-runs the module's forward with the saved inputs (same RNG and autocast state)
    and differentiates it. Gradients of trainable group tensors are copied to the
    host and returned to autograd, which accumulates them into .grad."""

    @staticmethod
    def forward(ctx, fwd, layout, *tensors):
        n_in = len(layout[2])
        inputs = tensors[:n_in]
        ctx.fwd, ctx.layout = fwd, layout
        dev = fwd._device
        ctx.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None)
        kind = dev.type
        ctx.autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        # The parameters are saved too (no copy: host tensors, or the packed ones' stand-ins,
        # whose version a re-quantization bumps), so that a write between forward and
        # backward raises autograd's version error, as for a resident module, instead of
        # recomputing with other values.
        ctx.save_for_backward(*inputs, *fwd._params)
        args, kwargs = _rebuild(layout, inputs)
        ctx.experts = fwd.routed_experts(args, kwargs)  # the recompute reads the same ones
        # Run as the resident module runs: grad mode on, inputs and parameters with their
        # requires_grad (the fetched views have their parameters'), so that every op takes
        # the same path (at::matmul folds by requires_grad; attention picks its kernel by
        # grad mode); the graph it records is dropped with the detached outputs.
        # (Note [Same calls as the resident module], csrc/torch/engine.cpp)
        with torch.enable_grad(), fwd.fetched(experts=ctx.experts) as views:
            args, kwargs = _rebuild(layout, _leaves(inputs, [x.requires_grad for x in inputs]))
            out = fwd._original(*args, **kwargs)
            fwd.check_output(out, views)
            out = torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out)
        if isinstance(out, torch.Tensor):
            ctx.single = True
            return out
        if isinstance(out, (tuple, list)) and all(o is None or isinstance(o, torch.Tensor) for o in out):
            ctx.single = False  # None entries: nn.MultiheadAttention without attention weights
            return tuple(out)
        raise LayerstreamError(f"streamed layer '{fwd._name}' returned {type(out).__name__}; a streamed "
                               f"tensor group must return a tensor or a tuple of tensors (or None)")

    @staticmethod
    def backward(ctx, *grads):
        fwd = ctx.fwd
        if torch.is_grad_enabled():
            raise LayerstreamError(f"layer '{fwd._name}': backward with create_graph=True (double "
                                   f"backward) is not supported through a streamed layer; keep it "
                                   f"resident (offload(exclude=[...]))")
        try:
            saved = ctx.saved_tensors
        except RuntimeError as e:
            if _INPLACE_ERROR not in str(e):
                raise  # e.g. a second backward through a freed graph: torch's own message
            raise LayerstreamError(f"streamed layer '{fwd._name}': a tensor its backward needs (an input "
                                   f"or a parameter) was modified in place after the forward pass (e.g. an "
                                   f"optimizer step before this backward); autograd raises the same for a "
                                   f"resident module. {e}") from None
        n_in = len(ctx.layout[2])
        saved = saved[:n_in]
        needs = ctx.needs_input_grad[2:]
        inputs = _leaves(saved, needs)
        args, kwargs = _rebuild(ctx.layout, inputs)
        dev = fwd._device
        cpu_rng, dev_rng = ctx.rng
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.set_rng_state(cpu_rng)
            if dev_rng is not None:
                torch.cuda.set_rng_state(dev_rng, dev)
            with torch.enable_grad(), torch.autocast(dev.type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]), \
                    fwd.fetched(needs[n_in:], ctx.experts) as views:
                out = fwd._original(*args, **kwargs)
                outs = (out,) if ctx.single else tuple(out)
                pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o is not None and o.requires_grad]
                wanted = [t for t in inputs + views if t.requires_grad]
                got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                               allow_unused=True)
                           if pairs and wanted else [None] * len(wanted))
                result = [next(got) if t.requires_grad else None for t in inputs + views]
                # A tensor passed at several positions is one leaf here: its whole gradient
                # goes to its first position (autograd sums the positions' gradients).
                first = {}
                for i, t in enumerate(inputs):
                    if first.setdefault(id(t), i) != i:
                        result[i] = None
        host = []
        for k, p in enumerate(fwd._params):
            g = result[n_in + k]
            host.append(None if g is None else g.to("cpu", p.dtype))  # returned to autograd: .grad on the host
        return (None, None, *result[:n_in], *host)


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

    __slots__ = ("_module", "_compute", "_name", "_verdicts", "_keys")

    def __init__(self, module: nn.Module, compute_device: torch.device, name: str,
                 keys: Sequence[str] = ("weight", "bias")):
        self._module, self._compute, self._name = module, compute_device, name
        self._verdicts = None  # dtype -> allowed, shared by _RootApply during one conversion
        self._keys = tuple(keys)  # the streamed parameters (a tensor group: all of them)

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

    def check(self, fn) -> None:
        module = self._module
        w = module._parameters.get("weight", module.__dict__.get("weight"))
        for key, p in ((k, w if k == "weight" else module._parameters.get(k)) for k in self._keys):
            # A torch quantized (qint8) weight is probed as the int8 it stores: not
            # floating point, so conversions leave it as it is.
            if p is not None and not self._allowed(fn, torch.int8 if p.is_quantized else p.dtype):
                raise LayerstreamError(
                    f"streamed layer '{self._name}' keeps its weights in host memory and computes on "
                    f"{self._compute}: model.to()/cuda() to that device is fine (the streamed layers "
                    f"stay as they are), but this conversion would move them elsewhere or change "
                    f"their dtype ({key} is {p.dtype}). Convert the model before offload(), or call "
                    f"handle.detach() first.")

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

    __slots__ = ("_model", "_layers")

    def __init__(self, model: nn.Module, layers: list):
        self._model, self._layers = model, layers

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


class Handle(_RefusesCopy):
    """The result of offload(): statistics, synchronisation and detach."""

    def __init__(self, engine, attached: List[_Attached], plan: Optional[dict]):
        self._engine = engine
        self._attached = attached
        self._plan = plan  # the planner's decision when offload() had a budget
        self._root = None  # the model, when offload() installed a _RootApply on it
        # (module, value) of the nn.TransformerEncoderLayer whose fused inference path
        # offload() turned off (_no_fused_encoder_path), to restore in detach().
        self._fused_off = []

    # -- state --------------------------------------------------------------
    def _check(self):
        if self._engine is None:
            raise LayerstreamError(
                "this layerstream handle was detached; call layerstream.offload() again to "
                "stream the model")
        return self._engine

    @property
    def device(self) -> str:
        return self._check().device

    @property
    def compute_device(self) -> torch.device:
        return torch.device(self._check().compute_device)

    @property
    def layers(self) -> List[str]:
        return [a.name for a in self._attached]

    @property
    def plan(self) -> Optional[str]:
        """The planner's placement (printable), when offload() had a budget."""
        engine = self._check()
        if self._plan is None:
            return None
        tables = [a for a in self._attached if a.kind == "embedding"]
        if not tables:
            return self._plan["explain"]

        def sharing(t):  # the streamed layers that read the table's weight (a tied head)
            return [a.name or "<root>" for a in self._attached
                    if a is not t and a.module._parameters.get("weight") is t.module.weight]

        def describe(t):
            tied = sharing(t)
            return (t.name or "<root>") + (f" (weight shared with {', '.join(tied)}: its bytes are in the "
                                           f"host RAM line above)" if tied else "")
        # A table whose weight a streamed head shares is one host copy, already counted
        # in the planner's host RAM line as the head's.
        size = sum(engine.layer_bytes(a.index) for a in tables if not sharing(a))
        return (self._plan["explain"].rstrip("\n") +
                f"\nembedding tables:         {len(tables)} looked up in host memory (pinned unless "
                f"pinning failed), {size / 2**20:.2f} MiB more, no device memory: "
                + ", ".join(describe(t) for t in tables) + "\n")

    def stats(self) -> Dict[str, float]:
        """Counters since offload(): peak_device_bytes (streaming slots plus the
        weights the planner kept resident), h2d_bytes, d2h_bytes, steps, ..."""
        s = dict(self._check().stats())
        s["streamed_device_bytes"] = s["peak_device_bytes"]
        s["resident_bytes"] = 0
        if self._plan is not None:
            s["resident_bytes"] = self._plan["resident_bytes"] + self._plan["fixed_resident_bytes"]
            s["resident_layers"] = len(self._plan["resident"])
            s["budget_bytes"] = self._plan["budget_bytes"]
        s["peak_device_bytes"] = s["streamed_device_bytes"] + s["resident_bytes"]
        for k in ("steps", "h2d_bytes", "d2h_bytes", "peak_device_bytes", "slots", "slot_bytes",
                  "layers", "hits", "misses", "acquires", "deviations", "retraces", "ordering_errors",
                  "failed_backwards", "embedding_layers", "group_layers", "routed_fetches", "gathered_bytes",
                  "pinned_bytes", "pageable_bytes", "max_slots_held", "quantized_layers",
                  "budget_bytes", "streamed_device_bytes", "resident_bytes"):
            if k in s:
                s[k] = int(s[k])
        return s

    def step_stats(self) -> List[Dict[str, float]]:
        """Per completed step: h2d_bytes, d2h_bytes, stall_seconds (time compute
        waited for weights), overlap_fraction (share of copy time hidden behind
        compute; needs trace=True, else NaN), peak_device_bytes, slot
        utilisation (max_slots_held / slots), hits, misses."""
        engine = self._check()
        total = self.stats()
        out = []
        for d in engine.step_stats():
            d = dict(d)
            d["peak_device_bytes"] = total["peak_device_bytes"]
            d["slot_utilisation"] = d["max_slots_held"] / total["slots"] if total["slots"] else 0.0
            out.append(d)
        return out

    def export_trace(self, path: str) -> None:
        """Writes the timeline as Chrome trace / Perfetto JSON (open it in
        ui.perfetto.dev or chrome://tracing). Needs offload(..., trace=True)."""
        text = self._check().trace_json()
        if not text:
            raise LayerstreamError("no timeline was recorded: pass trace=True to offload()")
        with open(path, "w") as f:
            f.write(text)

    def plot_timeline(self, path: str, max_ms: Optional[float] = None) -> None:
        """Draws the timeline (one lane per stream) into a PNG with matplotlib."""
        from .timeline import plot_chrome_trace
        text = self._check().trace_json()
        if not text:
            raise LayerstreamError("no timeline was recorded: pass trace=True to offload()")
        plot_chrome_trace(text, path, max_ms=max_ms)

    def ordering_errors(self) -> List[str]:
        """Races found by the sim device's ordering checker (empty on CUDA)."""
        return list(self._check().ordering_errors())

    def synchronize(self) -> None:
        """Waits for every transfer and gradient copy; param.grad is then complete.
        It also forgets every weight cached on the device, so the next fetch
        reads the host copy again: with cache_across_steps=True, call it after
        writing streamed weights in a way their version counter does not see
        (through ``.data``, or a raw pointer as C++ CPU optimizers do)."""
        self._check().synchronize()

    def detach(self) -> None:
        """Restores the modules: original forward, weights as ordinary tensors
        on their original devices, bit-identical."""
        engine = self._check()
        devices = []
        dense = {}
        for a in self._attached:
            devices.append(a.devices[0])
            if a.bnb_stats is not None:
                # bitsandbytes weights: rebuilt from the same bytes.
                dense[a.index] = engine.packed_codes(a.index)
            elif a.packed_parts:
                # A quantized tensor group: the dequantized values, per packed tensor.
                dense[a.index] = {(o, k): engine.dequantized_part(a.index, part) for _, part, o, k in a.packed_parts}
            elif engine.layer_format(a.index) and not a.prequantized:
                # Quantized by offload(): the dense values were not kept; restore the
                # dequantized weights (lossy by the format's error bound).
                dense[a.index] = engine.dequantized_weight(a.index)
        engine.detach(devices)
        for a in self._attached:
            if a.index in dense and a.bnb_stats is not None:
                import bitsandbytes as bnb
                dev = torch.device(a.devices[0])
                a.module.weight = bnb.nn.Params4bit.from_prequantized(
                    data=dense[a.index].reshape(-1, 1).to(dev),
                    # CPU tensors, as when loading a checkpoint: bitsandbytes moves them.
                    quantized_stats=dict(a.bnb_stats),
                    requires_grad=False, device=dev, module=a.module)
            elif a.index in dense and a.packed_parts:
                for (o, k), value in dense[a.index].items():
                    o._parameters[k] = nn.Parameter(value.to(a.devices[0]), requires_grad=False)
            elif a.index in dense:
                w = dense[a.index]
                if a.strides is not None:  # the layout it had before offload() (e.g. channels_last)
                    w = torch.empty_strided(w.shape, a.strides, dtype=w.dtype).copy_(w)
                a.module.weight = nn.Parameter(w.to(a.devices[0]), requires_grad=False)
        for a in self._attached:
            for h in a.hooks:
                h.remove()
            a.module.__dict__.pop("_apply", None)
            _WHOLE_GROUPS.discard(a.module)
            for o in a.owners:
                o.__dict__.pop("_apply", None)
                for p in o.parameters(recurse=False):
                    if hasattr(p, "_is_memory_managed"):
                        del p._is_memory_managed
            original = type(a.module).__dict__.get("_layerstream_original_class")
            if original is not None:  # an Embedding subclass that looked up through super()
                a.module.__class__ = original
                a.module.__dict__.pop("_layerstream_lookup", None)
            elif a.had_forward:
                a.module.forward = a.old_forward
            else:
                try:
                    del a.module.forward
                except AttributeError:
                    pass
            for p in a.module.parameters(recurse=False):
                if hasattr(p, "_is_memory_managed"):
                    del p._is_memory_managed
            if getattr(a.module, "_layerstream_handle", None) is not None:
                del a.module._layerstream_handle
        if self._root is not None and isinstance(self._root.__dict__.get("_apply"), _RootApply):
            del self._root.__dict__["_apply"]
        for layer, value in self._fused_off:
            layer.activation_relu_or_gelu = value
        self._fused_off = []
        self._root = None
        self._engine = None

    def __repr__(self):
        if self._engine is None:
            return "<layerstream.Handle (detached)>"
        return f"<layerstream.Handle device={self.device} layers={len(self._attached)}>"


def offload(
    model: nn.Module,
    device: Optional[str] = None,
    budget: Union[None, int, str] = None,
    prefetch: int = 2,
    slots: Optional[int] = None,
    include: Union[None, str, Sequence[str]] = None,
    exclude: Union[None, str, Sequence[str]] = None,
    sim_link_gbps: float = 25.0,
    sim_latency_us: float = 5.0,
    checker: bool = True,
    pin_memory: bool = True,
    cache_across_steps: bool = False,
    quantize: Union[None, str, Dict[str, Optional[str]]] = None,
    dequant_dtype: Optional[torch.dtype] = None,
    compute_dtype: Optional[torch.dtype] = None,
    trace: bool = False,
    experts: str = "routed",
    groups: Union[None, str, Sequence[str]] = None,
) -> Handle:
    """Streams the model's Linear, Conv1d/2d/3d, Embedding, MultiheadAttention and MoE experts
    layers from host RAM.

    Eligible submodules (selected by ``include``/``exclude`` glob patterns on
    their qualified names) keep their parameters (same objects, same names)
    but the data moves to (pinned) host memory; their ``forward`` streams the
    weights to ``device`` just before use. ``nn.Embedding`` tables (without
    ``max_norm``; subclasses too when their forward looks up through
    ``super().forward``, as Gemma's scaled word embedding does) move to host
    memory too and are looked up there: each call
    reads only the rows its ids name, with no slot and no device copy of the
    table (never quantized); a trainable table's gradient is computed on the
    host from the output gradient's rows. transformers' mixture-of-experts
    modules (experts as 3-D parameters) stream as tensor groups: all of a
    module's tensors in one slot, its own forward run on them (and again in
    backward, on the re-fetched tensors, when a gradient is needed); with
    ``quantize`` they are packed on the host and dequantized in the slot.
    ``nn.MultiheadAttention`` (whose forward reads its projection weights
    directly) streams the same way, its out_proj's tensors in its group.
    Tied weights (an lm_head sharing the embedding's weight) stream when every
    module that has the weight streams: from one host copy, unquantized, the
    gradient of the uses summed through autograd. Everything else of the model
    is moved to the compute device, including layers whose weight a resident
    module shares, or whose bias is shared (one warning names them).

    device: "cuda"/"cuda:N", "sim" (simulated device; tensors compute on the
        CPU) or None (CUDA when visible, else "sim").
    budget: hard bound on the device bytes of the weights: streaming slots
        plus the layers the planner keeps resident: whole bytes (an int, or a
        text such as "12GiB", "500MB", "1.5e9"), a share of the device's free
        memory ("40%", a float in (0, 1), or "auto": 60%); None = no bound.
        Must hold 2 slots of the largest layer. The planner
        first reserves the slots (``slots``, else prefetch + 1), then keeps as
        many layers resident as the rest holds; a budget too small for
        prefetch + 1 slots gets fewer (at least 2) and a prefetch depth of
        slots - 1.
    prefetch: layers kept in flight ahead of use, 0 to 64; slots: device
        slots, 2 to 66 (default prefetch + 2, capped by the budget). The rules
        for these and the sim link options are the C++ ones
        (csrc/core/options.h): bad values raise ValueError before anything
        changes. offload() inside torch.inference_mode() is refused (the
        tensors it makes could never be trained); run the model in it after.
    quantize: pack streamed weights on the host and dequantize them on the
        device: "int8", "fp8", "nf4" or "int4" for every streamed layer (layers
        whose shape the format cannot pack stay dense, with one warning), or a
        dict {glob pattern: format or None} for per-layer choices (first match
        wins; an explicit format that cannot pack a layer is an error).
        Quantized weights must be frozen (requires_grad False). Each quantized
        layer's slot holds the packed weight and, written on the device right
        after the copy, the dequantized weight. The module keeps a data-less
        (meta) weight: load_state_dict() and weight.copy_() re-quantize new
        values; other writes, .to() and torch.save of it raise (detach() first).
    dequant_dtype: the dtype quantized weights are dequantized to on the
        device (torch.float32, torch.bfloat16 or torch.float16); None = each
        weight's own dtype. Set it to the activation dtype when that differs
        (e.g. an fp32 checkpoint run in bf16): smaller slots, no cast at use.
    compute_dtype: the dtype the activations will have (torch.float32,
        torch.bfloat16 or torch.float16), e.g. torch.bfloat16 for an fp32
        model run under bf16 autocast. Streamed weights and biases of another
        dtype are cast into their slot right after the copy (inside the
        budget, on the engine's dequant stream) instead of at every use (a
        temporary outside the budget, on the compute stream); quantized
        weights are dequantized to it (it implies dequant_dtype). Weights
        still cross the bus in their own dtype, and numbers do not change:
        the cast is the one used at use, and activations of another dtype
        still use the original weight. None = cast at use.
    trace: record a timeline (copies, layer computations, stalls) for
        Handle.export_trace() / plot_timeline() and per-step overlap.
    experts: how a mixture-of-experts module's weights cross the bus.
        "routed" (default): when a call's routing ids name at most half of the
        experts (decoding, small batches), only those experts' slices are
        copied (and dequantized), on demand after the router ran (one
        device-to-host sync of the ids per call; a call with more than 2 x experts
        (token, expert) picks skips it and gets every expert), and the module is no longer
        prefetched whole until a call needs more than half again; the numbers
        are the same (the module's forward reads no other expert: transformers'
        "eager", "batched_mm" and "grouped_mm" implementations; any other
        gets every expert). "all": every expert, every call (prefetched).
    groups: glob patterns of modules to stream whole as tensor groups (opt-in, for
        layers whose forward reads weights directly: custom layers, RNNs, ...): all
        the parameters of such a module and of its descendants share one slot, its own
        forward runs with them swapped for the fetched tensors, and when a gradient is
        needed it runs again in backward (with the same RNG state). Its forward must be
        a function of its inputs, parameters and the RNG (recomputed), read its
        parameters through the module attributes at call time (not through references
        cached earlier: nn.RNNBase modules are refused for that reason), read no
        parameter outside it, and return no view of a parameter (an error says so).
    cache_across_steps: keep weights in device slots and prefetch across step
        boundaries, detecting weight updates by the parameters' version
        counters. Faster for inference loops and small models. Writes through
        ``.data`` or raw pointers (e.g. C++ CPU optimizers) are not detected:
        call ``handle.synchronize()`` after them, or leave this off.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload() needs a torch.nn.Module, got {type(model).__name__}")
    if experts not in ("routed", "all"):
        raise ValueError(f'experts must be "routed" (copy only the experts a call routes to) or "all", '
                         f"got {experts!r}")
    if torch.is_inference_mode_enabled():
        raise LayerstreamError(
            "offload() was called inside torch.inference_mode(): the tensors it makes would be inference "
            "tensors, which no later training step could use. Call offload() outside inference_mode (then "
            "run the model inside it as you like).")
    # One rule per option, in C++ (core/options.h): the same for C++ and the command line.
    opts = {
        "device": "auto" if device is None else str(device),
        "prefetch": _C.check_prefetch(prefetch),
        "slots": 0 if slots is None else _C.check_slots(slots),
        "sim_h2d_gbps": _C.check_link_gbps(sim_link_gbps),
        "sim_d2h_gbps": _C.check_link_gbps(sim_link_gbps),
        "sim_latency_us": _C.check_latency_us(sim_latency_us),
        "checker": bool(checker),
        "pin_memory": bool(pin_memory),
        "cache_across_steps": bool(cache_across_steps),
        "trace": bool(trace),
        "budget_bytes": -1,  # set from the plan below when a budget is given
    }
    for what, dt in (("dequant_dtype", dequant_dtype), ("compute_dtype", compute_dtype)):
        if dt is not None:
            if dt not in _DEQUANT_DTYPES:
                raise ValueError(f"{what} must be torch.float32, torch.bfloat16 or torch.float16 "
                                 f"(or None), got {dt!r}")
            opts[what] = _DEQUANT_DTYPES[dt]
    if compute_dtype is not None:
        if dequant_dtype is not None and dequant_dtype != compute_dtype:
            raise ValueError(f"dequant_dtype={dequant_dtype} and compute_dtype={compute_dtype} "
                             f"disagree; compute_dtype alone is enough (quantized weights are then "
                             f"dequantized to it)")
        dequant_dtype = compute_dtype
    formats = ([quantize] if isinstance(quantize, str) else
               list(quantize.values()) if isinstance(quantize, dict) else [])
    for fmt in formats:
        if isinstance(fmt, str) and fmt not in _C.quant_formats() and _is_packed_only_format(fmt):
            raise ValueError(f"{fmt!r} is a GGUF format: layerstream streams GGUF weights as they are "
                             f"read from a .gguf file (layerstream.load_gguf) but does not quantize to "
                             f"it; valid formats for quantize=: {', '.join(_C.quant_formats())}")
        if fmt is not None and fmt not in _C.quant_formats():
            raise ValueError(f"unknown quantization format {fmt!r}; valid formats: "
                             f"{', '.join(_C.quant_formats())} (or None to keep a layer dense)")
    resolved = _C.resolve_device(opts["device"])
    compute_device = torch.device("cpu") if resolved == "sim" else torch.device(resolved)

    budget_spec = None if budget is None else _C.parse_budget(budget)  # checked before anything changes
    _check_no_meta(model)
    trainable_gguf = [n for n, p in model.named_parameters() if isinstance(p, GgufWeight) and p.requires_grad]
    if trainable_gguf:
        raise LayerstreamError(
            f"{len(trainable_gguf)} GGUF weight(s) require grad: {', '.join(trainable_gguf[:5])}"
            f"{', ...' if len(trainable_gguf) > 5 else ''}. load_gguf() keeps them as the file's packed blocks, "
            f"which are frozen (no gradient is computed for them); freeze them (requires_grad_(False)) and "
            f"train an adapter over them (LoRA), or load a dense checkpoint to train these weights.")
    dora = _dora_layers(model)
    candidates, padded, custom, computed, wrapped, under_dora, renormed = [], [], [], [], [], [], []
    grouped = []  # the names of modules offload(groups=...) streams whole: their descendants are theirs
    for name, module in model.named_modules():
        if any(name.startswith(g + ".") or g == "" for g in grouped):
            continue
        if groups is not None and _selected(name, groups, None) and _selected(name, include, exclude):
            if any(getattr(m, "_layerstream_handle", None) is not None for m in module.modules()):
                raise LayerstreamError(f"module '{name}' is already offloaded by another layerstream handle; "
                                       f"call detach() on that handle first")
            if "forward" in module.__dict__:
                wrapped.append(f"'{name or '<root>'}'")
                continue
            below = list(module.modules())
            rnn = [m for m in below if isinstance(m, nn.RNNBase)]
            if rnn:
                raise LayerstreamError(
                    f"offload(groups=...) names module '{name or '<root>'}', which holds a "
                    f"{type(rnn[0]).__name__}: its forward reads cached references to its weights "
                    f"(_flat_weights), not the parameters swapped in for the call, so it cannot stream "
                    f"as a tensor group; leave it out of groups= (it stays resident)")
            if any(torch.nn.utils.parametrize.is_parametrized(m) for m in below):
                computed.append(f"'{name or '<root>'}'")
                continue
            params = [p for m in below for p in m._parameters.values() if p is not None]
            if not params or not all(p.is_floating_point() for p in params):
                raise LayerstreamError(
                    f"offload(groups=...) names module '{name or '<root>'}', which has "
                    f"{'no parameters' if not params else 'non-floating-point parameters'} to stream")
            grouped.append(name)
            _WHOLE_GROUPS.add(module)
            candidates.append((name, module, "group"))
            continue
        kind = _is_streamable(module)
        if kind is None or not _selected(name, include, exclude):
            continue
        # Not getattr(): a parametrized weight (spectral_norm) would be computed, which
        # runs a power-iteration step and changes the module's state.
        w = module._parameters.get("weight", module.__dict__.get("weight"))
        if isinstance(w, torch.Tensor) and w.numel() == 0:
            continue  # zero elements (e.g. Linear(0, n)): nothing to stream; it stays as it is
        if getattr(module, "_layerstream_handle", None) is not None or hasattr(module, "_layer_memory_manager"):
            raise LayerstreamError(
                f"module '{name}' is already offloaded by another layerstream handle; call "
                f"detach() on that handle first")
        if kind == "conv" and module.padding_mode != "zeros":
            padded.append(f"'{name or '<root>'}' (padding_mode='{module.padding_mode}')")
            continue
        if not _stock_forward(module, kind):
            custom.append(f"'{name or '<root>'}' ({type(module).__qualname__})")
            continue
        if id(module) in dora:
            under_dora.append(f"'{name or '<root>'}'")
            continue
        if "forward" in module.__dict__:
            wrapped.append(f"'{name or '<root>'}'" + (" (accelerate hook)" if hasattr(module, "_hf_hook") else ""))
            continue
        if _computed_weight(module):
            computed.append(f"'{name or '<root>'}'")
            continue
        if kind == "embedding":
            if not module.weight.is_floating_point():
                continue  # not a float table: left as it is
            if module.max_norm is not None:  # renormalizes the looked-up rows in place
                renormed.append(f"'{name or '<root>'}'")
                continue
        candidates.append((name, module, kind))
    _warn_resident(padded, "conv layer(s) with a padding_mode other than 'zeros'", compute_device,
                   "not streamed; they run their original forward")
    _warn_resident(computed, "layer(s) whose weight is not a parameter of their own", compute_device,
                   "computed by torch.nn.utils.parametrize, e.g. weight_norm / spectral_norm, or "
                   "by pruning; or a plain tensor attribute")
    _warn_resident(custom, "Linear/conv/embedding subclass layer(s) with their own forward", compute_device,
                   "they run that forward: a streamed layer computes the plain Linear/conv/lookup, which "
                   "would drop what it adds")
    _warn_resident(wrapped, "layer(s) whose forward was replaced on the instance", compute_device,
                   "e.g. by accelerate's hooks or other wrapping, which a streamed forward would "
                   "drop; to stream them, remove the wrapper first, e.g. "
                   "accelerate.hooks.remove_hook_from_module(model, recurse=True)")
    _warn_resident(under_dora, "layer(s) of a peft DoRA adapter", compute_device,
                   "DoRA reads the base and adapter weights directly at every forward to compute "
                   "the weight norm, which a streamed layer does not keep on the device; plain "
                   "LoRA (use_dora=False) streams the base layers")
    _warn_resident(renormed, "embedding layer(s) with max_norm", compute_device,
                   "each lookup renormalizes the rows it reads in place, which a streamed lookup "
                   "does not do")
    candidates, tie_groups = _split_tied(model, candidates, compute_device)
    _check_no_shared_storage(model, candidates)
    tied_names = {n for g in tie_groups for n in g}
    # Embedding tables stay in host memory and are looked up there (no slot, no planner
    # entry, no quantization): only the rows a batch names cross the bus.
    order = {id(module): i for i, (_, module, _) in enumerate(candidates)}  # attached in model order
    tables = [(name, module, kind, None, None, 0, 0, 0) for name, module, kind in candidates
              if kind == "embedding"]
    candidates = [c for c in candidates if c[2] != "embedding"]
    if not candidates and not tables:
        raise LayerstreamError(
            "offload() found no Linear, Conv1d/2d/3d, Embedding, MultiheadAttention or mixture-of-experts "
            "layer to stream"
            + (" (check include/exclude)" if include is not None or exclude is not None else ""))

    # 1. Per layer: quantization format (or pre-quantized int8) and the bytes
    #    it takes on the bus, in a slot (as the engine lays them out) or resident.
    #    A quantized layer's slot holds the packed weight and, after it, the
    #    weight dequantized on the device (in its dense dtype).
    layers = []  # (name, module, kind, fmt, pre, bus_bytes, slot_bytes, resident_bytes)
    unpackable, trainable, tied_dense = [], [], []
    for name, module, kind in candidates:
        if kind == "group":
            # One slot holds every tensor; with a format, each tensor of 2+ dimensions
            # crosses packed (as a matrix of its last dimension's columns) and is
            # dequantized into the slot's workspace after the copy.
            # GGUF tensors (load_gguf) cross as the file's blocks whatever the format.
            fmt = _quant_for(name, quantize)
            params = [o._parameters[k] for o, k, _ in _group_slots(module)]
            packed = [p for p in params if p.dim() >= 2 and not isinstance(p, GgufWeight)]
            if fmt is not None:
                reasons = [_C.quant_check(fmt, p.numel() // p.shape[-1], p.shape[-1]) for p in packed]
                reason = next((r for r in reasons if r), "")
                if reason and isinstance(quantize, str):
                    unpackable.append(f"{name} ({reason})")
                    fmt = None
                elif reason:
                    raise LayerstreamError(f"cannot quantize layer '{name}' to {fmt}: {reason}")
            if fmt is not None and any(p.requires_grad for p in packed):
                trainable.append(name or "<root>")
            elif fmt is not None and not all(bool(torch.isfinite(p.detach()).all()) for p in packed):
                raise LayerstreamError(f"cannot quantize layer '{name or '<root>'}' to {fmt}: a tensor has "
                                       f"NaN or Inf values; fix the checkpoint or do not quantize this layer "
                                       f"(quantize={{'{name}': None, ...}})")
            bus = workspace = 0
            for p in params:
                if isinstance(p, GgufWeight):
                    bus += _align256(p.gguf_bytes.numel())
                    workspace += _align256(p.numel() * (dequant_dtype or p.dtype).itemsize)
                elif fmt is not None and p.dim() >= 2:
                    bus += _align256(_C.quant_packed_bytes(fmt, p.numel() // p.shape[-1], p.shape[-1]))
                    workspace += _align256(p.numel() * (dequant_dtype or p.dtype).itemsize)
                else:
                    bus += _align256(p.numel() * p.element_size())
            layers.append((name, module, kind, fmt, None, bus, bus + workspace,
                           sum(p.numel() * p.element_size() for p in params)))
            continue
        weight, bias = module.weight, module.bias
        pre = _prequantized(name, module)
        if pre is not None and kind != "linear":
            raise LayerstreamError(f"layer '{name}': pre-quantized weights are supported for "
                                   f"Linear layers only")
        fmt = _quant_for(name, quantize) if pre is None else None
        if fmt is not None and name in tied_names:
            tied_dense.append(f"'{name or '<root>'}'")  # one host copy, read dense by every user
            fmt = None
        if fmt is not None and weight.requires_grad:
            trainable.append(name or "<root>")
        elif fmt is not None and not bool(torch.isfinite(weight.detach()).all()):
            # Checked before anything changes: the packer refuses it, and undoing the layers
            # quantized before this one could only restore their dequantized values.
            raise LayerstreamError(f"cannot quantize layer '{name or '<root>'}' to {fmt}: its weight "
                                   f"has NaN or Inf values; fix the checkpoint or do not quantize "
                                   f"this layer (quantize={{'{name}': None, ...}})")
        if pre is not None:
            rows, cols = pre.rows, pre.cols
        else:
            rows = weight.shape[0]
            cols = weight.numel() // max(rows, 1)
        if fmt is not None:
            reason = _C.quant_check(fmt, rows, cols)
            if reason:
                if isinstance(quantize, str):
                    unpackable.append(f"{name} ({reason})")
                    fmt = None
                else:
                    raise LayerstreamError(f"cannot quantize layer '{name}' to {fmt}: {reason}")
        dense_dtype = pre.dense_dtype if pre is not None else weight.dtype
        dense_w = rows * cols * dense_dtype.itemsize
        b_bytes = 0 if bias is None else bias.numel() * bias.element_size()
        if pre is not None or fmt is not None:
            w_bytes = _C.quant_packed_bytes(pre.format if pre is not None else fmt, rows, cols)
            workspace = _align256(dense_w if dequant_dtype is None else rows * cols * dequant_dtype.itemsize)
        else:
            w_bytes = dense_w
            cast_w = compute_dtype is not None and dense_dtype != compute_dtype
            workspace = _align256(rows * cols * compute_dtype.itemsize) if cast_w else 0
        if compute_dtype is not None and bias is not None and bias.dtype != compute_dtype:
            # The bias cast follows the device weight in the workspace.
            workspace = _align256(workspace + bias.numel() * compute_dtype.itemsize)
        bus = _align256(w_bytes) + _align256(b_bytes)
        layers.append((name, module, kind, fmt, pre, bus, bus + workspace, dense_w + b_bytes))
    # GGUF weights (load_gguf) of layers that stream neither as Linear layers nor in a tensor
    # group (excluded, a subclass with its own forward, ...) stay resident: dense, dequantized
    # here so that the planner counts them (not undone if offload() fails: the values are the same).
    linear_ids = {id(t[1]) for t in layers if t[2] == "linear"}
    in_groups = {id(o._parameters[k]) for t in layers if t[2] == "group" for o, k, _ in _group_slots(t[1])}
    for module in model.modules():
        if id(module) not in linear_ids:
            _materialize_gguf(module, keep=in_groups)
    if isinstance(quantize, dict):
        # A table named explicitly (no wildcard) for a format: tables are never quantized.
        named = [f"'{name}'" for name, _, _, _, _, _, _, _ in tables
                 if any(not any(c in pattern for c in "*?[") and fnmatch.fnmatchcase(name, pattern) and fmt
                        for pattern, fmt in quantize.items())]
        if named:
            warnings.warn(f"layerstream: quantize= names embedding table(s) {', '.join(named)}, but tables "
                          f"are not quantized: they are looked up in host memory as they are (only the "
                          f"rows a batch names cross the bus)", RuntimeWarning, stacklevel=2)
    if trainable:
        # Refused here, before any module changes (the engine would refuse at the first such
        # layer, after the layers before it had been attached).
        raise LayerstreamError(
            f"quantize={quantize!r} would quantize {len(trainable)} trainable layer(s), but a quantized "
            f"weight is frozen: {', '.join(trainable[:5])}{', ...' if len(trainable) > 5 else ''}. "
            f"Freeze them (requires_grad_(False)), or choose per layer with a dict, first match "
            f"wins, e.g. quantize={{'*lora_*': None, '*': 'nf4'}} for a peft model, or call "
            f"offload() on the frozen base before adding the adapter.")
    if tied_dense:
        warnings.warn(f"layerstream: quantize={quantize!r} does not apply to {len(tied_dense)} layer(s) "
                      f"with tied weights (the weight is shared with an embedding table or another "
                      f"layer, which read the same host copy): they stream unquantized: "
                      + ", ".join(tied_dense), RuntimeWarning, stacklevel=2)
    if unpackable:
        warnings.warn(f"layerstream: quantize={quantize!r} cannot pack {len(unpackable)} layer(s); "
                      f"they stream unquantized: " + "; ".join(unpackable), RuntimeWarning,
                      stacklevel=2)

    # 2. With a budget, the planner decides which layers stay resident; the
    #    slots get what is left. The budget covers every weight on the device.
    plan = None
    resident_names = set()
    if budget_spec is not None:
        budget_bytes = _resolve_budget(budget_spec, compute_device)
        layer_ids = {id(t[1]) for t in layers + tables}  # tables take no device memory
        fixed = 0
        counted = set()  # a tensor shared by two modules (tied weights) is on the device once
        for t in layers:  # a tensor group's tensors held by a child (an attention's out_proj)
            if t[2] == "group":
                counted.update(id(o._parameters[k]) for o, k, _ in _group_slots(t[1]))
        for module in model.modules():
            if id(module) in layer_ids:
                continue
            for t in list(module._parameters.values()) + list(module._buffers.values()):
                if t is not None and not t.is_meta and id(t) not in counted:
                    counted.add(id(t))
                    fixed += t.numel() * t.element_size()
        # Slots first, residency with what is left: the planner reserves the
        # slots the requested prefetch depth needs (prefetch + 1: one in use,
        # `prefetch` in flight; or exactly `slots`) before it keeps any layer
        # resident. Without this it would trade slots for residency (it has
        # no time model here) and silently run at prefetch depth 1. A budget
        # too small for those slots gets fewer (at least 2; prefetch becomes
        # slots - 1), as documented. The slots are sized by the largest
        # *streamed* layer: the planner may keep an outlier (an LM head)
        # resident to shrink them, so whether k slots fit is its call.
        planned = [(n, bb, sb, rb, 0.0, any(o._parameters[key].requires_grad for o, key, _ in _group_slots(m))
                    if k == "group" else bool(m.weight.requires_grad))
                   for n, m, k, _, _, bb, sb, rb in layers]
        wanted = [int(slots)] if slots is not None else list(range(max(2, opts["prefetch"] + 1), 1, -1))
        for min_slots in wanted:
            try:
                plan = _C.plan(budget_bytes, planned, fixed,
                               max_prefetch=max(1, opts["prefetch"], min_slots - 1), min_slots=min_slots)
                break
            except LayerstreamError as e:
                if "too small" not in str(e):
                    raise
                if min_slots != wanted[-1]:
                    continue  # fewer slots may fit (prefetch becomes slots - 1)
                if slots is not None:
                    raise LayerstreamError(f"slots={slots} do not fit in the budget: {e}; or ask for "
                                           f"fewer slots (at least 2)") from None
                raise
        resident_names = set(plan["resident"])
        # Tied weights: a layer kept resident keeps its tensor on the device, so the
        # layers that share it stay resident too (it is on the device once, counted once).
        for group in tie_groups:
            if resident_names.intersection(group):
                resident_names.update(group)
        opts["budget_bytes"] = max(0, budget_bytes - plan["resident_bytes"] - plan["fixed_resident_bytes"])

    # 3. Attach the streamed layers to one engine. A failure part way (e.g. a weight the
    #    format cannot pack, host memory) undoes what was attached, as detach() does.
    engine = _C.Engine(opts)
    attached: List[_Attached] = []
    streamed_params = set()
    handle = Handle(engine, attached, plan)
    try:
        _attach_layers(engine, sorted(layers + tables, key=lambda t: order[id(t[1])]), resident_names,
                       attached, streamed_params, compute_device, experts == "routed")
        for a in attached:
            a.module._layerstream_handle = handle
        _no_fused_encoder_path(model, attached, handle._fused_off)
        streamed_ids = {id(a.module) for a in attached}
        for name in grouped:  # a groups= module kept resident is an ordinary module again
            module = model.get_submodule(name)
            if id(module) not in streamed_ids:
                _WHOLE_GROUPS.discard(module)
        if not isinstance(model.__dict__.get("_apply"), _StreamedApply):
            model._apply = _RootApply(model, [m._apply for a in attached for m in [a.module] + a.owners])
            handle._root = model
        # Resident weights to the compute device (device memory can run out here; the
        # tensors already moved stay there, on the device the model was meant for).
        _move_resident(model, streamed_params, compute_device)
    except BaseException:
        for name in grouped:
            _WHOLE_GROUPS.discard(model.get_submodule(name))
        try:
            handle.detach()
        except Exception as undo_error:  # pragma: no cover - reported with the original error
            warnings.warn(f"layerstream: offload() failed and undoing it failed too: {undo_error}",
                          RuntimeWarning, stacklevel=2)
        raise
    return handle


def _no_fused_encoder_path(model: nn.Module, attached, undo: list) -> None:
    """nn.TransformerEncoderLayer's fused inference path (eval, no gradient) passes the
    weights of its self_attn, linear1 and linear2 to one kernel itself, bypassing their
    forwards: it would run on the host copies of streamed weights (a device mismatch on a
    GPU; the data-less stand-ins of packed ones). On a layer with any of them streamed it
    is turned off (activation_relu_or_gelu = 0, which only that path reads at call time;
    the unfused path computes the same function with the layer's own activation).
    detach() restores it."""
    streamed = {id(a.module) for a in attached}
    for m in model.modules():
        if (isinstance(m, nn.TransformerEncoderLayer) and getattr(m, "activation_relu_or_gelu", 0)
                and any(id(getattr(m, n, None)) in streamed for n in ("self_attn", "linear1", "linear2"))):
            undo.append((m, m.activation_relu_or_gelu))
            m.activation_relu_or_gelu = 0


def _materialize_gguf(module: nn.Module, keep=frozenset()) -> None:
    """Replaces the module's own GGUF weights (load_gguf) by dense, dequantized
    parameters (frozen), for a module that does not stream them (but not those
    whose id is in `keep`: a streamed tensor group's)."""
    for k, p in list(module._parameters.items()):
        if isinstance(p, GgufWeight) and id(p) not in keep:
            module._parameters[k] = nn.Parameter(p.dequantized(), requires_grad=False)


def _attach_layers(engine, layers, resident_names, attached, streamed_params, compute_device,
                   routed: bool) -> None:
    """offload() step 3: hands each streamed layer to `engine` and swaps its forward,
    appending to `attached` / `streamed_params` as it goes (what offload() undoes on
    failure)."""
    for name, module, kind, fmt, pre, _, _, _ in layers:
        if name in resident_names:  # the planner counted it dense
            for owner in (dict.fromkeys(o for o, _, _ in _group_slots(module)) if kind == "group" else [module]):
                _materialize_gguf(owner)
            continue
        if kind == "group":
            slots = _group_slots(module)
            params = [o._parameters[k] for o, k, _ in slots]
            devices = [str(params[0].device)]
            n_experts = getattr(module, "num_experts", 0) if routed else 0
            n_experts = n_experts if isinstance(n_experts, int) and n_experts > 1 else 0
            gguf = [(p.gguf_format, p.gguf_bytes) if isinstance(p, GgufWeight) else None for p in params]
            index = engine.add_group(name or "<root>", params, fmt or "", n_experts,
                                     gguf if any(gguf) else [])
            had_forward = "forward" in module.__dict__
            old_forward = module.__dict__.get("forward")
            a = _Attached(name, module, kind, index, had_forward, old_forward, devices)
            attached.append(a)
            if fmt is not None or any(gguf):
                # Packed on the host: the module keeps data-less stand-ins (the dense
                # tensors, or a GGUF file's bytes, are freed); copy_ / load_state_dict()
                # re-quantize into them (not into GGUF parts: the engine refuses).
                a.packed_parts = [(qn, part, o, k) for part, ((o, k, qn), p) in enumerate(zip(slots, params))
                                  if p.dim() >= 2 and (fmt is not None or gguf[part])]
                for qn, part, o, k in a.packed_parts:
                    p = o._parameters[k]
                    o._parameters[k] = _PackedWeight(tuple(p.shape), p.dtype, engine, index,
                                                     f"{name or '<root>'}.{qn}", part)
                a.hooks = _requantize_on_load(engine, index, module, a.packed_parts)
                params = [o._parameters[k] for o, k, _ in slots]
            module.forward = _GroupForward(engine, index, old_forward or module.forward, module, slots,
                                           name or "<root>", n_experts)
            # Each module that owns some of the tensors keeps them where they are on
            # model.to() (nn.MultiheadAttention: its out_proj too).
            for owner in dict.fromkeys(o for o, _, _ in slots):
                keys = [k for o, k, _ in slots if o is owner]
                qn = next(q for o, k, q in slots if o is owner)
                sub = qn[:-len(keys[0]) - 1] if owner is not module else ""
                full = ".".join(x for x in (name, sub) if x) or "<root>"
                owner._apply = _StreamedApply(owner, compute_device, full, keys)
                if owner is not module:
                    a.owners.append(owner)
            for p in params:
                p._is_memory_managed = True
                streamed_params.add(id(p))
            continue
        weight, bias = module.weight, getattr(module, "bias", None)
        devices = [str(weight.device)]  # a GgufWeight's is the CPU, where its bytes are
        if pre is not None:
            if pre.format == "int8":
                index = engine.add_linear_int8(name or "<root>", pre.codes, pre.scales, bias,
                                               pre.dense_dtype)
            else:
                index = engine.add_linear_packed(name or "<root>", pre.format, pre.codes, pre.scales,
                                                 bias, pre.rows, pre.cols, pre.dense_dtype)
            # The engine copied them into its host store: let them go now rather than when
            # offload() returns (a GGUF file's bytes would otherwise be held twice until then).
            pre.codes = pre.scales = None
        elif kind == "embedding":
            index = engine.add_embedding(name or "<root>", weight,
                                         -1 if module.padding_idx is None else module.padding_idx,
                                         module.scale_grad_by_freq, module.sparse)
        elif kind == "linear":
            index = engine.add_linear(name or "<root>", weight, bias, fmt or "")
        else:
            index = engine.add_conv(name or "<root>", weight, bias, quantize=fmt or "",
                                    **_conv_args(module))
        # Recorded as soon as the engine holds the layer, so that a failure below
        # is undone for this layer too.
        had_forward = "forward" in module.__dict__
        old_forward = module.__dict__.get("forward")
        a = _Attached(name, module, kind, index, had_forward, old_forward, devices,
                      prequantized=pre is not None and not pre.gguf,
                      bnb_stats=None if pre is None else pre.bnb_stats,
                      strides=None if weight.is_contiguous() else tuple(weight.stride()))
        attached.append(a)
        if (pre is None or pre.bnb_stats is not None or pre.gguf) and engine.layer_format(index):
            # The weight now lives packed on the host; the module keeps a
            # data-less (meta) parameter of the same shape and dtype so the
            # dense (or the bitsandbytes) copy is freed.
            shape = (pre.rows, pre.cols) if pre is not None else tuple(module.weight.shape)
            dtype = pre.dense_dtype if pre is not None else module.weight.dtype
            module.weight = _PackedWeight(shape, dtype, engine, index, name or "<root>")
            del weight
        if engine.layer_format(index):
            # Packed on the host: an in-place write to the module's weight that
            # _PackedWeight does not turn into a re-quantization (or a pre-quantized
            # int8 weight's write) does not reach it; the engine refuses the next call.
            engine.watch_weight(index, module.weight if "weight" in module._parameters
                                else module.__dict__["weight"])
            if pre is None:
                a.hooks = _requantize_on_load(engine, index, module)
        if kind == "embedding" and type(module).forward is not nn.Embedding.forward:
            # A subclass that looks up through super().forward: its own forward stays
            # and reaches the streamed lookup (see _lookup_through_super).
            module.__dict__["_layerstream_lookup"] = _StreamedForward(
                engine, index, kind, functools.partial(nn.Embedding.forward, module), module, name)
            module.__class__ = _with_streamed_lookup(type(module))
        else:
            module.forward = _StreamedForward(engine, index, kind, old_forward or module.forward,
                                              module, name)
        module._apply = _StreamedApply(module, compute_device, name or "<root>")
        for p in module.parameters(recurse=False):
            p._is_memory_managed = True
            streamed_params.add(id(p))


def _align256(n: int) -> int:
    return (n + 255) // 256 * 256


def _resolve_budget(spec, compute_device: torch.device) -> int:
    """Bytes of a budget checked by _C.parse_budget: a byte count, or a share of the
    device's free memory (the sim device reports its simulated capacity)."""
    fraction, nbytes, share = spec
    if not fraction:
        return nbytes
    if compute_device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(compute_device)
    else:
        free = SIM_DEVICE_MEMORY
    return int(free * share)


# Capacity of the simulated device (what budget="auto" sees on "sim").
SIM_DEVICE_MEMORY = 16 * 2**30


def _move_resident(model: nn.Module, streamed_params: set, device: torch.device) -> None:
    """Moves every non-streamed parameter and buffer to the compute device."""
    with torch.no_grad():
        for module in model.modules():
            for pname, p in module._parameters.items():
                if p is None or id(p) in streamed_params or p.device == device:
                    continue
                p.data = p.data.to(device)
            for bname, b in module._buffers.items():
                if b is not None and b.device != device:
                    module._buffers[bname] = b.to(device)
