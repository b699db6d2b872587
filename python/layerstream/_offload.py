"""offload(): finds the layers, plans the budget, attaches them to one engine and
swaps their forwards; each step lives in the modules it calls.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.nn as nn

from . import _C
from ._discovery import (_check_no_meta, _check_no_self_overlap, _check_no_shared_storage, _discover, _group_slots,
                         _split_tied, _warn_unmatched, check_no_group_offloading, layerwise_casting, unmark_groups)
from ._forward import _GroupForward
from ._gguf_weight import GgufWeight
from . import _distributed, _peft_params
from ._activations import ActivationOffload, parse_activations
from ._attach import _attach
from ._handle import Handle
from ._packed import guard_peft_merges
from ._prequant import _CORE_DTYPES, _DEQUANT_DTYPES, _quant_for, _quantize_format
from ._host_plan import _host_tier, parse_bytes  # noqa: F401 (parse_bytes: re-exported)
from ._formats import _Candidate, _formats_and_bytes

LayerstreamError = _C.LayerstreamError


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
    host_budget: Union[None, int, str] = None,
    pinned_budget: Union[None, int, str] = None,
    cache_dir: Union[None, str, os.PathLike] = None,
    activations: Union[None, str, int] = None,
    process_group=None,
    share_host_store: Union[None, bool, str] = None,
    train: Union[None, bool, str, float] = None,
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
        memory ("40%", a float in (0, 1), or "auto": 60%; the sim device reports
        a fixed 16 GiB free, SIM_DEVICE_MEMORY); None = no bound.
        Must hold 2 slots of the largest layer. The planner
        first reserves the slots (``slots``, else prefetch + 1), then keeps as
        many layers resident as the rest holds; a budget too small for
        prefetch + 1 slots gets fewer (at least 2) and a prefetch depth of
        slots - 1.
    train: with a budget, what the trainable weights kept on the device take
        there beside themselves while they train, which the budget then covers
        too (the planner keeps fewer layers resident): None (default) counts
        the weights only; True or "grads" their gradients; "adamw" (or
        "adamw-fp32", the same), "adamw-bf16", "adamw-8bit", "adafactor" or
        "adafactor-beta1" their gradients and the states layerstream.optim
        keeps on the device (AdamW's state_precision; Adafactor without / with
        beta1); a number: the gradients plus that many bytes
        of optimizer state per parameter (8 for torch.optim.AdamW on float32
        weights, 4 on bfloat16). Streamed weights' gradients and states are on
        the host. handle.plan shows the bytes. docs/design/planner.md, "Training".
    prefetch: layers kept in flight ahead of use, 0 to 64; slots: device
        slots, 2 to 66 (default prefetch + 1, at least 2, capped by the budget). The rules
        for these and the sim link options are the C++ ones
        (csrc/core/options.h): bad values raise ValueError before anything
        changes. offload() inside torch.inference_mode() is refused (the
        tensors it makes could never be trained); run the model in it after.
    sim_link_gbps, sim_latency_us: the sim device's modelled link, each direction:
        a copy takes sim_latency_us microseconds plus its bytes at sim_link_gbps
        GB/s (10^9 bytes/s; 0: no link model, copies take no modelled time).
    checker: the sim device's ordering checker (handle.ordering_errors() lists
        the races it saw).
    pin_memory: host copies (the store, staging entries, gradient and saved-
        activation buffers) in pinned memory, within pinned_budget; False: all
        pageable (on CUDA slower copies, which block the thread that issues them).
    quantize: pack streamed weights on the host and dequantize them on the
        device: "int8", "fp8", "nf4", "int4" or "lossless" (entropy-coded,
        decoded bit for bit into the weight's own dtype) for every streamed
        layer (names as C++ reads them: any case, fp8 also "e4m3", "none" =
        None; layers whose shape the format cannot pack stay dense, with one warning), or a
        dict {glob pattern on module names: format or None} for per-layer
        choices (first match wins; an explicit format that cannot pack a layer
        is an error; a pattern that names no module is warned; one that gives a
        module inside a tensor group another format than the group's is an error).
        Weights that came quantized (load_gguf(), pre-quantized int8 / nf4) stream
        as stored: another format asked for them is warned, and an error when a
        dict names the layer without a wildcard.
        Quantized weights must be frozen (requires_grad False), except with
        "lossless": a trainable weight stays a dense parameter on the host
        (backward and the optimizer write it) and crosses the bus coded,
        re-coded before its next copy after it changed (host RAM: the weight
        plus its largest coded size; docs/design/quant-formats.md). Each quantized
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
        still use the original weight (a quantized weight's is the one
        dequantized to compute_dtype). None = cast at use, or the compute
        dtype of diffusers' layerwise casting when the streamed layers have
        its hooks (docs/design/torch-glue.md, "A wrapper that streams").
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
        layers whose forward reads weights directly: custom layers, ...): all
        the parameters of such a module and of its descendants share one slot, its own
        forward runs with them swapped for the fetched tensors, and when a gradient is
        needed it runs again in backward (with the same RNG state). Its forward must be
        a function of its inputs, parameters and the RNG (recomputed), read its
        parameters through the module attributes at call time (not through references
        cached earlier: nn.RNNBase modules are refused for that reason), read no
        parameter outside it, return no view of a parameter, write no parameter of its own
        in place (the forward runs on copies in a slot), and write no input in place when a
        gradient is needed (the recompute starts from the inputs; errors say so).
        exclude= naming such a module leaves it out of groups= (its Linear and conv
        layers stream one by one); exclude=["m", "m.*"] keeps all of it resident.
    cache_across_steps: keep weights in device slots and prefetch across step
        boundaries, detecting weight updates by the parameters' version
        counters. Faster for inference loops and small models. A
        torch.optim.Optimizer's step counts as a write of the streamed
        parameters it had gradients for, however it writes them, and a step
        that begins samples the host bytes for bulk writes through ``.data``
        (a LoRA merge); a write through ``.data`` to a few elements, or inside
        a step, is not detected: call ``handle.synchronize()`` after it, or
        leave this off.
    host_budget: a hard bound on the host RAM layerstream uses for streamed
        weights (its store and the staging entries): bytes ("48GiB", ...) or
        None. None: unbounded, except for a model with weights still in their
        file (load_safetensors()), where it is what this machine can give
        (MemAvailable minus 10% of RAM, at least 2 GiB; core/host_tier.h).
        When the streamed weights do not fit, the frozen ones loaded by
        load_safetensors() stay in their file and are read on every use,
        ahead of need, into staging entries that take the RAM left (kept by
        farthest next use); trainable weights must fit in RAM (an error says
        by how much they do not). docs/design/host-tier.md.
    pinned_budget: a cap on the pinned (page-locked) host bytes: None is
        unlimited on Linux and 40% of RAM under WSL, whose driver cannot pin
        much more (core/host_tier.h). Store tensors beyond it stay pageable and
        cross through pinned staging entries, so their copies stay overlapped.
    cache_dir: a directory for the quantization cache file: with quantize=,
        frozen Linear weights of load_safetensors() that the host budget sends
        to the disk tier are packed once into a .safetensors file there, and
        every step reads their packed bytes from it (fewer bytes than dense,
        no repacking in later runs). A cache whose sources, format, weights
        or version differ is rebuilt (core/io/quant_cache.h). None: quantized
        weights must fit in host RAM.
    activations: None (off), "host" or a size ("8GiB"): while the model's forward
        runs, the tensors autograd saves for backward (64 KiB and larger, dense, on
        the compute device; not parameters or the streamed weights) are copied to
        pinned host memory on the engine's device-to-host stream, overlapped with
        compute, and let go on the device (the forward waits when the copies in
        flight hold more than prefetch + 1 times the largest); backward gets each
        back on the transfer stream, the next ones (prefetch deep, in the order
        backward unpacks them) copied back ahead of need. A size keeps that many
        bytes of them on the device: the newest saved, which backward needs first.
        Their host buffers count against host_budget / pinned_budget.
        docs/design/activations.md.
    process_group: with several processes (torch.distributed, e.g. torchrun): the group
        over which streamed weights' gradients are averaged, as DistributedDataParallel
        averages the rest (all-reduce on the compute device before the copy to the host;
        suspended by handle.no_sync() or DDP's no_sync()). None: the world group when
        torch.distributed is initialized with several ranks; False: none; a group given
        is used even with one rank. Every rank must offload the same model with the same
        options (checked). Streamed parameters are put on DDP's ignore list (with
        or without a group), so DistributedDataParallel(model) needs no argument for them.
    share_host_store: the ranks of one machine keep one host copy of the frozen streamed
        weights (a memory file the first of them fills and the others map; freed by the
        kernel when the last rank exits, even after a crash), read-only after offload()
        (a write, which would reach every rank, is refused at the next call: peft's
        merge_adapter() on one rank needs False); trainable ones keep one copy
        per process (each rank's optimizer steps its own). None: shared when another rank
        of the group runs on this machine (True: the same); False: one copy per process;
        "all": trainable
        tensors shared too, each rank stepping its shard of every one with
        layerstream.optim.AdamW (any other write to them is refused).
        docs/design/distributed.md.
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
    asked_dequant = dequant_dtype
    opts, dequant_dtype, compute_dtype = _engine_options(
        device, prefetch, slots, sim_link_gbps, sim_latency_us, checker, pin_memory, cache_across_steps, trace,
        dequant_dtype, compute_dtype)
    quantize = _check_quantize(quantize)
    resolved = _C.resolve_device(opts.device)
    if opts.device == "auto" and resolved == "sim":  # device=None or "auto"
        _warn_sim_fallback()
    opts.device = resolved  # resolved here: the engine's own warning for "auto" (C++ callers) never sees it
    compute_device = torch.device("cpu") if resolved == "sim" else torch.device(resolved)

    if budget is not None:
        _C.parse_budget(budget)  # checked before anything changes
    train_spec = _train_spec(train, budget)
    activation_budget = None if activations is None else parse_activations(activations, parse_bytes)
    _check_loadable(model)
    candidates, grouped = _discover(model, include, exclude, groups, compute_device)
    try:  # refused before _attach (which undoes its own): the groups= marks go too (_discover's)
        if isinstance(quantize, dict):
            _warn_unmatched(model, stacklevel=3, quantize=list(quantize))
        if compute_dtype is None and (cast := _layerwise_compute_dtype(candidates, dequant_dtype)) is not None:
            dequant_dtype, compute_dtype = _set_dtypes(opts, dequant_dtype, cast)
        candidates, tie_groups = _split_tied(model, candidates, compute_device)
        _check_no_shared_storage(model, candidates)
        _check_no_self_overlap(candidates)

        tied_names = {n for g in tie_groups for n in g}
        # Embedding tables stay in host memory and are looked up there (no slot, no planner
        # entry, no quantization): only the rows a batch names cross the bus.
        order = {id(module): i for i, (_, module, _) in enumerate(candidates)}  # attached in model order
        tables = [_Candidate(name, module, kind, None, None, 0, 0, 0) for name, module, kind in candidates
                  if kind == "embedding"]
        candidates = [c for c in candidates if c[2] != "embedding"]
        if not candidates and not tables:
            raise LayerstreamError(
                "offload() found no Linear, Conv1d/2d/3d, Embedding, MultiheadAttention or mixture-of-experts "
                "layer to stream"
                + (" (check include/exclude)" if include is not None or exclude is not None else ""))

        # 1. Per layer: its format and its bytes on the bus, in a slot, resident.
        gguf = any(isinstance(p, GgufWeight) for p in model.parameters())
        layers = _formats_and_bytes(model, candidates, tables, quantize, tied_names, dequant_dtype, compute_dtype,
                                    defer_file_reads=cache_dir is not None, routed=experts == "routed")
        if asked_dequant is not None and not gguf and all(t.fmt in (None, "lossless") and t.pre is None
                                                          for t in layers):
            warnings.warn(f"layerstream: offload(dequant_dtype={asked_dequant}) does nothing here: no weight is "
                          f"dequantized (quantize={quantize!r} packs none with a loss, and none came quantized). "
                          f"It applies to quantize='int8', 'fp8', 'nf4' or 'int4' and to pre-quantized or GGUF "
                          f"weights; to cast dense weights for the activations, pass compute_dtype=",
                          RuntimeWarning, stacklevel=2)

        # 2. With a budget: which layers stay resident; the slots get what is left.
        # Layers quantize= does not apply to (tied to another's weight, pre-quantized or GGUF, or
        # not packable by the format asked for): "budget too small" then suggests no quantizing.
        as_stored = {t.name for t in layers if t.pre is not None or (t.kind != "group" and t.name in tied_names)
                     or (t.fmt is None and _quant_for(t.name, quantize) is not None)}
        plan, resident_names = _plan(model, layers, tables, budget, compute_device, opts, slots, tie_groups, train_spec,
                                     as_stored)

        # 3. Host RAM: which weights stay in their file, what is pinned (core/host_tier.h).
        on_disk = _host_tier(model, layers, tables, resident_names, host_budget, pinned_budget, opts, cache_dir)

        # 4. Several processes: agree, and share the host store within a node.
        if share_host_store not in (None, True, False, "all"):
            raise ValueError(f'share_host_store must be None, True, False or "all", got {share_host_store!r}')
        group = None
        pg = _distributed.resolve_group(process_group)
        if pg is not None:
            settings = dict(device=compute_device.type, budget=budget, prefetch=prefetch, slots=slots, include=include,
                            exclude=exclude, quantize=quantize, dequant_dtype=dequant_dtype, compute_dtype=compute_dtype,
                            experts=experts, groups=groups, host_budget=host_budget, pinned_budget=pinned_budget,
                            activations=activations, pin_memory=pin_memory, share_host_store=share_host_store,
                            train=train_spec)
            group = _distributed.Distributed(pg, model, layers + tables, settings, share_host_store)

        # 5. Attach them to one engine (undone on failure); the rest moves to the device.
        def finish(handle: Handle) -> None:  # inside _attach's undo: a failure here detaches too
            guard_peft_merges()
            handle._peft = _peft_params.install(model, {id(a.module): a.module.forward for a in handle._attached
                                                        if isinstance(a.module.__dict__.get("forward"), _GroupForward)})
            if activation_budget is not None:
                handle._activation_hooks = ActivationOffload(handle._engine, activation_budget).install(
                    model, [r() for r in handle._call_hook.entries])
                handle.activation_budget, handle._pin_memory = activation_budget, opts.pin_memory
            if plan is not None and not train_spec:
                _note_uncounted_training(model, handle)

        return _attach(model, opts, sorted(layers + tables, key=lambda t: order[id(t.module)]), resident_names,
                       plan, grouped, compute_device, experts == "routed", on_disk, group, finish)
    except BaseException:
        unmark_groups(model, grouped)
        raise


def _note_uncounted_training(model: nn.Module, handle: Handle) -> None:
    """Trainable parameters a budget kept on the device without train=: their gradients
    and optimizer states are beyond it, which layerstream.optim says once. The registry
    is C++'s (optim::note_uncounted_training, shared with the C++ offload()); detach()
    ends the note."""
    streamed = {id(p) for a in handle._attached for p in a.module.parameters()}
    handle._uncounted = _C.optim_note_uncounted(
        [p for p in model.parameters() if p.requires_grad and id(p) not in streamed])


@functools.lru_cache(maxsize=None)
def _warn_sim_fallback() -> None:
    """offload() without device= (or with device="auto") found no usable CUDA GPU: says
    why, once per process (a broken driver would otherwise give a slow CPU simulation
    without a word)."""
    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) is a CPU-only build"
    else:
        try:
            torch.cuda.init()
            why = ("torch sees a GPU, but this layerstream build has no CUDA support (built without the "
                   "CUDA toolkit)")
        except Exception as e:  # torch's own reason: no driver, no visible device, driver too old, ...
            why = f"torch.cuda is not available: {e}"
    warnings.warn(f"layerstream: offload() without device= (or device='auto') runs on the simulated device "
                  f"(weights stream through a modelled link on the CPU), because {why}. Pass device='sim' to "
                  f"choose it (and silence this), or fix CUDA and pass device='cuda'.", RuntimeWarning,
                  stacklevel=3)


def _engine_options(device, prefetch, slots, sim_link_gbps, sim_latency_us, checker, pin_memory,
                    cache_across_steps, trace, dequant_dtype, compute_dtype):
    """The engine's options (C++ EngineOptions), each checked by its rule in C++
    (core/options.h: the same for C++ and the command line; ValueError here), and
    the effective (dequant_dtype, compute_dtype) as torch dtypes."""
    opts = _C.EngineOptions()
    opts.device = "auto" if device is None else str(device)
    opts.prefetch = _C.check_prefetch(prefetch)
    opts.slots = 0 if slots is None else _C.check_slots(slots)
    opts.sim_h2d_gbps = opts.sim_d2h_gbps = _C.check_link_gbps(sim_link_gbps)
    opts.sim_latency_us = _C.check_latency_us(sim_latency_us)
    opts.checker = bool(checker)
    opts.pin_memory = bool(pin_memory)
    opts.cache_across_steps = bool(cache_across_steps)
    opts.trace = bool(trace)
    # budget_bytes stays -1 (none) unless a budget is given: set from the plan below.
    return (opts, *_set_dtypes(opts, dequant_dtype, compute_dtype))


def _set_dtypes(opts, dequant_dtype, compute_dtype):
    """Sets opts' dequant and compute dtypes (checked by C++'s rule, check_dtypes) and
    returns the effective ones as torch dtypes."""
    names = [_DEQUANT_DTYPES.get(dt, str(dt)) if dt is not None else "" for dt in (dequant_dtype, compute_dtype)]
    effective = _C.check_dtypes(*names)
    opts.dequant_dtype, opts.compute_dtype = names
    return tuple(_CORE_DTYPES[n] if n else None for n in effective)


def _layerwise_compute_dtype(candidates, dequant_dtype) -> Optional[torch.dtype]:
    """The compute dtype of diffusers' layerwise casting on the streamed layers
    (_discovery.layerwise_casting) when they all name the same one and nothing else
    decided it: offload()'s compute_dtype then, so their storage-dtype weights are
    cast once per copy, inside the slot, rather than at every use (the numbers are
    the same either way)."""
    found = {layerwise_casting(m) for _, m, kind in candidates if kind in ("linear", "conv")} - {None}
    if len(found) != 1:
        return None
    dtype = found.pop()
    return dtype if dtype in _DEQUANT_DTYPES and dequant_dtype in (None, dtype) else None


def _check_quantize(quantize):
    """quantize= names formats offload() can pack (ValueError otherwise). Returns it with
    each name as C++'s quant::parse_format reads it (_quantize_format: "INT8" is int8,
    "e4m3" fp8, "none" None)."""
    if isinstance(quantize, str):
        return _quantize_format(quantize)
    if isinstance(quantize, dict):
        bad = [v for v in quantize.values() if v is not None and not isinstance(v, str)]
        if bad:
            raise ValueError(f"quantize={{pattern: format}} takes a format name or None per pattern, got "
                             f"{bad[0]!r}; valid formats: {', '.join(_C.quant_formats())}")
        return {k: None if v is None else _quantize_format(v) for k, v in quantize.items()}
    return quantize


def _check_loadable(model: nn.Module) -> None:
    """Refusals before anything changes: meta tensors, trainable GGUF weights, diffusers'
    group offloading."""
    _check_no_meta(model)
    check_no_group_offloading(model)
    trainable_gguf = [n for n, p in model.named_parameters() if isinstance(p, GgufWeight) and p.requires_grad]
    if trainable_gguf:
        raise LayerstreamError(
            f"{len(trainable_gguf)} GGUF weight(s) require grad: {', '.join(trainable_gguf[:5])}"
            f"{', ...' if len(trainable_gguf) > 5 else ''}. load_gguf() keeps them as the file's packed blocks, "
            f"which are frozen (no gradient is computed for them); freeze them (requires_grad_(False)) and "
            f"train an adapter over them (LoRA), or load a dense checkpoint to train these weights.")


def _train_spec(train, budget) -> str:
    """offload(train=...) as core/optim/optim.h parse_train_spec's text, checked there."""
    if train is None or train is False or train == "none":
        return ""
    if budget is None:
        raise ValueError(f"train={train!r} sizes what the budget covers; it needs budget= too (without a "
                         "budget nothing is kept resident for it)")
    spec = "grads" if train is True else repr(float(train)) if isinstance(train, (int, float)) else str(train)
    _C.optim_train_bytes(spec, [1], 1)  # ValueError naming the choices, before anything changes
    return spec


