"""Which modules of a model stream, and as what: eligibility rules (stock forwards,
wrappers, parametrizations, DoRA, tied weights, shared storage) and the names of a
tensor group's parameters. Reads modules; changes nothing.
"""
from __future__ import annotations

import fnmatch
import itertools
import sys
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import prune
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import _C, _peft_params
from ._file_weight import FileWeight
from ._gguf_weight import GgufWeight
from ._packed import _PackedWeight
from ._peft_params import _PEFT_BASE_READERS

LayerstreamError = _C.LayerstreamError


_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


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


def unmark_groups(model: nn.Module, grouped: List[str]) -> None:
    """Takes back the marks _discover set on the modules named `grouped`: an offload()
    refused (or interrupted) before its layers are attached leaves the model exactly as it
    was, and a later offload() or error message names no group of the refused call."""
    for name in grouped:
        _WHOLE_GROUPS.discard(model.get_submodule(name))


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


def _is_transformers_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2 and the models built like it: c_attn, c_proj, c_fc): a
    Linear whose weight is stored [in, out] and applied by its own forward (addmm), with no
    nn.Linear to swap; it streams as a tensor group (its own forward on the fetched
    tensors), as nn.MultiheadAttention does. Exactly that class (a subclass may compute
    something else)."""
    cls = type(module)
    return (cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"
            and isinstance(module._parameters.get("weight"), torch.Tensor)
            and all(p.is_floating_point() for p in module._parameters.values() if p is not None))


# Note [diffusers' GGUF layers stream as groups]
# diffusers' GGUFQuantizationConfig (from_single_file / from_pretrained of a .gguf)
# gives GGUFLinear modules whose weight is a GGUFParameter: the file's blocks as uint8
# with their quant_type; their forward dequantizes them with diffusers' own torch code
# (fp16 arithmetic for most formats, then compute_dtype) and calls linear. Streaming
# them as our GGUF Linear (load_gguf's path) would dequantize with gguf-py's float32
# arithmetic instead: other numbers than diffusers'. So such a module streams as a
# tensor group: its blocks (and bias) cross the bus as they are, the slot's view of
# the blocks is made a GGUFParameter again (as_held: same memory, its quant_type), and
# diffusers' forward runs on it, computing what diffusers computes on the device. The
# dequantized weight its forward makes is a temporary outside the budget, as it is in
# diffusers without offloading. Under torch.compile the group's shape trial gets a
# fake tensor of the dequantized shape instead (a fake tensor cannot become a
# GGUFParameter), which diffusers' dequantize passes through.


def _is_diffusers_gguf(module: nn.Module) -> bool:
    """diffusers' GGUFLinear with its blocks in a GGUFParameter: it streams as a tensor
    group (Note [diffusers' GGUF layers stream as groups])."""
    cls = type(module)
    return (cls.__name__ == "GGUFLinear" and cls.__module__ == "diffusers.quantizers.gguf.utils"
            and type(module._parameters.get("weight")).__name__ == "GGUFParameter")


def as_held(p: torch.Tensor, t: torch.Tensor, trial: bool = False) -> torch.Tensor:
    """`t` (a fetched view of group tensor `p`) as the module's own forward must find
    it: a diffusers GGUFParameter keeps its quant_type, by which that forward
    dequantizes (no copy: a subclass over the same memory). `trial`: `t` is a fake
    tensor for torch.compile's shape trial, which cannot become a GGUFParameter; the
    module then gets one of the dequantized weight's shape and dtype (diffusers'
    dequantize, run on the meta device), which that dequantize passes through."""
    if type(p).__name__ != "GGUFParameter":
        return t
    if not trial:
        return type(p)(t, requires_grad=False, quant_type=p.quant_type)
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        dense = dequantize_gguf_tensor(type(p)(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                               quant_type=p.quant_type))
    return torch.empty(dense.shape, dtype=dense.dtype, device=t.device)


def _is_streamable(module: nn.Module) -> Optional[str]:
    """Returns 'linear', 'conv', 'embedding', 'group' (mixture-of-experts weights,
    nn.MultiheadAttention, transformers' Conv1D, diffusers' GGUFLinear) or None."""
    if _is_experts(module) or _is_transformers_conv1d(module) or _is_diffusers_gguf(module):
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


# The tensors nn.MultiheadAttention's forward reads (out_proj's aside), looked for by
# name: one parametrized, pruned or made a buffer is no longer in its _parameters.
_MHA_TENSORS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
                "bias_k", "bias_v")


def _computed_tensor(module: nn.Module) -> Optional[str]:
    """The name of a tensor the module's forward reads that is not a parameter of its
    own (None when there is none): one computed (torch.nn.utils.parametrize:
    weight_norm, spectral_norm, ...; pruning's forward pre-hook, which keeps the result
    in the instance dict), a plain float tensor attribute, or a buffer. Streaming would
    freeze one computed value, lose the gradients of the tensors it is computed from,
    or fail at every call (the streamed forward finds the tensor it streams replaced). A
    torch quantized or int8 weight in the instance dict (pre-quantized, streamed as it
    is) is not one. nn.MultiheadAttention's out_proj counts as its own: its forward reads
    out_proj.weight directly (they stream as one group)."""
    owners = [("", module)]
    if isinstance(module, nn.MultiheadAttention):
        owners.append(("out_proj.", module.out_proj))
    for prefix, owner in owners:
        names = _MHA_TENSORS if isinstance(owner, nn.MultiheadAttention) else ("weight", "bias")
        for n in names:
            t = owner.__dict__.get(n)
            if (torch.nn.utils.parametrize.is_parametrized(owner, n) or owner._buffers.get(n) is not None
                    or (n not in owner._parameters and isinstance(t, torch.Tensor) and t.is_floating_point())):
                return prefix + n
        if torch.nn.utils.parametrize.is_parametrized(owner):  # another tensor (its own forward may read it)
            return prefix + next(iter(owner.parametrizations.keys()))
        for hook in owner._forward_pre_hooks.values():  # pruning of a tensor of another name
            if isinstance(hook, prune.BasePruningMethod):
                return prefix + hook._tensor_name
    return None


def _already_offloaded(model: nn.Module, name: str, module: nn.Module) -> None:
    """Refuses a module another handle streams, naming the way back: the handle is
    reachable from its layers when the caller did not keep it (offload(model) on its
    own line), and layerstream.compat's MemoryManager from the model it attached to."""
    held = next((n for n, m in model.named_modules() if m is module), name)
    path = "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in held.split(".") if p)
    if getattr(module, "_layerstream_handle", None) is not None:
        back = (f"call detach() on that handle first (the one offload() returned; if it was not kept: "
                f"{path}._layerstream_handle.detach())")
    else:
        back = "call layerstream.compat.MemoryManager.detach() on the model it was attached to first"
    raise LayerstreamError(f"module '{name}' is already offloaded by another layerstream handle; {back}")


def peft_base_reader(m: nn.Module) -> Optional[str]:
    """The adapter type (e.g. "DoRA", "HRA") when `m` is a peft tuner layer whose forward
    reads its base layer's weight or bias itself (_PEFT_BASE_READERS), else None."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    base_cls = getattr(tuners, "BaseTunerLayer", None)
    if base_cls is None or not isinstance(m, base_cls):
        return None
    use_dora = getattr(m, "use_dora", None)
    if isinstance(use_dora, dict) and any(use_dora.values()):
        return "DoRA"
    parts = type(m).__module__.split(".")
    label = _PEFT_BASE_READERS.get(parts[2]) if parts[:2] == ["peft", "tuners"] and len(parts) > 2 else None
    if label is None:
        return None
    base = m.get_base_layer()
    if label == "MiSS":
        return label if getattr(m, "miss_fn", None) == "bat" else None
    if label in ("BOFT", "DeFT", "FRoD"):
        reads_weight = label == "BOFT" and isinstance(base, _CONV_TYPES)
        return label if reads_weight or getattr(base, "bias", None) is not None else None
    return label


def _dora_layers(model: nn.Module) -> Dict[int, str]:
    """id -> adapter type of the modules inside a peft tuner layer whose forward reads
    its base weight itself (peft_base_reader: DoRA, HRA, ...; DoRA reads the lora_A /
    lora_B weights directly too): they stay resident, with the tuner layer's own
    modules. (The name is compat's, which shares the rule.)"""
    out = {}
    for m in model.modules():
        label = peft_base_reader(m)
        if label is not None:
            out.update((id(sub), label) for sub in m.modules() if sub is not m)
    return out


def _check_no_meta(model: nn.Module) -> None:
    """offload() needs every weight's values: refuses data-less (meta) parameters and
    buffers with the names of the first few, before anything changes; so are a lazy
    module's parameters not yet initialized (nn.LazyLinear before its first call)."""
    lazy = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers())
            if isinstance(t, nn.parameter.UninitializedTensorMixin)]
    if lazy:
        raise LayerstreamError(
            f"{len(lazy)} parameter(s)/buffer(s) are not initialized yet (lazy modules such as nn.LazyLinear "
            f"take their shapes from their first call): {', '.join(lazy[:5])}{', ...' if len(lazy) > 5 else ''}. "
            f"Run the model once on a batch of the real input shape, then call offload().")
    tensors = list(itertools.chain(model.named_parameters(), model.named_buffers()))
    meta = [n for n, t in tensors
            if t.is_meta and not isinstance(t, (_PackedWeight, GgufWeight, FileWeight))]  # offloaded; bytes elsewhere
    if not meta:
        return
    listed = f"{', '.join(meta[:5])}{', ...' if len(meta) > 5 else ''}"
    head = f"{len(meta)} parameter(s)/buffer(s) have no data (meta tensors): {listed}."
    params = list(model.parameters())
    if all(p.is_meta and not isinstance(p, (_PackedWeight, GgufWeight, FileWeight)) for p in params):
        raise LayerstreamError(
            f"{head} The model was built without weights (torch.device('meta'), accelerate's init_empty_weights) "
            f"or its weights are offloaded by accelerate hooks (a device_map with 'cpu'/'disk' entries). Load "
            f"them with layerstream.load_safetensors(model, path) (a .safetensors file, or a transformers or "
            f"diffusers directory) or layerstream.load_gguf(model, path), which leave frozen Linear weights in "
            f"their file until offload() streams them; or into host memory (from_pretrained(...) without "
            f"device_map, or model.to_empty(device='cpu') then load_state_dict()); then call offload().")
    # Some weights have values: a load that left these out, or a part moved to the meta device.
    unsaved = {f"{mn}.{k}" if mn else k for mn, m in model.named_modules() for k in m._non_persistent_buffers_set}
    missing = [n for n in meta if n not in unsaved]
    buffers = [n for n in meta if n in unsaved]
    why = []
    if missing:
        why.append(f"the model's other weights have values, so a load left "
                   f"{'these' if not buffers else repr(missing[0])}"
                   f"{' and others' if buffers and len(missing) > 1 else ''} out (load_safetensors(strict=False) "
                   f"lists them in its report's .missing; load_state_dict(strict=False) too) or a part was moved "
                   f"to the meta device. Load them too (layerstream.load_safetensors(model, path, strict=False) of "
                   f"a file that has them; tied weights: model.tie_weights()), or load the model whole (e.g. "
                   f"from_pretrained(...) without device_map), then call offload()")
    if buffers:
        what = ("is a non-persistent buffer" if len(buffers) == 1 else
                f"and {len(buffers) - 1} more are non-persistent buffers")
        why.append(f"'{buffers[0]}' {what}, which no checkpoint holds (the model computes them when it is "
                   f"built): build the model under accelerate's init_empty_weights() (it leaves buffers real) "
                   f"instead of torch.device('meta')")
    raise LayerstreamError(f"{head} " + "; ".join(w[0].upper() + w[1:] for w in why) + ".")


