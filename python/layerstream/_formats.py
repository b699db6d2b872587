"""offload() step 1: per streamable layer, the quantization format (or
pre-quantized weight) and the bytes it takes on the bus, in a slot and resident
(core/slot_layout.h through _C.slot_layout); the refusals and warnings about
formats, before any module changes. GGUF weights of layers that do not stream are
made dense here."""
from __future__ import annotations

import fnmatch
import warnings
from typing import Any, List, NamedTuple, Optional

import torch
import torch.nn as nn

from . import _C
from ._discovery import _WHOLE_GROUPS, _group_slots, group_why, inside_groups
from ._file_weight import FileWeight
from ._gguf_weight import GgufWeight
from ._host_plan import _read_in
from ._prequant import _prequantized, _quant_for

LayerstreamError = _C.LayerstreamError


class _Candidate(NamedTuple):
    """A layer offload() may stream, with its bytes as the engine lays them out
    (core/slot_layout.h through _C.slot_layout)."""
    name: str
    module: nn.Module
    kind: str            # "linear", "conv", "embedding" or "group"
    fmt: Optional[str]   # quantization format offload() packs it in (None: as it is)
    pre: Any             # pre-quantized weight (_prequant), or None
    bus_bytes: int       # bytes that cross the bus per fetch
    slot_bytes: int      # bytes in a slot (bus + workspace)
    resident_bytes: int  # bytes on the device when kept resident
    host_bytes: Optional[int] = None  # bytes in the host store when not bus_bytes (a trainable coded weight)
    # What the device writes into the slot is 2 bytes per element already, or cannot be
    # narrower (lossless: its own dtype): a "budget too small" error suggests no narrower
    # dequant_dtype / compute_dtype (core/planner.h, PlannerLayer::narrow_write).
    narrow_write: bool = False
    # Quantized or cast on the device: its slot streamed as stored (the "too small" error
    # says when that is smaller: PlannerLayer::stored_slot_bytes); 0: not quantized or cast.
    stored_slot_bytes: int = 0


def _group_experts(module: nn.Module, routed: bool) -> int:
    """The experts a tensor group is indexed by (add_group's `experts`): a mixture-of-experts
    module's num_experts when calls may fetch some experts only, else 0."""
    n = getattr(module, "num_experts", 0) if routed else 0
    return n if isinstance(n, int) and n > 1 else 0


