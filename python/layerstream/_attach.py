"""offload()'s step 5: attaching the planned layers to one engine (each layer's
module, forward and parameters, undone by detach()), the marks and hooks of the
attached model (_finish_attach), and the move of what stays resident to the compute
device (_move_resident, also compat's).
"""
from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from . import _C, _distributed
from ._calls import CallHooks, _AddedTensorsFollow
from ._discovery import _WHOLE_GROUPS, _conv_args, _group_slots, unmark_groups
from ._file_weight import FileWeight
from ._forward import _GroupForward, _OwnForward, _PlainCopy, _StreamedForward, _with_streamed_lookup
from ._formats import _group_experts, _materialize_gguf
from ._gguf_weight import GgufWeight
from ._guards import _HostMove, _RootApply, _StreamedApply, _requantize_on_load, install_subtree_checks
from ._handle import Handle, _Attached
from ._host_plan import _HostTier, _read_in
from ._interrupts import HeldSignals
from ._packed import _PackedWeight, install_refused_loads
from ._prequant import _CORE_DTYPES, BnbQuantStateKeys

LayerstreamError = _C.LayerstreamError


def _attach(model: nn.Module, opts, layers: list, resident_names: set, plan, grouped: list,
            compute_device: torch.device, routed: bool, on_disk: "_HostTier",
            group: "Optional[_distributed.Distributed]" = None, finish=None) -> Handle:
    """Step 5: attaches the streamed layers (in model order) to one engine, moves
    the rest to the compute device and calls `finish(handle)`. A failure part way
    (e.g. a weight the format cannot pack, host memory, Ctrl-C, a timeout's signal)
    undoes what was attached, as detach() does. Signals are held from the engine's
    first change: they land between layers and at the end, inside the undo (Note [A
    signal lands between steps])."""
    engine = _C.Engine(opts)
    attached: List[_Attached] = []
    streamed_params = set()
    handle = Handle(engine, attached, plan)
    handle._model = model
    handle.host_plan = on_disk.summary  # core/host_tier.h's plan, or None (no host budget)
    held = HeldSignals()
    try:
        held.hold()
        if group is not None:
            group.share_store(engine)
        dequant = _C.check_dtypes(opts.dequant_dtype, opts.compute_dtype)[0]
        quantized_resident = _attach_layers(model, engine, layers, resident_names, attached, streamed_params,
                                            compute_device, routed, on_disk, _CORE_DTYPES[dequant] if dequant else None,
                                            held)
        with held:  # the steps after the last layer; what came lands as it ends, inside the undo
            _warn_resident_rounding(quantized_resident)
            _finish_attach(model, engine, attached, streamed_params, handle, grouped, compute_device, group)
            if finish is not None:
                finish(handle)
            with torch.no_grad():  # last: nothing after it can fail, which would leave them changed
                for module, name, qn, o, k, rows, fmt, dq, values in quantized_resident:
                    o._parameters[k].copy_(values)
                    handle._resident_quant.add(module, name, qn, o, k, rows, fmt, dq)
            handle._resident_quant.arm()  # later writes into them are quantized too
    except BaseException:
        with held:  # the undo, whole
            unmark_groups(model, grouped)
            try:
                handle.detach()
            except Exception as undo_error:  # pragma: no cover - reported with the original error
                warnings.warn(f"layerstream: offload() failed and undoing it failed too: {undo_error}",
                              RuntimeWarning, stacklevel=3)
        raise
    return handle


def _warn_resident_rounding(quantized_resident: list) -> None:
    """A quantized layer kept resident holds its values in its weight's dtype (the parameter
    keeps it); with a dequant_dtype whose values that dtype cannot hold (float32 for bf16
    weights), they are rounded, while a streamed layer computes with the dequant_dtype
    ones: the budget changes the numbers (docs/design/planner.md, "Quantized layers kept
    resident"). Said once per offload()."""
    rounded = {}
    for _, name, _, o, k, _, _, dq, _ in quantized_resident:
        dtype = o._parameters[k].dtype
        if _C.resident_quantized_rounds(dtype, dq):
            rounded.setdefault(f"'{name or '<root>'}'", (dtype, dq))
    if rounded:
        dtype, dq = next(iter(rounded.values()))
        names = list(rounded)
        warnings.warn(f"layerstream: {len(names)} quantized layer(s) kept resident by the budget hold their quantized "
                      f"values in their weights' dtype ({dtype}), rounded from dequant_dtype={dq}, while streamed "
                      f"layers compute in {dq}: the budget changes the numbers. For the same numbers everywhere, pass "
                      f"a dequant_dtype the weights' dtype holds (dequant_dtype={dtype}), or a budget that streams "
                      f"them: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}", RuntimeWarning,
                      stacklevel=4)