def _is_wrapper(t: torch.Tensor) -> bool:
    """A tensor subclass that wraps others (optimum-quanto's and torchao's quantized
    weights): it has no storage of its own to compare."""
    return is_traceable_wrapper_subclass(t)


def _check_no_shared_storage(model: nn.Module, candidates: list) -> None:
    """Refuses, before anything changes, streamed parameters that share memory with another
    tensor of the model (views of one flat buffer, as some trainers build), or that use only
    part of their memory (a view into a buffer held outside the model, a master copy, or a
    strided slice such as big[::2, ::2]): offload() moves each streamed parameter into dense
    host memory of its own, and detach() could not restore the sharing or the gaps. The same
    tensor in several places (tied weights) is not refused here."""
    owners = {}  # storage address -> names of the distinct tensors on it
    seen = set()
    for n, t in itertools.chain(model.named_parameters(remove_duplicate=True),
                                model.named_buffers(remove_duplicate=True)):
        if t is None or t.is_meta or id(t) in seen or _is_wrapper(t) or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(id(t))
        owners.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(n)
    streamed = []
    for name, module, kind in candidates:
        params = ([(qn, o._parameters[k]) for o, k, qn in _group_slots(module)] if kind == "group" else
                  [(k, module._parameters.get(k)) for k in ("weight", "bias")])
        streamed += [(f"{name}.{pn}" if name else pn, p, name) for pn, p in params
                     if p is not None and not p.is_meta and not _is_wrapper(p)]
    for qn, p, name in streamed:
        names = owners.get((p.device, p.untyped_storage().data_ptr()), [])
        if len(names) > 1:
            raise LayerstreamError(
                f"parameter '{qn}' shares its memory with {', '.join(repr(n) for n in names if n != qn)} "
                f"(views of one flat buffer); offload() moves each streamed parameter into host memory of "
                f"its own, so that sharing would be lost for good after detach(). Give the parameters "
                f"memory of their own before offload() (e.g. p.data = p.data.clone() for each), or keep "
                f"these layers resident (offload(exclude=[...])).")
        # Without self-overlap (refused next), uses == holds only for dense memory of its own.
        uses, holds = p.numel() * p.element_size(), p.untyped_storage().nbytes()
        if uses < holds:
            raise LayerstreamError(
                f"parameter '{qn}' (shape {tuple(p.shape)}, strides {tuple(p.stride())}, storage offset "
                f"{p.storage_offset()}) uses {uses} of the {holds} bytes of its memory: it is a view into a "
                f"larger buffer (a flat buffer or a master copy outside the model) or a strided slice. "
                f"offload() moves each streamed parameter into dense host memory of its own, so whatever "
                f"else views that buffer would no longer share memory with it, for good after detach() "
                f"(which gives it back dense). Give it memory of its own before offload() "
                f"(p.data = p.data.clone()), or keep the layer resident (offload(exclude=[{name!r}])).")


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of `t` are at one address (expand()ed, or an as_strided view
    that revisits its memory). torch answers for dense layouts and stride 0; for other
    views: unless each stride, smallest first, steps past everything the smaller ones
    reach, the layout counts as overlapping (a sufficient rule for distinct addresses)."""
    answer = torch._debug_has_internal_overlap(t)  # 0: no, 1: yes, 2: torch cannot tell
    if answer != 2:
        return answer == 1
    reach = 0
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _check_no_self_overlap(candidates: list) -> None:
    """Refuses, before anything changes, a streamed parameter whose memory overlaps itself
    (nn.Parameter(row.expand(n, -1)): one row for all, stride 0). offload() would stream
    a dense copy of it, and detach() could not give it back: its strides cannot be written."""
    for name, module, kind in candidates:
        params = ([(qn, o._parameters[k]) for o, k, qn in _group_slots(module)] if kind == "group" else
                  [(k, module._parameters.get(k)) for k in ("weight", "bias")])
        for pn, p in params:
            if p is None or p.is_meta or _is_wrapper(p) or p.numel() == 0 or not _overlaps_itself(p):
                continue
            raise LayerstreamError(
                f"parameter '{f'{name}.{pn}' if name else pn}' has shape {tuple(p.shape)} and strides "
                f"{tuple(p.stride())}: its memory overlaps itself (an expand()ed view, or as_strided), so "
                f"several of its elements are one value in memory. offload() would stream a dense copy, "
                f"which detach() could not give back in that layout. Give it memory of its own before "
                f"offload() (p.data = p.data.contiguous()), or keep the layer resident "
                f"(offload(exclude=[{name!r}])).")


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


def inside_groups(candidates: list) -> List[tuple]:
    """(group name, name, module) of each module below a streamed tensor group that holds a
    weight of it (a tensor of 2+ dimensions, e.g. an attention's out_proj, a Linear of a
    groups= module): its tensors stream in the group's slot, packed in the group's format,
    so an option that names it alone (exclude=, quantize={pattern: format}) cannot apply."""
    return [(name, sub, m) for name, module, kind in candidates if kind == "group"
            for sub, m in module.named_modules(prefix=name) if m is not module
            and any(p.dim() >= 2 for p in m.parameters())]


def group_why(group: str, module: nn.Module) -> Tuple[str, str]:
    """Why a tensor group streams its descendants with it, and the other way out of it."""
    if module in _WHOLE_GROUPS:
        return ("offload(groups=...) streams it whole", f"leave {group or '<root>'!r} out of groups= (its Linear "
                "and conv layers then stream one by one, and options apply to each)")
    if isinstance(module, nn.MultiheadAttention):
        return "nn.MultiheadAttention's forward reads its out_proj's weight directly", ""
    return "its own forward reads these weights", ""


def _check_exclude_inside_groups(candidates: list, exclude) -> None:
    """exclude= naming a module inside a streamed tensor group (and not the group) was
    silently ignored: the module streamed with the group. A group's tensors share one
    slot and one forward, so the module cannot stay resident alone: refused, naming
    what to write instead. exclude= naming a groups= module leaves it out of groups=
    (its Linear and conv layers then stream one by one): the whole group stays resident
    when its descendants are excluded too ('g.*')."""
    patterns = [exclude] if isinstance(exclude, str) else list(exclude or ())
    for group, name, _ in inside_groups(candidates) if patterns else ():
        pattern = next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)
        if pattern is not None:  # the group itself matched none of them: it streams
            module = next(m for n, m, _ in candidates if n == group)
            why, other = group_why(group, module)
            whole = [group, f"{group}.*"] if module in _WHOLE_GROUPS else [group]
            ways = ([f"exclude the whole group (exclude={whole!r})"] if group else []) + ([other] if other else [])
            raise LayerstreamError(
                f"offload(exclude=[{pattern!r}]) names '{name}', which streams inside tensor group "
                f"'{group or '<root>'}' ({why}): a group's tensors stream together, so a module in it "
                f"cannot stay resident alone. Instead, {'; or '.join(ways)}")


def _check_group_not_inside_a_group(name: str, module: nn.Module, candidates: list, groups) -> None:
    """groups= naming a module whose tensors already stream in a tensor group found earlier
    (an nn.MultiheadAttention's out_proj) failed in the engine ("tensor group 'mha.out_proj':
    tensor #0 is already streamed by layer 'mha'"): refused before anything changes, naming
    the group to write instead."""
    mine = {id(p) for p in module.parameters()}
    for group, owner, kind in candidates:
        if kind != "group" or not (group == "" or name.startswith(group + ".")):
            continue
        if any(id(o._parameters[k]) in mine for o, k, _ in _group_slots(owner)):
            patterns = [groups] if isinstance(groups, str) else list(groups)
            pattern = next(p for p in patterns if fnmatch.fnmatchcase(name, p))
            why, _ = group_why(group, owner)
            raise LayerstreamError(
                f"offload(groups=[{pattern!r}]) names '{name}', which already streams inside tensor group "
                f"'{group or '<root>'}' ({why}); a tensor streams in one group only. Drop the pattern (it "
                f"streams with {group or '<root>'!r} as it is), or name {group or '<root>'!r} itself.")


def _split_tied(model: nn.Module, candidates: list, compute_device: torch.device):
    """Tied weights (the rule: core/offload_policy.h analyse_ties): returns (kept
    candidates, groups), groups being the lists of candidate names that share one
    weight; warns once for the layers kept resident."""
    owners: Dict[int, List[tuple]] = {}  # parameter id -> (module id, parameter name, qualified name)
    seen_modules = set()
    for mname, m in model.named_modules(remove_duplicate=False):
        if id(m) in seen_modules:  # one module reachable under two names is not a tie
            continue
        seen_modules.add(id(m))
        for pname, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((id(m), pname, f"{mname}.{pname}" if mname else pname))
    described = []
    for name, module, kind in candidates:
        params = ([(qn, o._parameters[k]) for o, k, qn in _group_slots(module)] if kind == "group" else
                  [("weight", module._parameters.get("weight")), ("bias", module._parameters.get("bias"))])
        described.append((name, id(module), [(pn, id(p), kind != "group" and pn == "weight")
                                             for pn, p in params if p is not None]))
    kept, groups, tied = _C.analyse_ties(described, owners)  # core/offload_policy.h
    inside, other = [], []  # `tied`: one label per candidate not kept, in order
    for i, label in zip(sorted(set(range(len(candidates))) - set(kept)), tied):
        _, module, kind = candidates[i]
        (inside if kind == "group" and _tied_inside(module, owners) else other).append(label)
    _warn_resident(other, "layer(s) with tied weights", compute_device,
                   "another module that stays resident, or a bias, shares the tensor; a streamed "
                   "copy would move it under that module")
    _warn_resident(inside, "tensor group(s) with a weight tied inside them", compute_device,
                   "a tensor held twice inside one group, as b.weight = a.weight in it, does not stream; "
                   "to stream them, leave the group out of groups=: its Linear and conv layers then stream one by one, "
                   "tied ones from one host copy")
    return [candidates[i] for i in kept], groups


def _tied_inside(module: nn.Module, owners: Dict[int, List[tuple]]) -> bool:
    """Whether every tensor of group `module` that several modules hold is held by modules
    inside the group only (`b.weight = a.weight` in it): _split_tied's `owners`."""
    below = {id(m) for m in module.modules()}
    shared = [owners[id(o._parameters[k])] for o, k, _ in _group_slots(module)
              if len(owners.get(id(o._parameters[k]), ())) > 1]
    return bool(shared) and all(mid in below for who in shared for mid, _, _ in who)


def _warn_resident(names: list, what: str, compute_device: torch.device, why: str,
                   stacklevel: int = 4) -> None:
    """One warning for the layers offload() keeps resident for one reason
    (stacklevel 4: the caller of offload(), when called from a step offload() calls)."""
    if names:
        warnings.warn(f"layerstream: {len(names)} {what} stay resident on {compute_device} ({why}): "
                      + "; ".join(names), RuntimeWarning, stacklevel=stacklevel)


def _conv_args(module: nn.Module) -> dict:
    dims = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}[next(t for t in (nn.Conv1d, nn.Conv2d, nn.Conv3d) if isinstance(module, t))]
    pad, same = module.padding, False
    if module.padding_mode != "zeros":  # the input comes padded (_StreamedForward), as torch's _conv_forward does
        pad = (0,) * dims
    elif isinstance(pad, str):
        if pad == "same":
            same, pad = True, (0,) * dims
        elif pad == "valid":
            pad = (0,) * dims
        else:
            raise ValueError(f"unknown conv padding {pad!r}")
    stride, pad, dilation = (list(v) if isinstance(v, (list, tuple)) else [v] * dims  # conv.stride = 2: one
                             for v in (module.stride, pad, module.dilation))  # int, as F.conv2d expands it
    return dict(dims=dims, stride=stride, padding=pad, same=same, dilation=dilation, groups=int(module.groups))