def _formats_and_bytes(model: nn.Module, candidates: list, tables: list, quantize, tied_names: set,
                       dequant_dtype, compute_dtype, defer_file_reads: bool = False,
                       routed: bool = True) -> List[_Candidate]:
    """Step 1: per layer, the quantization format (or pre-quantized weight) and the
    bytes it takes on the bus, in a slot (core/slot_layout.h) and resident. A
    quantized layer's slot holds the packed weight and, after it, the weight
    dequantized on the device (in its dense dtype). Refuses or warns before any
    module changes. With `defer_file_reads` (cache_dir=), a frozen Linear weight
    still in its file that is to be quantized stays there: step 3 packs it into
    the cache file or reads it in (_read_in_deferred)."""
    _check_quantize_inside_groups(candidates, quantize)
    _warn_quantize_matching_no_layer(model, candidates, tables, quantize)
    _dequantize_tied_gguf(model)
    layers: List[_Candidate] = []
    unpackable, trainable, tied_dense, as_stored = [], [], [], []
    coded_trainable = [0, 0, 0]  # lossless weights that require grad: count, host bytes, host bytes if frozen
    for name, module, kind in candidates:
        if kind == "group":
            # One slot holds every tensor; with a format, each tensor of 2+ dimensions
            # crosses packed (as a matrix of its last dimension's columns) and is
            # dequantized into the slot's workspace after the copy.
            # GGUF tensors (load_gguf) cross as the file's blocks whatever the format.
            fmt = _quant_for(name, quantize)
            for o, k, _ in _group_slots(module):
                _read_in(model, o._parameters[k])
            params = [o._parameters[k] for o, k, _ in _group_slots(module)]
            packed = [p for p in params if p.dim() >= 2 and not isinstance(p, GgufWeight)]
            gguf = sorted({p.gguf_format for p in params if isinstance(p, GgufWeight)})
            if fmt is not None and gguf:
                _as_stored(as_stored, name, quantize, f"its GGUF {'/'.join(gguf)} tensors", some_packed=bool(packed))
            if fmt is not None:
                reasons = [_C.quant_check(fmt, p.numel() // p.shape[-1], p.shape[-1], p.dtype) for p in packed]
                if fmt == "lossless" and not all(p.is_contiguous() for p in packed if p.requires_grad):
                    reasons.append("a tensor that requires grad is not contiguous (a lossless-coded trainable "
                                   "tensor is coded from its dense bytes in order)")
                reason = next((r for r in reasons if r), "")
                if reason and isinstance(quantize, str):
                    unpackable.append(f"{name} ({reason})")
                    fmt = None
                elif reason:
                    raise LayerstreamError(f"cannot quantize layer '{name}' to {fmt}: {reason}")
            if fmt not in (None, "lossless") and any(p.requires_grad for p in packed):
                trainable.append(name or "<root>")
            elif fmt not in (None, "lossless") and not all(bool(torch.isfinite(p.detach()).all()) for p in packed):
                raise LayerstreamError(f"cannot quantize layer '{name or '<root>'}' to {fmt}: a tensor has "
                                       f"NaN or Inf values; fix the checkpoint or do not quantize this layer "
                                       f"(quantize={{'{name}': None, ...}})")
            parts = []  # (bus, written) per tensor, as the engine lays them out in a slot
            slot_parts = []  # the same with a trainable coded tensor's largest coding, as its slot part is
            host = []  # per tensor, its bytes in the host store
            coded_dense = coded_frozen = 0  # trainable coded tensors: host bytes; host bytes if frozen
            for p in params:
                if isinstance(p, GgufWeight):
                    parts.append((p.gguf_bytes.numel(), p.numel() * (dequant_dtype or p.dtype).itemsize))
                elif fmt == "lossless" and p.dim() >= 2:  # coded per expert when routed; its own dtype
                    n_experts = _group_experts(module, routed)
                    coded = _C.lossless_group_part_bytes(p.detach().contiguous(), n_experts)
                    parts.append((coded, p.numel() * p.element_size()))
                    if p.requires_grad:  # dense in the store, re-coded (Note [Trainable coded weights])
                        cap = _C.lossless_max_bytes(p.detach(), n_experts)
                        slot_parts.append((cap, parts[-1][1]))
                        host.append(p.numel() * p.element_size() + cap)
                        coded_dense, coded_frozen = coded_dense + host[-1], coded_frozen + coded
                        continue
                elif fmt is not None and p.dim() >= 2:
                    parts.append((_C.quant_packed_bytes(fmt, p.numel() // p.shape[-1], p.shape[-1]),
                                  p.numel() * (dequant_dtype or p.dtype).itemsize))
                else:
                    parts.append((p.numel() * p.element_size(), 0))
                slot_parts.append(parts[-1])
                host.append(parts[-1][0])
            if coded_dense:
                coded_trainable = [coded_trainable[0] + 1, coded_trainable[1] + coded_dense,
                                   coded_trainable[2] + coded_frozen]
            layout = _C.slot_layout(parts)
            layers.append(_Candidate(name, module, kind, fmt, None, layout["bus_bytes"],
                                     _C.slot_layout(slot_parts)["slot_bytes"],
                                     sum(p.numel() * p.element_size() for p in params),
                                     sum(host) if coded_dense else None,
                                     narrow_write=all(((None if fmt == "lossless" else dequant_dtype) or p.dtype)
                                                      .itemsize <= 2 for p in params)))
            continue
        weight, bias = module.weight, module.bias
        pre = _prequantized(name, module)
        if pre is not None and pre.library is not None:
            raise LayerstreamError(
                f"layer '{name or '<root>'}': its weight is a {type(weight).__module__.split('.')[0]} "
                f"{type(weight).__name__}; offload() does not stream optimum-quanto / torchao weights: "
                f"use layerstream.compat.MemoryManager.attach(model, device), which streams them "
                f"packed, or dequantize the model, or keep these layers resident "
                f"(offload(exclude=[...]))")
        if pre is not None and kind != "linear":
            raise LayerstreamError(f"layer '{name}': pre-quantized weights are supported for "
                                   f"Linear layers only")
        fmt = _quant_for(name, quantize)
        if pre is not None:  # streamed as it came, packed
            if fmt is not None and (pre.gguf or fmt != pre.format):
                _as_stored(as_stored, name, quantize,
                           f"GGUF {pre.format} blocks" if pre.gguf else f"pre-quantized {pre.format}")
            fmt = None
        if fmt is not None and name in tied_names:
            tied_dense.append(f"'{name or '<root>'}'")  # one host copy, read dense by every user
            fmt = None
        deferred = (defer_file_reads and fmt not in (None, "lossless") and kind == "linear"
                    and isinstance(weight, FileWeight) and not weight.requires_grad)
        if (fmt is not None or kind != "linear") and not deferred:  # packed here from its values; or not a Linear
            _read_in(model, weight)
            weight = module.weight
        if pre is not None:
            rows, cols = pre.rows, pre.cols
        else:
            rows = weight.shape[0]
            cols = weight.numel() // max(rows, 1)
        if fmt is not None:  # first: a weight the format cannot pack (e.g. float8) is not read for it
            reason = _C.quant_check(fmt, rows, cols, weight.dtype)
            if reason:
                if isinstance(quantize, str):
                    unpackable.append(f"{name} ({reason})")
                    fmt = None
                else:
                    raise LayerstreamError(f"cannot quantize layer '{name}' to {fmt}: {reason}")
        if fmt not in (None, "lossless") and weight.requires_grad:  # lossless: dense on the host, coded on the bus
            trainable.append(name or "<root>")
        elif fmt not in (None, "lossless") and not deferred and not bool(torch.isfinite(weight.detach()).all()):
            # Checked before anything changes: the packer refuses it, and undoing the layers
            # quantized before this one could only restore their dequantized values.
            raise LayerstreamError(f"cannot quantize layer '{name or '<root>'}' to {fmt}: its weight "
                                   f"has NaN or Inf values; fix the checkpoint or do not quantize "
                                   f"this layer (quantize={{'{name}': None, ...}})")
        dense_dtype = pre.dense_dtype if pre is not None else weight.dtype
        dense_w = rows * cols * dense_dtype.itemsize
        b_bytes = 0 if bias is None else bias.numel() * bias.element_size()
        host_bytes = None  # what the host store holds: the bus bytes unless said here
        narrow = True
        if fmt == "lossless":  # its coded size depends on its values; decoded into its own dtype
            w_bytes = _C.lossless_coded_bytes(weight.detach().contiguous())
            w_written = dense_w
            if weight.requires_grad:  # dense in the store; coded copy and slot part at their largest size
                w_cap = _C.lossless_max_bytes(weight.detach().contiguous())
                host_bytes = dense_w + w_cap + b_bytes
                coded_trainable = [coded_trainable[0] + 1, coded_trainable[1] + host_bytes,
                                   coded_trainable[2] + w_bytes + b_bytes]
        elif pre is not None or fmt is not None:
            w_bytes = _C.quant_packed_bytes(pre.format if pre is not None else fmt, rows, cols)
            w_written = dense_w if dequant_dtype is None else rows * cols * dequant_dtype.itemsize
            narrow = (dequant_dtype or dense_dtype).itemsize <= 2
        else:
            w_bytes = dense_w
            cast_w = compute_dtype is not None and dense_dtype != compute_dtype
            w_written = rows * cols * compute_dtype.itemsize if cast_w else 0
            narrow = not cast_w or compute_dtype.itemsize <= 2
        parts = [(w_bytes, w_written)]
        if bias is not None:
            # A bias cast to compute_dtype follows the device weight in the workspace.
            cast_b = compute_dtype is not None and bias.dtype != compute_dtype
            parts.append((b_bytes, bias.numel() * compute_dtype.itemsize if cast_b else 0))
        layout = _C.slot_layout(parts)
        bus = layout["bus_bytes"]
        if host_bytes is not None:  # Note [Trainable coded weights] (engine_coded.cpp)
            layout = _C.slot_layout([(w_cap, w_written)] + parts[1:])
        stored = (_C.slot_layout([(dense_w, 0)] + [(b, 0) for b, _ in parts[1:]])["slot_bytes"]
                  if pre is None and any(written for _, written in parts) else 0)
        layers.append(_Candidate(name, module, kind, fmt, pre, bus, layout["slot_bytes"],
                                 dense_w + b_bytes, host_bytes, narrow, stored))
    # GGUF weights (load_gguf) of layers that stream neither as Linear layers nor in a tensor
    # group (excluded, a subclass with its own forward, ...) stay resident: dense, dequantized
    # here so that the planner counts them (not undone if offload() fails: the values are the same).
    linear_ids = {id(t.module) for t in layers if t.kind == "linear"}
    in_groups = {id(o._parameters[k]) for t in layers if t.kind == "group" for o, k, _ in _group_slots(t.module)}
    for module in model.modules():
        if id(module) not in linear_ids:
            _materialize_gguf(module, keep=in_groups)
            for p in list(module._parameters.values()):
                _read_in(model, p)
    if isinstance(quantize, dict):
        # A table named explicitly (no wildcard) for a format: tables are never quantized.
        named = [f"'{name}'" for name, *_ in tables
                 if any(not any(c in pattern for c in "*?[") and fnmatch.fnmatchcase(name, pattern) and fmt
                        for pattern, fmt in quantize.items())]
        if named:
            warnings.warn(f"layerstream: quantize= names embedding table(s) {', '.join(named)}, but tables "
                          f"are not quantized: they are looked up in host memory as they are (only the "
                          f"rows a batch names cross the bus)", RuntimeWarning, stacklevel=3)
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
                      + ", ".join(tied_dense), RuntimeWarning, stacklevel=3)
    if as_stored:
        warnings.warn(f"layerstream: quantize={quantize!r} does not apply to {len(as_stored)} layer(s) whose "
                      f"weights came quantized (load_gguf(), or a pre-quantized weight): they stream as stored: "
                      + ", ".join(as_stored), RuntimeWarning, stacklevel=3)
    if unpackable:
        warnings.warn(f"layerstream: quantize={quantize!r} cannot pack {len(unpackable)} layer(s); "
                      f"they stream unquantized: " + "; ".join(unpackable), RuntimeWarning,
                      stacklevel=3)
    if coded_trainable[0]:
        # Said once: a model that only runs (inference) rarely means to pay this.
        n, held, frozen = coded_trainable
        warnings.warn(f"layerstream: quantize={quantize!r}: {n} lossless layer(s) require grad, so each keeps "
                      f"its dense weight on the host next to its coded copy (re-coded after each change): "
                      f"{_C.format_bytes(held)} of host memory where frozen weights would take "
                      f"{_C.format_bytes(frozen)}. Expected for full fine-tuning; to only run the model, "
                      f"freeze it first (model.requires_grad_(False))", RuntimeWarning, stacklevel=3)

    return layers


def _as_stored(as_stored: list, name: str, quantize, what: str, some_packed: bool = False) -> None:
    """A layer whose weights came quantized (`what`: "GGUF q4_k blocks", ...) that quantize=
    gives a format: they stream as stored, so the format does not apply (it was ignored
    without a word). Listed for a warning; an error when a quantize= dict names the layer
    itself (no wildcard) and the format packs none of its tensors."""
    pattern = next((p for p in quantize if fnmatch.fnmatchcase(name, p)), None) if isinstance(quantize, dict) else None
    if pattern is not None and not any(c in pattern for c in "*?[") and not some_packed:
        raise LayerstreamError(
            f"quantize={{{pattern!r}: {quantize[pattern]!r}, ...}} names layer '{name or '<root>'}', whose "
            f"weights came quantized ({what}): they stream as stored, and no other format applies to them. "
            f"Leave the layer out of quantize= (or give it None); to use {quantize[pattern]!r}, make its weights "
            f"dense first (a GgufWeight: module.weight = torch.nn.Parameter(module.weight.dequantized(), "
            f"requires_grad=False))")
    as_stored.append(f"'{name or '<root>'}' ({what})")


def _warn_quantize_matching_no_layer(model: nn.Module, candidates: list, tables: list, quantize) -> None:
    """A quantize={pattern: format} pattern that names modules but no streamed layer (only
    ones exclude= or include= left out, or modules that are not layers) quantizes nothing:
    said, as a pattern naming no module is (_discovery._warn_unmatched, which warns of
    those)."""
    if not isinstance(quantize, dict):
        return
    layers = [n for n, _, _ in candidates] + [t.name for t in tables] + [n for _, n, _ in inside_groups(candidates)]
    modules = [n for n, _ in model.named_modules()]
    idle = [p for p, fmt in quantize.items() if fmt is not None and any(fnmatch.fnmatchcase(n, p) for n in modules)
            and not any(fnmatch.fnmatchcase(n, p) for n in layers)]
    if idle:
        warnings.warn(f"layerstream: offload(quantize=...): {', '.join(repr(p) for p in idle)} "
                      f"match{'es' if len(idle) == 1 else ''} only modules offload() does not stream (left out "
                      f"by include=/exclude=, or containers: a pattern must name the layers inside them), so "
                      f"nothing is quantized by {'it' if len(idle) == 1 else 'them'}", RuntimeWarning, stacklevel=4)


def _check_quantize_inside_groups(candidates: list, quantize) -> None:
    """quantize={pattern: format} giving a module inside a streamed tensor group another
    format than the group's own name gets was silently ignored (the group's tensors are
    packed together, in the group's format): refused, naming the group and what to write."""
    if not isinstance(quantize, dict):
        return
    for group, name, _ in inside_groups(candidates):
        pattern = next((p for p in quantize if fnmatch.fnmatchcase(name, p)), None)
        # A pattern that matches the group too (a "*" default) chose for the group.
        if pattern is None or fnmatch.fnmatchcase(group, pattern):
            continue
        fmt, group_fmt = quantize[pattern], _quant_for(group, quantize)
        if fmt == group_fmt:
            continue
        module = next(m for n, m, _ in candidates if n == group)
        why, other = group_why(group, module)
        for _, m, _ in candidates:  # nothing changed: offload() never gets to undo these
            _WHOLE_GROUPS.discard(m)
        raise LayerstreamError(
            f"quantize={{{pattern!r}: {fmt!r}, ...}} names '{name}', which streams inside tensor group "
            f"'{group or '<root>'}' ({why}): the group's tensors are packed together, in the format its "
            f"own name gets ({group_fmt!r}). Choose it by the group's name: quantize={{{group!r}: {fmt!r}, "
            f"...}} (before the patterns that match it){'; or ' + other if other else ''}")


def _dequantize_tied_gguf(model: nn.Module) -> None:
    """GGUF weights (load_gguf) that several modules hold (tied, e.g. a head tied to its
    embedding table) become one dense, dequantized parameter in every place that holds
    them, before anything else looks at them: offload() streams a tied weight from one
    dense host copy (no format applies to it, as with quantize=), and a parameter per
    holder (_materialize_gguf, or the engine's copy per streamed layer) would untie them."""
    holders = {}  # id of a GgufWeight -> (it, its qualified names, {(id(module), key): module})
    for mname, m in model.named_modules(remove_duplicate=False):
        for k, p in m._parameters.items():
            if isinstance(p, GgufWeight):
                entry = holders.setdefault(id(p), (p, [], {}))
                entry[1].append(f"{mname}.{k}" if mname else k)
                entry[2][(id(m), k)] = m
    tied = [(p, names, places) for p, names, places in holders.values() if len(places) > 1]
    for p, _, places in tied:
        dense = nn.Parameter(p.dequantized(), requires_grad=False)
        for (_, k), m in places.items():
            m._parameters[k] = dense
    if tied:
        warnings.warn(f"layerstream: {len(tied)} GGUF weight(s) are tied (held by several modules), so they are "
                      f"dequantized once for all of them and stream dense: "
                      + "; ".join(" = ".join(names) for _, names, _ in tied), RuntimeWarning, stacklevel=4)


def _materialize_gguf(module: nn.Module, keep=frozenset()) -> None:
    """Replaces the module's own GGUF weights (load_gguf) by dense, dequantized
    parameters (frozen), for a module that does not stream them (but not those
    whose id is in `keep`: a streamed tensor group's). Tied ones are dense already
    (_dequantize_tied_gguf)."""
    for k, p in list(module._parameters.items()):
        if isinstance(p, GgufWeight) and id(p) not in keep:
            module._parameters[k] = nn.Parameter(p.dequantized(), requires_grad=False)