class _NoSaveBeforeStep:
    """The model's state_dict() pre-hook: refused between an overlapped backward and its
    step(), whose streamed layers are a step ahead of the others (and not yet clipped):
    Note [No call between an overlapped backward and its step] (engine_grad_ready.cpp),
    which refuses calls of the model there too. Removed by detach()."""

    def __init__(self, engine):
        self._engine = engine

    def __call__(self, module, prefix, keep_vars):
        if self._engine.unsettled_step():
            raise LayerstreamError(
                "model.state_dict() between an overlapped backward (opt.overlap(handle)) and step(): the layers "
                "stepped during the backward are a step ahead of the others (and not yet clipped), a checkpoint "
                "no run holds. Call opt.step() first.")


def _finish_attach(model, engine, attached, streamed_params, handle, grouped, compute_device, group) -> None:
    """The rest of step 5, once every layer is attached: the modules' marks and hooks,
    the model's device and moves, the resident weights on the compute device, DDP."""
    handle._note_tied_tables()
    for a in attached:
        a.module._layerstream_handle = handle
        a.module.__dict__["__deepcopy__"] = _PlainCopy(a)  # a copy of one layer is a plain module
    streamed_modules = {id(m) for a in attached for m in [a.module] + a.owners}
    follow = _AddedTensorsFollow(model, handle, streamed_modules, streamed_params, compute_device)
    handle._call_hook = CallHooks(model, lambda: engine, streamed_params, streamed_modules, follow)
    handle._load_check = install_refused_loads(model)
    handle._save_check = model.register_state_dict_pre_hook(_NoSaveBeforeStep(engine))
    _no_fused_encoder_path(model, attached, handle._fused_off)
    _report_compute_device(model, streamed_params, compute_device, handle._device_reported)
    streamed_ids = {id(a.module) for a in attached}
    for name in grouped:  # a groups= module kept resident is an ordinary module again
        module = model.get_submodule(name)
        if id(module) not in streamed_ids:
            _WHOLE_GROUPS.discard(module)
    handle._subtree_checks = install_subtree_checks(
        model, [(a.name, [m._apply for m in [a.module] + a.owners]) for a in attached])
    if not isinstance(model.__dict__.get("_apply"), _StreamedApply):
        model._apply = _RootApply(model, [m._apply for a in attached for m in [a.module] + a.owners])
        handle._root = model
        if compute_device.type != "cpu":  # model.to("cpu") suspends (the sim device computes on the host)
            for kind in ("to", "cpu", "cuda"):
                if kind not in model.__dict__:
                    setattr(model, kind, _HostMove(kind, model, handle, compute_device))
                    handle._host_moves.append(kind)
    # Resident weights to the compute device (device memory can run out here; the
    # tensors already moved stay there, on the device the model was meant for).
    _move_resident(model, streamed_params, compute_device)
    # On DDP's ignore list in any case (a one-GPU torchrun job wraps the model too).
    streamed_names = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in streamed_params]
    _distributed.ignore_streamed_in_ddp(model, streamed_names)
    handle._ddp_model = model
    if group is not None:
        group.finish(engine, model, streamed_names)
        handle._set_group(group, model)


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
            undo.append((weakref.ref(m), m.activation_relu_or_gelu))
            m.activation_relu_or_gelu = 0


# (original class) -> its subclass whose `device` is the compute device (same name).
_DEVICE_CLASSES: Dict[type, type] = {}


def _compute_device_of(module: nn.Module) -> torch.device:
    return module.__dict__["_layerstream_device"]


def _report_compute_device(model: nn.Module, streamed_params: set, compute_device: torch.device,
                           undo: list) -> None:
    """transformers' and diffusers' models have a `device` property: their first
    parameter's device, which for a module with streamed layers is the host (a language
    model's embedding table comes first). Callers put inputs there: transformers'
    generate() moves every decode step's inputs to `model.device`, which the streamed
    lookup then refuses on a GPU. A module with such a property and streamed parameters
    below it reports the compute device instead: its class becomes a subclass (one per
    class, same name, as _with_streamed_lookup) whose `device` is that; detach() restores
    the class."""
    for m in model.modules():
        cls = type(m)
        if not isinstance(inspect.getattr_static(cls, "device", None), property) or \
                not any(id(p) in streamed_params for p in m.parameters()):
            continue
        if cls not in _DEVICE_CLASSES:
            _DEVICE_CLASSES[cls] = type(cls.__name__, (cls,), {
                "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                "_layerstream_reports_device_of": cls,
                "device": property(_compute_device_of, doc="layerstream: the compute device of the offloaded "
                                   "model (its streamed weights are in host memory)")})
        m.__dict__["_layerstream_device"] = compute_device
        m.__class__ = _DEVICE_CLASSES[cls]
        undo.append(weakref.ref(m))