def _train_bytes(spec: str, tensors) -> int:
    """Gradient and optimizer-state bytes of the trainable tensors among `tensors` (train=spec)."""
    return sum(_C.optim_train_bytes(spec, list(p.shape), p.element_size())
               for p in tensors if spec and p is not None and p.requires_grad)


def _plan(model: nn.Module, layers: List[_Candidate], tables: list, budget, compute_device: torch.device,
          opts, slots, tie_groups: list, train_spec: str = "", as_stored: frozenset = frozenset()):
    """Step 2: with a budget, the planner decides which layers stay resident; the
    slots get what is left (opts.budget_bytes). The budget covers every weight on
    the device (and with train=, the resident trainable weights' gradients and
    optimizer states). Returns (plan or None, resident layer names)."""
    plan = None
    resident_names = set()
    if budget is not None:
        budget_bytes = _resolve_budget(budget, compute_device)
        layer_ids = {id(t.module) for t in layers + tables}  # tables take no device memory
        fixed = fixed_train = 0
        counted = set()  # a tensor shared by two modules (tied weights) is on the device once
        for t in layers:  # a tensor group's tensors held by a child (an attention's out_proj)
            if t.kind == "group":
                counted.update(id(o._parameters[k]) for o, k, _ in _group_slots(t.module))
        for module in model.modules():
            if id(module) in layer_ids:
                continue
            for t in list(module._parameters.values()) + list(module._buffers.values()):
                if t is not None and not t.is_meta and id(t) not in counted:
                    counted.add(id(t))
                    fixed += t.numel() * t.element_size()
                    if isinstance(t, nn.Parameter):
                        fixed_train += _train_bytes(train_spec, [t])
        # Tied weights of streamed layers: placed together by the planner, the weight counted
        # once, in the first one's bytes (PlannerLayer::tied_layer); tables are not planned.
        index = {t.name: i for i, t in enumerate(layers)}
        leader = {}  # planned layer index -> the index of the first planned layer of its tie group
        for group in tie_groups:
            planned_group = [index[n] for n in group if n in index]
            leader.update({i: planned_group[0] for i in planned_group[1:]})
        # Slots first, residency with what is left (core/planner.h plan_slots_first).
        planned, ties = [], []
        for i, t in enumerate(layers):
            tensors = ([o._parameters[key] for o, key, _ in _group_slots(t.module)] if t.kind == "group"
                       else [t.module.weight, getattr(t.module, "bias", None)])
            trainable = any(p is not None and p.requires_grad for p in tensors)
            resident_bytes = t.resident_bytes
            if i in leader:  # its weight is in the first layer's resident, train and host bytes
                weight_bytes = tensors[0].numel() * tensors[0].element_size()
                resident_bytes -= weight_bytes
                ties.append((i, leader[i], _C.slot_layout([(weight_bytes, 0)])["bus_bytes"]))
                tensors = tensors[1:]
            planned.append((t.name, t.bus_bytes, t.slot_bytes, resident_bytes, 0.0, trainable, t.narrow_write,
                            _train_bytes(train_spec, tensors)))
        # The copy times: the sim device models its link; a GPU's is not known here.
        link = opts.sim_h2d_gbps * 1e9 if compute_device.type != "cuda" else 0.0
        # train=: a training step (streamed weights cross again in the backward, with their
        # gradients back), as the plan's copies per step and times count it.
        plan = _C.plan_slots_first(budget_bytes, planned, fixed, prefetch=opts.prefetch,
                                   slots=int(slots) if slots is not None else 0, link_bytes_per_s=link,
                                   training=bool(train_spec), fixed_train_bytes=fixed_train, ties=ties,
                                   as_stored=[i for i, t in enumerate(layers) if t.name in as_stored],
                                   stored_slots=[(i, t.stored_slot_bytes) for i, t in enumerate(layers)
                                                 if t.stored_slot_bytes])
        resident_names = set(plan["resident"])
        # Tied weights: a head kept resident keeps its tensor on the device, so the table
        # that shares it is resident too (it is on the device once, in the head's bytes).
        # The planner places the planned layers of a tie together, so what this adds are
        # tables (not planned): noted in the plan, which handle.plan and stats() report.
        plan["held_tables"] = {}
        for group in tie_groups:
            held_by = [n for n in group if n in plan["resident"]]
            if held_by:
                plan["held_tables"].update({n: held_by for n in group if n not in resident_names})
                resident_names.update(group)
        opts.budget_bytes = max(0, budget_bytes - plan["resident_bytes"] - plan["fixed_resident_bytes"]
                                - plan["train_bytes"])

    return plan, resident_names


def _resolve_budget(budget, compute_device: torch.device) -> int:
    """Bytes of a budget (core/options.h budget_bytes): a byte count, or a share of
    the device's free memory (the sim device reports its simulated capacity)."""
    free = torch.cuda.mem_get_info(compute_device)[0] if compute_device.type == "cuda" else SIM_DEVICE_MEMORY
    return _C.budget_bytes(budget, free)


# Capacity of the simulated device (what budget="auto" sees on "sim").
SIM_DEVICE_MEMORY = _C.SIM_DEVICE_MEMORY