def _mode_padding(module: nn.Module) -> Optional[Tuple[Tuple[int, ...], str]]:
    """A conv with a padding_mode other than 'zeros' convolves its input padded by
    F.pad, with no padding of its own (_conv_args gives the engine 0), as torch's
    _conv_forward does: (F.pad's pads, mode); None for zero padding."""
    if getattr(module, "padding_mode", "zeros") == "zeros":
        return None
    return tuple(module._reversed_padding_repeated_twice), module.padding_mode


def _pad_for_mode(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    pad = _mode_padding(module)
    return x if pad is None else F.pad(x, pad[0], mode=pad[1])


# Why offload() keeps a streamable module resident: reason -> (what, why) of the one
# warning per reason (_warn_resident), in the order they are given.
_RESIDENT_REASONS = {
    "computed": ("layer(s) whose weight or bias is not a parameter of their own",
                 "computed by torch.nn.utils.parametrize, e.g. weight_norm / spectral_norm, or peft's "
                 "LoRA on parameters (target_parameters) outside mixture-of-experts tensors, or by "
                 "pruning; or a plain tensor attribute, or a buffer"),
    "custom": ("Linear/conv/embedding subclass layer(s) with their own forward",
               "they run that forward: a streamed layer computes the plain Linear/conv/lookup, which "
               "would drop what it adds"),
    "wrapped": ("layer(s) whose forward was replaced on the instance",
                "e.g. by accelerate's hooks or other wrapping, which a streamed forward would "
                "drop; to stream them, remove the wrapper first, e.g. "
                "accelerate.hooks.remove_hook_from_module(model, recurse=True)"),
    "cast_trainable": ("trainable layer(s) under diffusers' layerwise casting",
                       "diffusers keeps such a weight in its storage dtype and gives it a gradient "
                       "in the compute dtype, which a streamed layer does not reproduce; frozen "
                       "ones stream (freeze them, e.g. for LoRA training, before offload())"),
    "dora": ("layer(s) of peft adapters that read their base layer's weights themselves",
             "at every forward (DoRA's weight norm, HRA's reflections, ...), not through the "
             "layer's forward, and a streamed layer does not keep them on the device; plain "
             "LoRA (use_dora=False) streams the base layers"),
    "table_dtype": ("embedding layer(s) whose table is not floating point",
                    "a streamed lookup reads float32, bfloat16, float16 or float64 rows; they are looked "
                    "up as before"),
    "renormed": ("embedding layer(s) with max_norm",
                 "each lookup renormalizes the rows it reads in place, which a streamed lookup "
                 "does not do"),
    # offload() (_activation_dtype); compat has its own text (compat._REASON_TEXT["dtype"]).
    "dtype": ("Linear/conv layer(s) whose weight dtype streamed layers do not compute in",
              "torch's Linear/conv takes its input in its weight's dtype, and a streamed one refuses "
              "such activations at every call; to stream them, convert the model before offload(), "
              "e.g. model.float() or model.to(torch.bfloat16)"),
}


def _takes_activations(dtype: torch.dtype) -> bool:
    """Whether streamed Linear/conv layers take activations of this dtype: the dtypes
    compute_dtype= may name (C++'s rule, options::check_dtypes; the streamed ops check
    their input against the same float32/bfloat16/float16)."""
    try:
        _C.check_dtypes("", str(dtype).replace("torch.", ""))
    except ValueError:
        return False
    return True


def _activation_dtype(module: nn.Module, kind: str) -> Optional[torch.dtype]:
    """The weight dtype of a Linear/conv whose input must have that dtype (torch's
    linear/conv refuse another) when streamed layers refuse activations of it
    (float64, complex): every streamed call would fail, so the layer stays resident,
    with the same numbers as before. None when it streams. float8 (one byte, a storage
    dtype torch's Linear does not compute in) is cast at use to the activations'
    dtype, e.g. under diffusers' layerwise casting: it streams."""
    w = module._parameters.get("weight")
    if kind not in ("linear", "conv") or not isinstance(w, torch.Tensor) or w.dtype.itemsize == 1 \
            or not (w.is_floating_point() or w.is_complex()) or _takes_activations(w.dtype):
        return None
    return w.dtype


def layerwise_casting(module: nn.Module) -> Optional[torch.dtype]:
    """The compute dtype of diffusers' layerwise casting (``enable_layerwise_casting``,
    ``apply_layerwise_casting``) when it is the only wrapper of this layer's stock
    forward, else None. Its hook casts the layer's weights (kept in the storage
    dtype, e.g. float8) to the compute dtype before each call and back after it:
    what a streamed layer computes from the same storage-dtype weights (cast to the
    activations' dtype in the slot or at use, exactly, since float8 -> bfloat16 ->
    any wider float is exact), so such a layer streams its storage-dtype bytes and
    offload() replaces the wrapper (detach() puts it back; docs/design/torch-glue.md,
    "A wrapper that streams"). Read by its attributes,
    as diffusers 0.3x-0.4x lay them out (HookRegistry.hooks, the hook's fn_ref and
    compute_dtype); any other shape of wrapper is not this one."""
    registry, wrapper = module.__dict__.get("_diffusers_hook"), module.__dict__.get("forward")
    hooks = getattr(registry, "hooks", None)
    if wrapper is None or not isinstance(hooks, dict) or list(hooks) != ["layerwise_casting"]:
        return None
    hook = hooks["layerwise_casting"]
    inner = getattr(getattr(hook, "fn_ref", None), "forward", None)  # what the wrapper calls
    if (type(hook).__name__ != "LayerwiseCastingHook" or getattr(wrapper, "__wrapped__", None) is not inner
            or getattr(inner, "__self__", None) is not module
            or getattr(inner, "__func__", None) is not type(module).forward):
        return None
    dtype = getattr(hook, "compute_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


# diffusers' group offloading's hook names (hooks/group_offloading.py): its hooks move the
# weights between the host and the device themselves.
_GROUP_OFFLOADING_HOOKS = ("group_offloading", "lazy_prefetch_group_offloading")


def check_no_group_offloading(model: nn.Module) -> None:
    """offload() refuses a model under diffusers' group offloading (enable_group_offload,
    apply_group_offloading): its hooks assign the weights' .data to the device and back
    around each group's call, the same tensors layerstream holds in host memory and
    streams, so the two would fight over them (on CUDA the next streamed call would find
    its weights moved). Checked before anything changes."""
    for name, module in model.named_modules():
        hooks = getattr(module.__dict__.get("_diffusers_hook"), "hooks", None)
        if isinstance(hooks, dict) and any(h in hooks for h in _GROUP_OFFLOADING_HOOKS):
            raise LayerstreamError(
                f"module '{name or '<root>'}' is under diffusers' group offloading (enable_group_offload / "
                f"apply_group_offloading), which moves its weights between host and device itself; "
                f"layerstream does that job: load the model without enable_group_offload() and call "
                f"offload() on it (diffusers' layerwise casting may stay: it streams)")


def _resident_reason(module: nn.Module, kind: str, dora: Dict[int, str]) -> Optional[str]:
    """Why a module _is_streamable() calls `kind` must not stream (a key of
    _RESIDENT_REASONS), None when it streams: the rule offload() and
    layerstream.compat share (`dora`: _dora_layers() of the model, the peft adapters'
    layers that read their base weight themselves)."""
    if not _stock_forward(module, kind):
        return "custom"
    if id(module) in dora:
        return "dora"
    if "forward" in module.__dict__:
        if kind not in ("linear", "conv") or layerwise_casting(module) is None:
            return "wrapped"  # a table's lookup would not cast its rows as the hook does
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            return "cast_trainable"
    if _computed_tensor(module) is not None:
        return "computed"
    if kind == "embedding":
        if not module.weight.is_floating_point():
            return "table_dtype"  # complex, integer
        if module.max_norm is not None:  # renormalizes the looked-up rows in place
            return "renormed"
    return None


def _resident_label(name: str, module: nn.Module, reason: str) -> str:
    """How a resident layer is named in its reason's warning."""
    label = f"'{name or '<root>'}'"
    if reason == "custom":
        return f"{label} ({type(module).__qualname__})"
    if reason == "table_dtype":
        return f"{label} ({str(module.weight.dtype).replace('torch.', '')})"
    if reason == "wrapped" and hasattr(module, "_hf_hook"):
        return f"{label} (accelerate hook)"
    if reason == "computed":
        tensor = _computed_tensor(module)
        return f"{label} ({tensor})" if tensor else label  # none: peft's LoRA on parameters, during a call
    return label


def _discover(model: nn.Module, include, exclude, groups, compute_device: torch.device):
    """The modules offload() would stream, in model order, as (name, module, kind),
    ties aside; and the names of the modules groups= streams whole. Warns once per
    reason for the layers that stay resident (stacklevel: offload()'s caller)."""
    dora = _dora_layers(model)
    # peft's LoRA on parameters (_peft_params.py): the wrapper reads its adapters'
    # weights directly (they stay on the device, as the trained part: no warning), and
    # parametrizes its base's tensor during each call, which a streamed tensor group
    # supports and a streamed Linear/conv/table does not.
    adapters, wrapped = _peft_params.adapter_modules(model), _peft_params.wrapped_bases(model)
    candidates = []
    resident = {reason: [] for reason in _RESIDENT_REASONS}  # reason -> labels, warned once each
    grouped = []  # the names of modules offload(groups=...) streams whole: their descendants are theirs
    for name, module in model.named_modules():
        if any(name.startswith(g + ".") or g == "" for g in grouped):
            continue
        if groups is not None and _selected(name, groups, None) and _selected(name, include, exclude):
            held = next((m for m in module.modules() if getattr(m, "_layerstream_handle", None) is not None), None)
            if held is not None:
                _already_offloaded(model, name, held)
            _check_group_not_inside_a_group(name, module, candidates, groups)
            if "forward" in module.__dict__:
                resident["wrapped"].append(f"'{name or '<root>'}'")
                continue
            below = list(module.modules())
            rnn = [m for m in below if isinstance(m, nn.RNNBase)]
            if rnn:
                raise LayerstreamError(
                    f"offload(groups=...) names module '{name or '<root>'}', which holds a "
                    f"{type(rnn[0]).__name__}: its forward reads cached references to its weights "
                    f"(_flat_weights), not the parameters swapped in for the call, so it cannot stream "
                    f"as a tensor group; leave it out of groups= (it stays resident)")
            renormed = next((n for n, m in module.named_modules() if isinstance(m, nn.Embedding)
                             and m.max_norm is not None), None)
            if renormed is not None:  # the check in _GroupForward.fetched would refuse its first call
                raise LayerstreamError(
                    f"offload(groups=...) names module '{name or '<root>'}', which holds an nn.Embedding with "
                    f"max_norm ('{'.'.join(x for x in (name, renormed) if x)}'): its lookup renormalizes the rows it "
                    f"reads in place, and a tensor group's forward runs on copies of its tensors (the write would be "
                    f"lost); leave it out of groups= (such a table stays resident)")
            if any(torch.nn.utils.parametrize.is_parametrized(m) for m in below):
                resident["computed"].append(f"'{name or '<root>'}'")
                continue
            # Parameters that are not floating point (raw bytes its forward decodes, e.g.
            # diffusers' GGUF blocks) cross as they are, frozen (engine.h, add_group).
            if not any(p is not None for m in below for p in m._parameters.values()):
                raise LayerstreamError(
                    f"offload(groups=...) names module '{name or '<root>'}', which has no parameters to stream")
            # The engine trains floating-point group tensors only (add_group): named here.
            trained = next(((f"{name}.{n}" if name else n, p) for n, p in module.named_parameters()
                            if p.requires_grad and not p.is_floating_point()), None)
            if trained is not None:
                raise LayerstreamError(
                    f"offload(groups=...) names module '{name or '<root>'}', whose parameter '{trained[0]}' is "
                    f"{str(trained[1].dtype).replace('torch.', '')} and requires grad: a tensor group trains "
                    f"floating-point tensors only, so a complex one cannot stream in it unless frozen (it "
                    f"then crosses as it is). Freeze it ({trained[0]}.requires_grad_(False)) or leave "
                    f"'{name or '<root>'}' out of groups= (its Linear and conv layers then stream one by one, "
                    f"its other tensors stay resident)")
            grouped.append(name)  # marked below, once no refusal of this loop can leave the mark behind
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
            _already_offloaded(model, name, module)
        if id(module) in adapters:
            continue
        reason = "computed" if id(module) in wrapped and kind != "group" else _resident_reason(module, kind, dora)
        if reason is not None:
            label = _resident_label(name, module, reason)
            resident[reason].append(f"{label} ({dora[id(module)]})" if reason == "dora" else label)
            continue
        dtype = _activation_dtype(module, kind)
        if dtype is not None:
            resident["dtype"].append(f"'{name or '<root>'}' ({str(dtype).replace('torch.', '')})")
            continue
        candidates.append((name, module, kind))
    try:  # refused here (or a warning made an error, Ctrl-C): no mark left, the model as it was
        for name in grouped:  # _group_slots() lists every parameter below them from here on
            _WHOLE_GROUPS.add(model.get_submodule(name))
        _check_exclude_inside_groups(candidates, exclude)
        for reason, labels in resident.items():
            what, why = _RESIDENT_REASONS[reason]
            _warn_resident(labels, what, compute_device, why)
        _warn_unmatched(model, include=include, groups=groups)
        _warn_unstreamable(model, grouped, compute_device)
    except BaseException:
        unmark_groups(model, grouped)
        raise
    return candidates, grouped


# _warn_unstreamable's thresholds: weights in modules of no kind layerstream streams that
# are this much of the model say so (norms, biases and small custom tensors stay below).
_UNSTREAMABLE_MIN_BYTES = 1 << 20
_UNSTREAMABLE_MIN_SHARE = 0.25


def _warn_unstreamable(model: nn.Module, grouped: list, compute_device: torch.device) -> None:
    """Parameters held by modules of no kind layerstream streams (not a Linear, conv,
    table, attention, experts or Conv1D; e.g. a custom attention's own nn.Parameter
    projections) stay on the device without any other word; when they are a large
    part of the model (a quarter, and 1 MiB or more), say which modules hold them and
    that offload(groups=...) streams such modules whole; except nn.LSTM/GRU/RNN (and
    modules holding one), which groups= refuses: those are said to stay resident."""
    seen, total, held = set(), 0, {}
    for name, module in model.named_modules():
        mine = 0
        for p in module._parameters.values():
            if p is None or id(p) in seen or p.is_meta or not p.is_floating_point():
                continue
            seen.add(id(p))
            nbytes = p.numel() * p.element_size()
            total += nbytes
            mine += nbytes
        if mine and _is_streamable(module) is None and not any(
                name == g or name.startswith(g + ".") or g == "" for g in grouped):
            held[name] = (mine, module)
    unstreamed = sum(b for b, _ in held.values())
    if unstreamed < _UNSTREAMABLE_MIN_BYTES or unstreamed < _UNSTREAMABLE_MIN_SHARE * total:
        return
    top = sorted(held.items(), key=lambda kv: -kv[1][0])[:5]
    names = "; ".join(f"'{n or '<root>'}' ({type(m).__name__}, {b / 2**20:.1f} MiB)" for n, (b, m) in top)
    # offload(groups=...) refuses these (their forward reads cached references to the weights)
    rnn = [n for n, (_, m) in held.items() if any(isinstance(sub, nn.RNNBase) for sub in m.modules())]
    advice = ""
    if len(rnn) < len(held):
        advice = (" offload(groups=[pattern, ...]) streams such modules whole (their own forward runs on "
                  "the fetched tensors).")
    if rnn:
        shown = ", ".join(f"'{n or '<root>'}'" for n in rnn[:5]) + (", ..." if len(rnn) > 5 else "")
        advice += (f" {shown} hold{'s' if len(rnn) == 1 else ''} an nn.LSTM/GRU/RNN, which stays resident: its "
                   f"forward reads cached references to its weights (_flat_weights), so it cannot stream, "
                   f"not even with groups=.")
    warnings.warn(
        f"layerstream: {unstreamed / 2**20:.1f} MiB of this model's weights ({100 * unstreamed / total:.0f}%) are "
        f"parameters of {len(held)} module(s) of no kind layerstream streams (their own forward reads them): "
        f"they stay resident on {compute_device}. The largest: {names}.{advice}", RuntimeWarning, stacklevel=4)


def _warn_unmatched(model: nn.Module, stacklevel: int = 4, **options) -> None:
    """A pattern of include=, groups= or quantize={pattern: format} that names no module
    is most likely a typo: the modules the user meant then stream otherwise (or not at
    all, or unquantized), so say so. (exclude= patterns are often written for several
    architectures at once, e.g. "lm_head": not warned.)"""
    names = [n for n, _ in model.named_modules() if n]
    for option, patterns in options.items():
        if patterns is None:
            continue
        patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names + [""])]
        if unmatched:
            warnings.warn(f"layerstream: offload({option}=...): {', '.join(repr(p) for p in unmatched)} "
                          f"match{'es' if len(unmatched) == 1 else ''} no module name (glob patterns on names "
                          f"such as {', '.join(repr(n) for n in names[:3])}; model.named_modules() lists them)",
                          RuntimeWarning, stacklevel=stacklevel)