def _attach_layers(model, engine, layers, resident_names, attached, streamed_params, compute_device,
                   routed: bool, on_disk: _HostTier, dequant_dtype: Optional[torch.dtype],
                   held: HeldSignals) -> list:
    """offload() step 5: hands each streamed layer to `engine` and swaps its forward,
    appending to `attached` / `streamed_params` as it goes (what offload() undoes on
    failure). A layer the plan keeps resident is read in; quantized, it gets the values
    it would stream with: returned as (parameter, values), for _attach to write last."""
    quantized_resident = []
    for layer in layers:
        _attach_one(model, engine, layer, resident_names, attached, streamed_params, compute_device, routed,
                    on_disk, dequant_dtype, quantized_resident)
        held.land()  # this layer is recorded in `attached` (Note [A signal lands between steps])
    return quantized_resident


def _attach_one(model, engine, layer, resident_names, attached, streamed_params, compute_device, routed: bool,
                on_disk: _HostTier, dequant_dtype, quantized_resident: list) -> None:
    """One layer of _attach_layers: read in and noted (quantized_resident) when the plan
    keeps it resident, else handed to the engine, recorded in `attached`, its forward swapped."""
    name, module, kind, fmt, pre, *_ = layer
    if name in resident_names:  # the planner counted it dense
        owners = dict.fromkeys(o for o, _, _ in _group_slots(module)) if kind == "group" else [module]
        # Streamed, a GGUF tensor crosses as its blocks whatever `fmt`: dequantized here, nothing more.
        packed = [] if fmt in (None, "lossless") or pre is not None else [
            (o, k, qn) for o, k, qn in (_group_slots(module) if kind == "group" else [(module, "weight", "weight")])
            if not isinstance(o._parameters[k], GgufWeight) and (kind != "group" or o._parameters[k].dim() >= 2)]
        for owner in owners:
            _materialize_gguf(owner)
            for p in list(owner._parameters.values()):
                _read_in(model, p)
        for o, k, qn in packed:  # the values it would stream with (the budget must not change the numbers)
            p = o._parameters[k]
            rows = p.numel() // p.shape[-1] if kind == "group" else p.shape[0]
            quantized_resident.append((module, name, qn, o, k, rows, fmt, dequant_dtype, _C.quantized_values(
                p.detach(), rows, p.numel() // max(rows, 1), fmt, dequant_dtype)))
        return
    if kind == "group":
        slots = _group_slots(module)
        params = [o._parameters[k] for o, k, _ in slots]
        devices = [str(params[0].device)]
        n_experts = _group_experts(module, routed)
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
            # A trainable lossless-coded tensor stays the parameter it is (dense on the
            # host, coded on the bus: Note [Trainable coded weights], engine_coded.cpp).
            a.packed_parts = [(qn, part, o, k) for part, ((o, k, qn), p) in enumerate(zip(slots, params))
                              if p.dim() >= 2 and (fmt is not None or gguf[part])
                              and not (fmt == "lossless" and p.requires_grad)]
            # What detach() gives them back in: their strides (the engine dequantizes them
            # contiguous; e.g. channels_last convs), rounded through dequant_dtype as the
            # group computes with them (and as one the budget keeps resident holds them).
            a.strides = {part: tuple(params[part].stride()) for _, part, _, _ in a.packed_parts if not gguf[part]}
            a.dequant = {part: dequant_dtype for _, part, _, _ in a.packed_parts
                         if dequant_dtype is not None and fmt not in (None, "lossless") and not gguf[part]}
            for qn, part, o, k in a.packed_parts:
                p = o._parameters[k]
                o._parameters[k] = _PackedWeight(tuple(p.shape), p.dtype, engine, index,
                                                 f"{name or '<root>'}.{qn}", part, fmt or "")
            a.hooks = _requantize_on_load(engine, index, module, a.packed_parts)
            params = [o._parameters[k] for o, k, _ in slots]
        module.forward = _GroupForward(engine, index, old_forward or module.forward, module, slots,
                                       name or "<root>", n_experts)
        a.forward = module.__dict__["forward"]  # what detach() undoes (_wrappers.forward_restore)
        # Each module that owns some of the tensors keeps them where they are on
        # model.to() (nn.MultiheadAttention: its out_proj too).
        for owner in dict.fromkeys(o for o, _, _ in slots):
            keys = [k for o, k, _ in slots if o is owner]
            qn = next(q for o, k, q in slots if o is owner)
            sub = qn[:-len(keys[0]) - 1] if owner is not module else ""
            full = ".".join(x for x in (name, sub) if x) or "<root>"
            owner._apply = _StreamedApply(owner, compute_device, full, keys)
            if owner is not module:
                a.add_owner(owner)
        for p in params:
            p._is_memory_managed = True
            streamed_params.add(id(p))
        return
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
    elif kind == "linear" and name in on_disk.names:
        # The disk tier: read from its file (or the quantization cache file) on every use
        # (the module keeps the FileWeights; their refusals say so until detach()).
        for t in (weight, bias):
            if isinstance(t, FileWeight):
                t._disk_tier = True
        index = engine.add_linear_on_disk(
            name or "<root>", torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
            on_disk.packed.get(name, weight.file_range),
            None if bias is None else torch.empty(bias.shape, dtype=bias.dtype, device="meta"),
            bias.file_range if isinstance(bias, FileWeight) else None, quantize=fmt or "")
    elif kind == "linear":
        # A weight still in its file is read straight into the host store (one copy)
        # and adopted there without another.
        weight = _read_in(model, weight, engine)
        bias = _read_in(model, bias, engine)
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
                  strides=tuple(weight.stride()))
    if fmt not in (None, "lossless") and dequant_dtype is not None:
        a.dequant = dequant_dtype  # detach() gives the values it computes with (_restored_weights)
    attached.append(a)
    if name in on_disk.names:
        pass  # the module keeps its FileWeights: nothing of it is in host memory to write
    elif (pre is None or pre.bnb_stats is not None or pre.gguf) and engine.layer_format(index):
        # The weight now lives packed on the host; the module keeps a
        # data-less (meta) parameter of the same shape and dtype so the
        # dense (or the bitsandbytes) copy is freed.
        shape = (pre.rows, pre.cols) if pre is not None else tuple(module.weight.shape)
        dtype = pre.dense_dtype if pre is not None else module.weight.dtype
        module.weight = _PackedWeight(shape, dtype, engine, index, name or "<root>",
                                      fmt=engine.layer_format(index))
        del weight
        if pre is not None and pre.bnb_stats is not None:  # its quant state's keys in state_dict()
            a.hooks = [*a.hooks, module.register_state_dict_post_hook(BnbQuantStateKeys(pre.bnb_stats))]
    if engine.layer_format(index) and name not in on_disk.names:
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
            engine, index, kind, _OwnForward(nn.Embedding.forward, module), module, name)
        module.__class__ = _with_streamed_lookup(type(module))
    else:
        module.forward = _StreamedForward(engine, index, kind, old_forward or module.forward,
                                          module, name)
        a.forward = module.__dict__["forward"]  # what detach() undoes (_wrappers.forward_restore)
    module._apply = _StreamedApply(module, compute_device, name or "<root>")
    for p in module.parameters(recurse=False):
        p._is_memory_managed = True
        streamed_params.add(id(p))

def _move_resident(model: nn.Module, streamed_params: set, device: Optional[torch.device],
                   dtype: Optional[torch.dtype] = None, non_blocking: bool = False) -> None:
    """Moves every non-streamed parameter and buffer to `device` (None: where it is)
    and, given a dtype, converts the floating-point ones to it, as nn.Module.to does."""
    def moved(t):
        to_dtype = dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else t.dtype
        to_device = t.device if device is None else torch.device(device)
        if t.dtype == to_dtype:
            return None if t.device == to_device else t.to(to_device, non_blocking=non_blocking)
        return t.to(to_device, to_dtype, non_blocking=non_blocking)

    with torch.no_grad():
        for module in model.modules():
            for pname, p in module._parameters.items():
                if p is None or id(p) in streamed_params:
                    continue
                new = moved(p.data)
                if new is not None:
                    p.data = new
            for bname, b in module._buffers.items():
                if b is not None:
                    new = moved(b)
                    if new is not None:
                        module._buffers[bname] = new
