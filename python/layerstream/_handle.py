"""Handle: what offload() returns (statistics, plan, trace, synchronize, detach).
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
import weakref
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from . import _C
from ._discovery import _WHOLE_GROUPS
from ._file_weight import FileWeight
from ._forward import _RefusesCopy
from ._guards import ResidentQuantized, _HostMove, _RootApply, remove_subtree_checks
from ._interrupts import HeldSignals
from ._wrappers import forward_restore, put_forward_back

LayerstreamError = _C.LayerstreamError


# Note [Nothing offload() puts on a model refers back to it]
# A model is freed by reference counting when its last reference goes (del model), as a
# resident one is: its engine with it (the engine's threads end, its host store, gradient
# staging and device slots are freed). A reference cycle through the model would keep all
# of that until Python's cyclic garbage collector happened to run (a sweep over models
# kept each one's 4 threads and host copy; on a GPU, its slots), so the references run one
# way: the model and its modules hold what offload() installed on them (forwards, _apply,
# to_empty, hooks, the handle in the layers' _layerstream_handle, and through those the
# engine), and nothing of that holds a module strongly: the installed objects, the handle
# and its records (_Attached) reach the modules through weak references. So a model kept
# keeps its handle and engine (offload(model) on its own line streams on), and a handle
# kept while the model is dropped keeps the engine (its stats()), not the model; its
# detach() then restores what is left (the engine lets go of its weights).
class _Attached:
    """What offload() changed on one module, to undo it in detach(). The modules weakly
    (Note [Nothing offload() puts on a model refers back to it])."""

    __slots__ = ("name", "_module", "kind", "index", "had_forward", "old_forward", "devices",
                 "prequantized", "bnb_stats", "hooks", "strides", "_packed_parts", "_owners", "forward", "dequant")

    def __init__(self, name, module, kind, index, had_forward, old_forward, devices,
                 prequantized=False, bnb_stats=None, hooks=(), strides=None):
        self.name, self.kind, self.index = name, kind, index
        self._module = weakref.ref(module)
        self.had_forward, self.old_forward, self.devices = had_forward, old_forward, devices
        self.prequantized = prequantized
        self.bnb_stats = bnb_stats
        self.hooks = list(hooks)
        # The weight's strides at offload(): detach() restores a weight that offload()
        # quantized in that layout (channels_last, also a 1x1 conv's, whose strides
        # differ from the contiguous ones only in size-1 dims).
        self.strides = strides
        # A tensor group quantized by offload(): (parameter name, part, owner module, key)
        # of its packed tensors (the name relative to the module: "out_proj.weight").
        self._packed_parts = []
        # Other modules that own some of a tensor group's parameters (an attention's
        # out_proj): they got a _StreamedApply too (add_owner).
        self._owners = []
        # The forward offload() installed on the module (_StreamedForward, _GroupForward);
        # None until then, and for an embedding subclass (its class is swapped instead).
        self.forward = None
        # Quantized by offload() with a dequant_dtype: the dtype the layer computes with
        # (a tensor group: part -> it); detach() gives those values (_restored_weights).
        self.dequant = None

    @property
    def module(self) -> Optional[nn.Module]:
        """The module (None once it was freed)."""
        return self._module()

    @property
    def owners(self) -> List[nn.Module]:
        return [o for o in (r() for r in self._owners) if o is not None]

    def add_owner(self, owner: nn.Module) -> None:
        self._owners.append(weakref.ref(owner))

    @property
    def packed_parts(self) -> list:
        return [(qn, part, o(), k) for qn, part, o, k in self._packed_parts]

    @packed_parts.setter
    def packed_parts(self, parts: list) -> None:
        self._packed_parts = [(qn, part, weakref.ref(o), k) for qn, part, o, k in parts]


def _as_computed(w: torch.Tensor, dequant: Optional[torch.dtype], strides: Optional[tuple]) -> torch.Tensor:
    """A weight the engine dequantized on the host (in its own dtype, contiguous) as the
    layer computed with it: rounded through the dequant_dtype its slot held (so detach()
    gives what a layer the budget kept resident holds: the budget does not change the
    numbers), in the strides it had before offload() (e.g. channels_last)."""
    if dequant is not None and dequant != w.dtype:
        w = w.to(dequant).to(w.dtype)
    if strides is not None:
        w = torch.empty_strided(w.shape, strides, dtype=w.dtype).copy_(w)
    return w


def _weakly(key: str) -> property:
    """A Handle attribute that holds a module weakly (Handle._ref)."""
    return property(lambda self: self._ref(key), lambda self, module: self._set_ref(key, module))


class Handle(_RefusesCopy):
    """The result of offload(): statistics, synchronisation and detach."""

    def __init__(self, engine, attached: List[_Attached], plan: Optional[dict]):
        self._engine = engine
        self._attached = attached
        self._plan = plan  # the planner's decision when offload() had a budget
        self._tied_tables = {}  # a table's layer index -> the streamed layers sharing its weight (_note_tied_tables)
        # The modules weakly (Note [Nothing offload() puts on a model refers back to it]):
        # _root, _model, _group_model and _ddp_model are properties over these.
        self._refs = {}
        self._root = None  # the model, when offload() installed a _RootApply on it
        self._load_check = None  # the model's load_state_dict() pre-hook (_packed.RefusedLoads)
        self._save_check = None  # its state_dict() pre-hook (_attach._NoSaveBeforeStep)
        self._subtree_checks = []  # modules between it and the streamed ones (guards.install_subtree_checks)
        # (weak reference to the module, value) of the nn.TransformerEncoderLayer whose fused
        # inference path offload() turned off (_no_fused_encoder_path), to restore in detach().
        self._fused_off = []
        # Weak references to the modules whose class offload() swapped so that their `device`
        # property reports the compute device (_report_compute_device), to restore in detach().
        self._device_reported = []
        # core/host_tier.h's plan (store, disk and staging bytes, budgets) when offload()
        # had a host or pinned budget, or weights still in their file; else None.
        self.host_plan: Optional[dict] = None
        # offload(activations=...): the device budget of saved activations (0: all
        # that can go to the host), None when off; the hooks detach() removes.
        self.activation_budget: Optional[int] = None
        self._pin_memory = True  # offload(pin_memory=...)
        self._activation_hooks = []
        self._resident_quant = ResidentQuantized()  # offload(quantize=...)'s layers kept resident
        # peft wrappers patched over streamed groups and the hooks that patch later ones
        # (_peft_params.Installed), removed by detach(); None without any.
        self._peft = None
        # A budget that did not count training (offload() without train=): the note
        # layerstream.optim reads, ended by detach() (_offload._note_uncounted_training).
        self._uncounted = None
        # offload() in a process group (_distributed.Distributed), its forward pre-hook
        # (whether the coming backward averages) and the model it hooks; None without one.
        self._group = None
        self._sync_hook = None
        self._group_hook = None
        self._group_model = None
        self._ddp_model = None  # the model whose DDP ignore list has the streamed parameters
        self._model = None  # the model offload() was given
        # The names of the _HostMove methods offload() set on it ("to", "cpu", "cuda").
        self._host_moves = []
        # The hooks on the model's calls: a call waits for its turn and begins a step (CallHooks).
        self._call_hook = None
        # suspend(): what it moved to host memory, to move back in resume(), and the
        # forward pre-hook that refuses calls meanwhile; None when not suspended.
        self._suspended = None

    def _ref(self, key: str) -> Optional[nn.Module]:
        ref = self._refs.get(key)
        return None if ref is None else ref()

    def _set_ref(self, key: str, module: Optional[nn.Module]) -> None:
        self._refs[key] = None if module is None else weakref.ref(module)

    _root = _weakly("root")
    _model = _weakly("model")
    _group_model = _weakly("group_model")
    _ddp_model = _weakly("ddp_model")

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
        """The planner's placement (printable), when offload() had a budget; the
        host RAM and disk (host_plan), when it had a host budget; and where saved
        activations go, with offload(activations=...)."""
        device = self._device_plan()
        host = self._host_text()
        if self.activation_budget is not None:
            line = f"saved activations: to {self._activation_host_memory()}"
            if self.activation_budget:
                line += f", the newest {self.activation_budget / 2**20:.2f} MiB kept on the device"
            spare = (self.host_plan or {}).get("spare_host_bytes", -1)
            if spare >= 0:
                line += f"; the host budget leaves {spare / 2**20:.2f} MiB for their host copies"
            host += line + "\n"
        if device is None and not host:
            return None
        return (device or "") + host

    def _set_group(self, group, model) -> None:
        from ._distributed import SyncHook
        self._group, self._group_model = group, model
        streamed = self._call_hook.streamed  # ids of the streamed parameters
        ref = weakref.ref(model)  # the hook is the model's (Note [Nothing offload() puts on a model refers back to it])
        self._sync_hook = SyncHook(self._engine, group, lambda: any(
            p.requires_grad for p in ref().parameters() if id(p) in streamed))
        self._group_hook = model.register_forward_pre_hook(self._sync_hook)
        for a in self._attached:
            if a.kind == "group":
                a.module.forward._averaged = True

    def no_sync(self):
        """A context manager: backwards of forwards run inside it keep the streamed
        weights' gradients local (summed into .grad on this rank), as DDP's no_sync()
        does for the rest (which layerstream honours too); the first backward after it
        averages the accumulated gradients. Without a process group it does nothing."""
        import contextlib
        if self._sync_hook is None:
            return contextlib.nullcontext()
        return self._sync_hook.no_sync()

    def _host_text(self) -> str:
        h = self.host_plan
        text = self._group.describe() if self._group is not None else ""
        if not h:
            return text
        mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
        budget = "unbounded" if h["host_budget"] < 0 else mib(h["host_budget"])
        pinned = "unlimited" if h["pinned_budget"] < 0 else mib(h["pinned_budget"])
        disk = sum(1 for d in h["on_disk"] if d)
        # The store as made: it pins whole tensors, so more can be pageable than the
        # plan's pageable_store_bytes (the bytes beyond the cap) says.
        pageable = self._check().stats()["pageable_bytes"]
        return text + (f"host RAM (budget {budget}, pinned {pinned}): {mib(h['store_bytes'])} in the store"
                f" ({mib(pageable)} pageable), {mib(h['staging_bytes'])} of staging entries"
                f" ({'pinned' if h['staging_pinned'] else 'pageable'})"
                + (f", {mib(h['grad_staging_bytes'])} of gradient staging buffers" if h["grad_staging_bytes"] else "")
                + f"; disk: {disk} layer(s), "
                f"{mib(h['disk_bytes'])} read from their files on every use"
                + "".join(f"; packed in {path}" for path in h.get("cache_files", [])) + "\n")

    def _activation_host_memory(self) -> str:
        """Which host memory saved activations go to, by the engine's rule: pinned when
        pin_memory, up to what the pinned budget leaves them (EngineOptions::
        activation_pinned_cap, the host plan's spare_pinned_bytes), then pageable."""
        cap = (self.host_plan or {}).get("spare_pinned_bytes", -1)
        if not self._pin_memory:
            return "pageable host memory (pin_memory=False)"
        if cap < 0:
            return "pinned host memory"
        if cap == 0:
            return "pageable host memory (the pinned budget leaves none for them)"
        return f"pinned host memory up to {cap / 2**20:.2f} MiB (what the pinned budget leaves), the rest pageable"

    def _device_plan(self) -> Optional[str]:
        engine = self._check()
        if self._plan is None:
            return None
        # With a host budget the planner's host line is what RAM would hold without one
        # (the host lines below say what it holds): it said "(pinned)" of a store held
        # pageable, or of weights left in their file.
        explain = self._plan["explain_host_budget" if self.host_plan else "explain"]
        tables = [a for a in self._attached if a.kind == "embedding"]
        held = self._plan["held_tables"]  # tables resident with a tied head (offload's _plan)
        if not tables and not held:
            return explain

        def sharing(t):  # the streamed layers that read the table's weight (a tied head)
            return self._tied_tables.get(t.index, [])

        def describe(t):
            tied = sharing(t)
            return (t.name or "<root>") + (f" (weight shared with {', '.join(tied)}: its bytes are in the "
                                           f"host RAM line above)" if tied else "")
        parts = []
        if tables:
            # A table whose weight a streamed head shares is one host copy, already counted
            # in the planner's host RAM line as the head's.
            size = sum(engine.layer_bytes(a.index) for a in tables if not sharing(a))
            parts.append(f"{len(tables)} looked up in host memory (pinned unless pinning failed), "
                         f"{size / 2**20:.2f} MiB more, no device memory: " + ", ".join(describe(t) for t in tables))
        if held:
            parts.append(f"{len(held)} resident with the layer that shares its weight (its bytes are that "
                         f"layer's above): " + ", ".join(f"{n or '<root>'} (weight shared with {', '.join(h)})"
                                                         for n, h in held.items()))
        return explain.rstrip("\n") + "\nembedding tables:         " + "; ".join(parts) + "\n"

    def _note_tied_tables(self) -> None:
        """offload(), once attached: which streamed layers read each table's weight (a tied
        head), for the plan; noted while the modules are there (the handle does not keep
        them: Note [Nothing offload() puts on a model refers back to it])."""
        for t in self._attached:
            if t.kind == "embedding":
                weight = t.module.weight
                tied = [a.name or "<root>" for a in self._attached
                        if a is not t and a.module._parameters.get("weight") is weight]
                if tied:
                    self._tied_tables[t.index] = tied

    def stats(self) -> Dict[str, float]:
        """Counters since offload(): peak_device_bytes (streaming slots plus the
        weights the planner kept resident), device_bytes (the streaming slots now:
        0 while suspended), h2d_bytes, d2h_bytes, steps, ...; the same keys with a
        budget and without (resident_layers and resident_bytes 0 then)."""
        s = dict(self._check().stats())
        s["streamed_device_bytes"] = s["peak_device_bytes"]
        s["resident_bytes"] = s["resident_layers"] = 0  # without a budget nothing is planned resident
        if self._plan is not None:
            s["resident_bytes"] = self._plan["resident_bytes"] + self._plan["fixed_resident_bytes"]
            # The planned layers it keeps resident, and the tables resident with a tied one.
            s["resident_layers"] = len(self._plan["resident"]) + len(self._plan["held_tables"])
            s["budget_bytes"] = self._plan["budget_bytes"]
        s["peak_device_bytes"] = s["streamed_device_bytes"] + s["resident_bytes"]
        return s

    def step_stats(self) -> List[Dict[str, float]]:
        """Per completed step, the most recent 4096 (older ones are dropped): h2d_bytes,
        d2h_bytes, stall_seconds (time compute waited for weights), overlap_fraction
        (share of copy time hidden behind compute; needs trace=True, else NaN),
        peak_device_bytes (the peak so far, as stats() gives it: no per-step peak is
        kept), slot utilisation (max_slots_held / slots), hits, misses. A step is
        complete when the next one begins (its first streamed layer): the engine cannot
        tell the end of a step earlier (several forwards and backwards may make one), so
        the step just run is not listed yet; stats()["steps"] counts it."""
        engine = self._check()
        total = self.stats()
        out = []
        for d in engine.step_stats():
            d = dict(d)
            d["peak_device_bytes"] = total["peak_device_bytes"]
            out.append(d)
        return out

    def export_trace(self, path: str) -> None:
        """Writes the timeline as Chrome trace / Perfetto JSON (open it in
        ui.perfetto.dev or chrome://tracing). Needs offload(..., trace=True).
        The timeline's memory is bounded: slices past its capacity are left out
        (stats()'s trace_dropped_slices counts them; a warning says so)."""
        text = self._timeline()
        with open(path, "w") as f:
            f.write(text)

    def _timeline(self) -> str:
        engine = self._check()
        text = engine.trace_json()
        if not text:
            raise LayerstreamError("no timeline was recorded: pass trace=True to offload()")
        dropped = engine.stats()["trace_dropped_slices"]
        if dropped:
            warnings.warn(f"layerstream: the timeline reached its capacity; {dropped} later slices were not "
                          f"recorded (trace=True bounds its memory), nor the overlap of those steps. Trace fewer "
                          f"steps: offload(..., trace=True) for a few, then detach() and offload() again",
                          RuntimeWarning, stacklevel=3)
        return text

    def plot_timeline(self, path: str, max_ms: Optional[float] = None) -> None:
        """Draws the timeline (one lane per stream) into a PNG with matplotlib."""
        from .timeline import plot_chrome_trace
        plot_chrome_trace(self._timeline(), path, max_ms=max_ms)

    def ordering_errors(self) -> List[str]:
        """Races found by the sim device's ordering checker (empty on CUDA)."""
        return list(self._check().ordering_errors())

    def synchronize(self) -> None:
        """Waits for every transfer and gradient copy; param.grad is then complete.
        It also forgets every weight cached on the device, so the next fetch
        reads the host copy again, and re-codes trainable lossless weights
        before their next copy: call it after writing streamed weights in a
        way neither their version counter nor the sample a step takes sees
        (through ``.data`` to a few elements, or inside a step; Note [Writes
        through .data between steps] in csrc/torch/engine.cpp) with
        cache_across_steps=True, or to a few elements of a trainable lossless
        weight."""
        self._check().synchronize()

    @contextlib.contextmanager
    def _in_turn(self, frame):
        """suspend(), resume() and detach() take a turn of the model's calls (Note [Calls of
        one offloaded model take turns]): they wait for another thread's call to end
        instead of pulling slots or weights from under it. `frame`: the method's own."""
        turns = self._call_hook.begins._turns if self._call_hook is not None else None
        if turns is None:
            yield
            return
        turns.enter(frame)
        try:
            yield
        finally:
            turns.leave(frame)

    # -- suspend / resume (docs/design/streaming-core.md, "Suspend") ---------
    @property
    def suspended(self) -> bool:
        return self._suspended is not None

    def suspend(self) -> None:
        """Frees the device memory the offloaded model holds, for a while (another
        model, a VAE decode, sampling): the streaming slots, and every parameter
        (with its ``.grad``) and buffer of the model on the compute device (layers
        kept resident, norms, adapters) goes to host memory, with the states
        ``layerstream.optim`` keeps for those parameters (torch's optimizers'
        states stay where they are: step after ``resume()``); the streamed weights
        are there already. Until ``resume()``, calling the model is an error. Called
        while another thread's call of the model runs, it waits for that call to end
        (as resume() and detach() do); inside a call, refused, changing nothing, while
        a streamed layer is computing. Nothing to do when already suspended."""
        # Ctrl-C or a timeout's signal after it, not half way (Note [A signal lands between steps])
        with self._in_turn(sys._getframe()), HeldSignals():
            self._suspend()

    def _suspend(self) -> None:
        engine = self._check()
        if self._suspended is not None:
            return
        engine.suspend()  # first: it refuses while a layer computes
        compute = self.compute_device
        moved, hook = [], None
        if self._model is not None:
            hook = self._model.register_forward_pre_hook(
                functools.partial(_refuse_while_suspended, str(compute)), prepend=True)
        self._suspended = (moved, hook)  # before moving: resume() undoes a move that raised half-way
        if self._model is not None and compute.type != "cpu":  # the sim device computes on the host
            from ._optim_state import _move_states_of
            _moved_off(self._model, compute, _to_host, moved)
            _move_states_of([t for t, owner, _, _ in moved if owner is None], compute, _to_host)

    def resume(self) -> None:
        """Undoes ``suspend()``: allocates the streaming slots again (an error,
        still suspended, when the device cannot hold them) and moves what
        ``suspend()`` moved back to the device it was on, with the states
        ``layerstream.optim`` made for those parameters meanwhile (a load, a
        step). The first step prefetches in the order learnt before. Nothing
        to do when not suspended."""
        with self._in_turn(sys._getframe()), HeldSignals():  # as suspend()
            self._resume()

    def _resume(self) -> None:
        engine = self._check()
        if self._suspended is None:
            return
        self._move_back()  # before the slots: a retry after an error redoes both
        engine.resume()
        self._end_suspension()

    def _move_back(self) -> None:
        from ._optim_state import _move_states_back
        moved = self._suspended[0]
        _move_back(moved)
        _move_states_back([(t, device) for t, owner, _, device in moved if owner is None])

    def _end_suspension(self) -> None:
        hook = self._suspended[1]
        if hook is not None:
            hook.remove()
        self._suspended = None

    def detach(self) -> None:
        """Restores the modules: original forward, weights as ordinary tensors
        on their original devices, bit-identical (a suspended model's resident
        parts are moved back first)."""
        # Ctrl-C or a timeout's signal after it, not half way (Note [A signal lands between steps])
        with self._in_turn(sys._getframe()), HeldSignals():
            self._detach()

    def _detach(self) -> None:
        engine = self._check()
        # First what can fail, while nothing has changed: a refusal or an error leaves the
        # model offloaded and working, and the handle attached (as engine.detach()'s own
        # refusals do). How each forward goes back (a wrapper installed since: Note [A
        # wrapper installed over a streamed forward]), and the weights rebuilt from the
        # host store.
        # (A layer whose module was freed meanwhile has nothing to restore: Note [Nothing
        # offload() puts on a model refers back to it].)
        forwards = [forward_restore(a) if a.module is not None else None for a in self._attached]
        restored = self._restored_weights(engine)
        if self._suspended is not None:  # the resident parts back; no slots for detach
            self._move_back()
            self._end_suspension()
        devices = [a.devices[0] for a in self._attached]
        engine.detach(devices)
        # No way back from here: every step runs even when one before it raised (that
        # exception propagates once all ran, the handle detached). Stopping half way left
        # modules streaming from a detached engine, with no handle that could finish.
        _each([self._unhook_call, self._resident_quant.remove, self._unhook_activations, self._unhook_peft,
               self._end_uncounted, self._forget_ddp, self._forget_group]
              + [functools.partial(_restore_layer, a, restored.get(a.index), restore)
                 for a, restore in zip(self._attached, forwards)]
              + [self._unhook_root, self._unfuse_off, self._unreport_device, self._detached])

    def _unhook_call(self) -> None:
        if self._call_hook is not None:
            self._call_hook.remove()
            self._call_hook = None

    def _unhook_activations(self) -> None:
        for h in self._activation_hooks:
            h.remove()
        self._activation_hooks = []

    def _unhook_peft(self) -> None:
        if self._peft is not None:
            self._peft.remove()
            self._peft = None

    def _end_uncounted(self) -> None:
        if self._uncounted is not None:
            self._uncounted.end()

    def _forget_ddp(self) -> None:
        if self._ddp_model is not None:
            from ._distributed import forget_ddp_ignore
            forget_ddp_ignore(self._ddp_model)
            self._ddp_model = None

    def _forget_group(self) -> None:
        if self._group_hook is not None:
            self._group_hook.remove()
            self._group.forget_shards()
            self._group = self._sync_hook = self._group_hook = self._group_model = None

    def _unhook_root(self) -> None:
        for hook in (self._load_check, self._save_check):
            if hook is not None:
                hook.remove()
        self._load_check = self._save_check = None
        if self._root is not None and isinstance(self._root.__dict__.get("_apply"), _RootApply):
            del self._root.__dict__["_apply"]
        remove_subtree_checks(self._subtree_checks)
        self._subtree_checks = []
        for kind in self._host_moves:
            if self._root is not None and isinstance(self._root.__dict__.get(kind), _HostMove):
                del self._root.__dict__[kind]
        self._host_moves = []

    def _unfuse_off(self) -> None:
        for layer, value in self._fused_off:
            if layer() is not None:
                layer().activation_relu_or_gelu = value
        self._fused_off = []

    def _unreport_device(self) -> None:
        for m in filter(None, (ref() for ref in self._device_reported)):
            m.__class__ = type(m).__dict__["_layerstream_reports_device_of"]
            m.__dict__.pop("_layerstream_device", None)
        self._device_reported = []

    def _detached(self) -> None:
        self._root = None
        self._engine = None

    def _restored_weights(self, engine) -> dict:
        """The parameters detach() gives the layers whose weights the engine holds packed
        (index -> the weight; a quantized tensor group's: (owner, key) -> each part's), built
        before anything changes. bitsandbytes weights: rebuilt from the same bytes. Quantized
        by offload(): the dense values were not kept, so the dequantized ones (lossy by the
        format's error bound), in the strides the weight had (e.g. channels_last)."""
        out = {}
        for a in self._attached:
            if a.module is None:
                continue  # freed: nothing to give it back to
            if a.bnb_stats is not None:
                import bitsandbytes as bnb
                from ._prequant import _BNB_STORAGE
                dev = torch.device(a.devices[0])
                stats = dict(a.bnb_stats)
                codes = engine.packed_codes(a.index).view(stats.pop(_BNB_STORAGE, torch.uint8))  # its container
                out[a.index] = bnb.nn.Params4bit.from_prequantized(
                    data=codes.reshape(-1, 1).to(dev),
                    # CPU tensors, as when loading a checkpoint: bitsandbytes moves them.
                    quantized_stats=stats, requires_grad=False, device=dev)  # its module: set by _detach
            elif a.packed_parts:
                out[a.index] = {(o, k): nn.Parameter(_as_computed(engine.dequantized_part(a.index, part),
                                                                  (a.dequant or {}).get(part),
                                                                  (a.strides or {}).get(part)).to(a.devices[0]),
                                                     requires_grad=False)
                                for _, part, o, k in a.packed_parts}
            elif engine.layer_format(a.index) and not a.prequantized and not isinstance(
                    a.module._parameters.get("weight"), FileWeight):  # on disk: keeps its FileWeight
                w = _as_computed(engine.dequantized_weight(a.index), a.dequant, a.strides)
                out[a.index] = nn.Parameter(w.to(a.devices[0]), requires_grad=False)
        return out

    def __repr__(self):
        if self._engine is None:
            return "<layerstream.Handle (detached)>"
        return (f"<layerstream.Handle device={self.device} layers={len(self._attached)}"
                f"{' (suspended)' if self.suspended else ''}>")


def _each(steps: list) -> None:
    """Runs every step, even after one raised: the first exception propagates once all
    ran (the others' in its notes)."""
    errors = []
    for step in steps:
        try:
            step()
        except BaseException as e:  # raised below, after the other steps
            errors.append(e)
    for e in errors[1:]:
        errors[0].add_note(f"layerstream: detach() then also raised {type(e).__name__}: {e}")
    if errors:
        raise errors[0]


def _restore_layer(a: _Attached, value, restore) -> None:
    """detach() on one layer: its weight as `value` gave it back (None: the parameter it
    kept), its forward as `restore` (forward_restore) says, offload()'s marks gone."""
    if a.module is None:  # freed (Note [Nothing offload() puts on a model refers back to it])
        a.forward = None
        return
    if value is None:
        pass
    elif a.bnb_stats is not None:
        value.module = a.module  # as Params4bit.from_prequantized(module=...) sets them
        a.module.quant_state = value.quant_state
        a.module.weight = value
    elif a.packed_parts:
        for (o, k), part in value.items():
            o._parameters[k] = part
    else:
        a.module.weight = value
    for h in a.hooks:
        h.remove()
    for t in a.module._parameters.values():
        if isinstance(t, FileWeight):
            t._disk_tier = False  # in its file again, waiting for an offload()
    a.module.__dict__.pop("_apply", None)
    _WHOLE_GROUPS.discard(a.module)
    for o in a.owners:
        o.__dict__.pop("_apply", None)
        for p in o.parameters(recurse=False):
            if hasattr(p, "_is_memory_managed"):
                del p._is_memory_managed
    for p in a.module.parameters(recurse=False):
        if hasattr(p, "_is_memory_managed"):
            del p._is_memory_managed
    if getattr(a.module, "_layerstream_handle", None) is not None:
        del a.module._layerstream_handle
    a.module.__dict__.pop("__deepcopy__", None)
    original = type(a.module).__dict__.get("_layerstream_original_class")
    if original is not None:  # an Embedding subclass that looked up through super()
        a.module.__class__ = original
        a.module.__dict__.pop("_layerstream_lookup", None)
    else:
        put_forward_back(a, restore)
    a.forward = None  # the streamed forward (and its engine) go with the last other reference


def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu")


def _refuse_while_suspended(compute: str, module, args):
    # On the sim device the compute device is the host: model.to('cpu') does not resume there.
    how = ("call handle.resume() before running it" if compute == "cpu" else
           f"call handle.resume() or model.to('{compute}') before running it (to compute on the host, "
           f"handle.detach() first)")
    raise LayerstreamError(
        f"this model's layerstream handle is suspended (handle.suspend(), or model.to('cpu') of a model "
        f"on a GPU, freed its device memory); {how}")


def _moved_off(model: nn.Module, device: torch.device, move, moved: list) -> list:
    """Moves every parameter (and its .grad) and buffer of `model` that lives on
    `device` by `move` (tensor -> its copy in host memory), keeping the
    parameters' identities (their .data changes, as nn.Module.to does); a tensor
    registered twice moves once. Appends what moved to `moved` as it goes (for
    _move_back) and returns it."""
    done = {}  # id(old buffer) -> its host copy
    # Out of inference mode (suspend() inside torch.inference_mode(), a sampling step of a
    # training loop): copies made in it are inference tensors, which a later backward
    # cannot save (as _calls._move_to).
    with torch.inference_mode(False), torch.no_grad():
        for module in model.modules():
            for p in module._parameters.values():
                if p is None or id(p) in done or p.device != device:
                    continue
                done[id(p)] = p
                p.data = move(p.data)
                if p.grad is not None and p.grad.device == device:
                    p.grad = move(p.grad)
                moved.append((p, None, None, device))
            for name, b in module._buffers.items():
                if b is None or (b.device != device and id(b) not in done):
                    continue
                if id(b) not in done:
                    done[id(b)] = move(b)
                module._buffers[name] = done[id(b)]
                # The module weakly: the handle keeps this while suspended (Note [Nothing
                # offload() puts on a model refers back to it]).
                moved.append((done[id(b)], weakref.ref(module), name, device))
    return moved


def _move_back(moved: list) -> None:
    """Undoes _moved_off: each parameter (and .grad) and buffer to the device it
    was on (a buffer registered twice, once). A buffer replaced meanwhile is
    left as it is."""
    done = {}
    with torch.inference_mode(False), torch.no_grad():  # as _moved_off
        for t, module, name, device in moved:
            if module is None:
                t.data = t.data.to(device)
                if t.grad is not None and t.grad.device.type == "cpu":
                    t.grad = t.grad.to(device)
            elif module() is not None and module()._buffers.get(name) is t:
                module = module()
                if id(t) not in done:
                    done[id(t)] = t.to(device)
                module._buffers[name] = done[id(t)]
