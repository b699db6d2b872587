"""offload() step 3, the host tier: which streamed weights still in their file stay
there, the staging entries' bytes and what the store may pin (core/host_tier.h), the
quantization cache (core/io/quant_cache.h), and reading a weight out of its file
(docs/design/host-tier.md). Also the byte-size parser offload()'s options share."""
from __future__ import annotations

import os
from typing import Any, Dict, NamedTuple, Optional, Union

import torch
import torch.nn as nn

from . import _C
from ._file_weight import FileWeight
from ._gguf_weight import GgufWeight

LayerstreamError = _C.LayerstreamError


def parse_bytes(value: Union[int, float, str], what: str = "size") -> int:
    """Parses 123, 1.5e9, "500MB", "12GiB" into bytes (whole bytes: "0.5" is refused);
    `what` names the option in errors (e.g. "host_budget")."""
    return _C.parse_size(value, what)


def _read_in(model: nn.Module, p, engine=None):
    """A FileWeight (load_safetensors) read into an ordinary parameter in place: into
    `engine`'s host store (one copy, adopted later without another) or a new CPU
    tensor. The object stays the same (torch.utils.swap_tensors: its class and data
    change), so every holder keeps it without a walk of `model` (tied stay tied), and
    so does an optimizer built before offload() (a new Parameter left it stepping
    the stand-in, which never gets a gradient). Returns `p`."""
    if not isinstance(p, FileWeight):
        return p
    r = p.file_range
    # read_file() carves from a store the node's ranks share: a trainable weight goes there
    # only when the ranks step it in shards (else each rank's optimizer writes its own copy).
    into_store = engine is not None and (not p.requires_grad or engine.host_store_shared(True)
                                         or not engine.host_store_shared(False))
    value = engine.read_file(r, list(p.shape), p.dtype, p.file_dtype) if into_store else p.read()
    new = nn.Parameter(value, requires_grad=p.requires_grad)
    try:
        torch.utils.swap_tensors(p, new)
    except RuntimeError as e:  # a weak reference to it, or a use of it beyond the Python object
        raise LayerstreamError(
            f"offload(): cannot read '{p.file_name}' (in {r.path}) into the parameter that holds its place: "
            f"{e}. Drop what else refers to it (weak references, autograd graphs), or create those after "
            f"offload()") from None
    return p


class _HostTier(NamedTuple):
    """offload() step 3's result: the layers on disk, the plan as numbers, and the
    packed weights of quantized layers on disk (their ranges in the cache file)."""
    names: set
    summary: Optional[dict]
    packed: Dict[str, Any]


def _host_tier(model: nn.Module, layers: list, tables: list, resident_names: set, host_budget,
               pinned_budget, opts, cache_dir=None) -> _HostTier:
    """Step 3: the host budget plan (core/host_tier.h): which streamed Linear weights
    still in their file (load_safetensors) stay there, how many bytes the staging
    entries get, and what the store may pin (set in `opts`). With `cache_dir`,
    quantized ones may stay on disk too, packed in the cache file (built here,
    core/io/quant_cache.h); those that stay in RAM are read in here."""
    streamed = [t for t in layers if t.name not in resident_names] + list(tables)
    in_file = any(isinstance(p, FileWeight) for p in model.parameters())
    if host_budget is None:
        host = _C.default_host_budget() if in_file else -1
        if host >= 0:  # weights already in host RAM move into the store (and are freed there)
            host += sum(p.numel() * p.element_size() for t in streamed for p in t.module.parameters(recurse=False)
                        if p.device.type == "cpu" and not p.is_meta)
    else:
        host = parse_bytes(host_budget, "host_budget")
    pinned = _C.default_pinned_budget() if pinned_budget is None else parse_bytes(pinned_budget, "pinned_budget")
    deferred = [t for t in layers if t.kind == "linear" and t.fmt is not None and t.name not in resident_names
                and isinstance(getattr(t.module, "weight", None), FileWeight)]  # see _formats_and_bytes
    if host < 0 and pinned < 0:
        _read_in_deferred(model, deferred)
        return _HostTier(set(), None, {})

    def in_ram(t) -> list:  # t: an offload() _Candidate; why it could not stay in its file (core/host_tier.h)
        params = [p for p in (getattr(t.module, "weight", None), getattr(t.module, "bias", None)) if p is not None]
        return _C.in_ram_reasons(t.kind == "linear", not any(p.requires_grad for p in params),
                                 all(getattr(p, "file_dtype", p.dtype) == p.dtype for p in params), t.fmt or "",
                                 cache_dir is not None)

    def file_backed(t) -> bool:  # all its tensors are still in a .safetensors file (load_safetensors)
        w, b = getattr(t.module, "weight", None), getattr(t.module, "bias", None)
        return t.pre is None and isinstance(w, FileWeight) and (b is None or isinstance(b, FileWeight))

    def from_file(t) -> bool:
        return file_backed(t) and not in_ram(t)

    def grad_bytes(t) -> int:  # its gradient's host staging buffer (training), as the engine sizes it
        w, b = getattr(t.module, "weight", None), getattr(t.module, "bias", None)
        if t.kind not in ("linear", "conv") or t.fmt not in (None, "lossless") or w is None:
            return 0
        if not (w.requires_grad or (b is not None and b.requires_grad)):
            return 0
        return _C.gradient_staging_bytes(w.numel() * w.element_size(), 0 if b is None else b.numel() * b.element_size())

    entries = [(t.name or "<root>", t.host_bytes if t.host_bytes is not None else t.bus_bytes
                if t.kind != "embedding" else
                sum(p.numel() * p.element_size() for p in t.module.parameters(recurse=False)), from_file(t),
                grad_bytes(t))
               for t in streamed]
    try:
        p = _C.host_tier_plan(entries, host, pinned, opts.prefetch)
    except LayerstreamError as e:
        why = {t.name: in_ram(t) for t in streamed}
        trainable = [t.name or "<root>" for t in streamed if file_backed(t) and "trainable" in why[t.name]]
        hint = (f" ({len(trainable)} layer(s) loaded from a file are trainable, e.g. '{trainable[0]}': for "
                f"inference, freeze the model (model.requires_grad_(False)) so they can stay in their file)"
                if trainable else "")
        cast = [t for t in streamed if file_backed(t) and "cast" in why[t.name]]
        if cast:
            w = cast[0].module.weight
            hint += (f" ({len(cast)} layer(s) loaded from a file are cast as read, e.g. '{cast[0].name}' from the "
                     f"file's {w.file_dtype} to the model's {w.dtype}, so they must be in RAM: build the model in "
                     f"the file's dtype so that frozen ones can stay in their file)")
        quantized = [t.name or "<root>" for t in streamed if why[t.name] == ["quantized"]]
        if quantized:
            hint += (f" ({len(quantized)} layer(s) are quantized, e.g. '{quantized[0]}', and quantized weights are "
                     f"held in RAM: pass cache_dir= so that those loaded by load_safetensors() can stay on disk, "
                     f"packed in a cache file)")
        lossless = [t.name or "<root>" for t in streamed if "lossless" in why[t.name]]
        if lossless:
            hint += (f" ({len(lossless)} layer(s) are quantized losslessly, e.g. '{lossless[0]}': lossless weights "
                     f"are coded in RAM and cannot stay on disk, with cache_dir= or without; for frozen ones loaded "
                     f"by load_safetensors() to stream from their file, quantize them otherwise (int8, fp8, nf4, "
                     f"int4, with cache_dir=) or not at all)")
        gguf = [t.name or "<root>" for t in streamed
                if isinstance(getattr(t.module, "weight", None), GgufWeight)]
        if gguf:
            hint += (f" ({len(gguf)} layer(s) were loaded by load_gguf(), e.g. '{gguf[0]}': GGUF weights are read "
                     f"into RAM; only .safetensors files loaded by load_safetensors() can keep weights on disk)")
        else:
            hint += _in_ram_hint(model, streamed, entries, why)
        raise LayerstreamError(f"offload(): {e}{hint}") from None
    opts.store_pinned_cap = p["store_pinned_cap"]
    opts.staging_bytes = p["staging_bytes"]
    opts.staging_pinned = p["staging_pinned"]
    opts.activation_host_cap = p["spare_host_bytes"]  # what the budgets leave for saved activations
    opts.activation_pinned_cap = p["spare_pinned_bytes"]
    opts.grad_staging_pinned_cap = p["grad_pinned_cap"]  # beyond it, the gradients' buffers are pageable
    names = {t.name for t, disk in zip(streamed, p["on_disk"]) if disk}
    _read_in_deferred(model, [t for t in deferred if t.name not in names])
    packed = _quant_cache(cache_dir, [t for t in deferred if t.name in names])
    summary = dict(p, host_budget=host, pinned_budget=pinned)
    if packed:
        summary["cache_files"] = sorted({r.path for r in packed.values()})
    return _HostTier(names, summary, packed)


# What stays in RAM by its kind, however the model was loaded (only a Linear's weights can
# stay in their file: core/host_tier.h in_ram_reasons), as the host budget's error says it.
_KIND_IN_RAM = {
    "group": ("tensor group(s)", " (modules whose own forward reads their tensors: transformers' Conv1D, "
                                 "attention, experts, groups=)"),
    "conv": ("convolution(s)", ""),
    "embedding": ("embedding table(s)", ""),
}


def _in_ram_hint(model: nn.Module, streamed: list, entries: list, why: dict) -> str:
    """The host budget's error, for weights neither in a file nor GGUF: which streamed
    layers are in RAM whatever loads them (no Linear: a tensor group, a convolution, a
    table; a Linear sharing its weight with another module), and which Linear layers
    hold weights a load put in memory (those could stay in their file). Before, it said
    that the model's weights were all in memory and to load it with load_safetensors(),
    also to a model load_safetensors() had loaded (GPT-2: Conv1D groups)."""
    holders: dict = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                holders[id(p)] = holders.get(id(p), 0) + 1
    by_kind: dict = {}
    tied, dense = [], []
    for t, (name, nbytes, from_file, _) in zip(streamed, entries):
        w = getattr(t.module, "weight", None)
        if from_file or isinstance(w, FileWeight):
            continue  # said by the message, or by the trainable / cast hints
        if "not_linear" in why[t.name]:
            by_kind.setdefault(t.kind, []).append((name, nbytes))
        elif isinstance(w, torch.Tensor) and holders.get(id(w), 0) > 1:
            tied.append(name)
        elif t.pre is None and not why[t.name]:  # loaded by load_safetensors(), it could stay in its file
            dense.append(name)
    parts = []
    if by_kind:
        total = sum(b for layers in by_kind.values() for _, b in layers)
        kinds = "; ".join(f"{len(layers)} {_KIND_IN_RAM[kind][0]}, e.g. '{layers[0][0]}'{_KIND_IN_RAM[kind][1]}"
                          for kind, layers in by_kind.items())
        parts.append(f"{sum(len(v) for v in by_kind.values())} streamed layer(s) are not Linear layers, so their "
                     f"{_C.format_bytes(total)} stay in RAM however the model is loaded: {kinds}")
    if tied:
        parts.append(f"{len(tied)} Linear layer(s) share their weight with another module (tied), which holds it "
                     f"in RAM, e.g. '{tied[0]}'")
    if dense:
        parts.append(f"{len(dense)} frozen Linear layer(s) have their weights in memory, e.g. '{dense[0]}': to keep "
                     f"them in their file, build the model on the meta device and load it with load_safetensors()")
    return "".join(f" ({part})" for part in parts)


def _read_in_deferred(model: nn.Module, layers: list) -> None:
    """Quantized weights step 1 left in their file (cache_dir=) that stay in RAM after
    all: read in, checked as step 1 checks them, before anything changes."""
    for t in layers:
        weight = _read_in(model, t.module.weight)
        if not bool(torch.isfinite(weight.detach()).all()):
            raise LayerstreamError(f"cannot quantize layer '{t.name or '<root>'}' to {t.fmt}: its weight has NaN "
                                   f"or Inf values; fix the checkpoint or do not quantize this layer "
                                   f"(quantize={{'{t.name}': None, ...}})")


def _quant_cache(cache_dir, layers: list) -> Dict[str, Any]:
    """The packed weights of quantized layers on disk, per layer name: their FileRange
    in the quantization cache file under `cache_dir` (one per format; built when
    missing or stale, core/io/quant_cache.h)."""
    by_format: Dict[str, list] = {}
    for t in layers:
        by_format.setdefault(t.fmt, []).append(t)
    out: Dict[str, Any] = {}
    for fmt, group in by_format.items():
        items = []
        for t in group:
            w = t.module.weight
            items.append((w.file_range, w.dtype, w.shape[0], w.numel() // max(w.shape[0], 1)))
        result = _C.quant_cache(os.fspath(cache_dir), fmt, items)
        out.update({t.name: r for t, r in zip(group, result["ranges"])})
    return out
