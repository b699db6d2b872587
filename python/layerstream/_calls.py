"""The calls of an offloaded model: whose turn it is (threads take turns), the hooks that
begin and end each call (a step of the engine), what an optimizer step writes, and the
tensors added after offload() that follow to the compute device. Installed by offload()
(_attach.py) and layerstream.compat; removed by Handle.detach() (_handle.py)."""
from __future__ import annotations

import os
import sys
import threading
import weakref

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _C, _distributed
from ._discovery import peft_base_reader
from ._forward import _DroppedInCopies, _RefusesCopy
from ._interrupts import held_interrupts
from ._packed import _PackedWeight, guard_peft_merges

LayerstreamError = _C.LayerstreamError


# Note [Calls of one offloaded model take turns]
# A resident model may be called from several threads at once (a web server's worker
# threads, each serving a request). An offloaded one shares state between its calls: the
# engine's step (Engine::begin_call), the slots its layers hold while they run (a tensor
# group holds one while its module's own forward runs, and its parameters are swapped on
# the module), the prefetch schedule that follows the traced order of one call. Two calls
# interleaved ran out of slots ("all 2 device slots are held at once") or met each other's
# swapped parameters. So a call of the model waits until another thread's call of it has
# returned (or raised): the calls take turns, as calls queued on one GPU do anyway. The
# thread that holds the turn may call the model again inside its call. Not covered: a
# backward running while another thread calls the model, and calls that torch.compile
# traced (the hooks do nothing there).
# A turn is the holder's while its call is under way, which is known without its help:
# the frame that called the pre-hook (torch's Module call) is on the holder's stack until
# the call ends (the calls of the entry modules below the root inside it only nest: Note
# [Calls that enter the model below its root]). A call ended by an exception that is not
# an Exception (KeyboardInterrupt in a notebook, SystemExit) skips torch's always-called
# hooks and never gives its turn back; the next call, of that thread or a waiting one, finds the frame gone from the
# holder's stack (or the holder's thread gone) and takes the turn. A fork()ed child starts
# with every turn free (the holders stayed in the parent; its call is then refused by the
# engine, Note [An engine belongs to the process that made it] in csrc/torch/engine.cpp).
class _CallTurns:
    """Whose turn it is to call the model (the note above). Thread-safe."""

    __slots__ = ("_cond", "_owner", "_frames", "__weakref__")
    POLL_S = 1.0  # how often a waiting call looks whether the holder's call is still under way
    INTERRUPT_POLL_S = 0.05  # how often a waiting call of the main thread looks for a Ctrl-C (_take)
    _ALL: "weakref.WeakSet[_CallTurns]" = weakref.WeakSet()

    def __init__(self):
        self._free()
        _CallTurns._ALL.add(self)

    def _free(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        # The holder's thread, and its calls under way, outermost first: (frame, its caller's).
        self._owner, self._frames = None, []

    @classmethod
    def after_fork_in_child(cls) -> None:
        for turns in list(cls._ALL):
            turns._free()  # a fresh lock too: a parent's thread may have held the old one

    def _held(self, me) -> bool:
        """Whether the holder's outermost call is under way: its frame is on its thread's
        stack (this thread's own stack when `me` holds the turn: no other thread's read)."""
        if not self._frames:
            return False
        f = sys._getframe() if self._owner == me else sys._current_frames().get(self._owner)
        frame = self._frames[0][0]
        while f is not None:
            if f is frame:
                return True
            f = f.f_back
        return False

    def enter(self, frame) -> bool:
        """Waits for the turn; `frame`: the frame of the call (the pre-hook's caller).
        True when this call is the thread's outermost call of the model (it took the
        turn), False when the thread's call under way calls the model again."""
        while True:
            outer = self._take(threading.get_ident(), frame)
            if outer is not None:
                return outer
            # a Ctrl-C stopped the wait and its handler raised nothing: wait on

    def _take(self, me, frame):
        """True (the turn, taken) or False (a call inside this thread's call under way),
        or None when a Ctrl-C came first (it is raised as this returns).
        threading.Condition takes and gives back its lock in Python code: a
        KeyboardInterrupt raised between left it taken for ever, and every later call
        (detach() too) waited on it. So Ctrl-C is held over this (Note [A Ctrl-C as a
        C++ call returns]); a wait for the turn still ends on one, taking no turn (the
        main thread, where it lands, looks every INTERRUPT_POLL_S)."""
        poll = self.INTERRUPT_POLL_S if threading.current_thread() is threading.main_thread() else self.POLL_S
        with held_interrupts() as interrupted, self._cond:
            if not interrupted and self._owner == me and self._held(me):
                self._frames.append((frame, frame.f_back))  # this thread's call calls the model again
                return False
            while not interrupted and self._owner is not None and self._held(me):
                self._cond.wait(timeout=poll)
            if interrupted:
                self._cond.notify()  # the wake-up this wait may have had goes on to another
                return None
            self._owner, self._frames = me, [(frame, frame.f_back)]
            return True

    def leave(self, frame) -> None:
        """The call of `frame` ends: the frame enter() was given, or (torch's always-called
        hooks after a forward raised) its caller's. The turn passes on when it is the
        outermost. Calls above it that never ended (a KeyboardInterrupt skips torch's
        always-called hooks) end with it."""
        with held_interrupts(), self._cond:  # Ctrl-C: after the lock is given back (_take)
            if self._owner != threading.get_ident():
                return  # a call whose pre-hook did not run (one registered before it raised)
            frames = self._frames
            for i in range(len(frames) - 1, -1, -1):
                if frame is frames[i][0] or frame is frames[i][1]:
                    del frames[i:]
                    break
            else:
                return  # its pre-hook did not run
            if not frames:
                self._owner = None
                self._cond.notify()


os.register_at_fork(after_in_child=_CallTurns.after_fork_in_child)


class _CallBegins(_RefusesCopy):
    """The forward pre-hook offload() (and compat's attach()) puts on the model: the call
    waits for its turn (Note [Calls of one offloaded model take turns]), then begins a
    step in the engine `engine_of()` returns (Engine::begin_call), so weights cached in
    slots by the call before are not served to this one even when it skips the layer that
    began the steps before (Note [When a step begins] in core/scheduler.cpp); then
    `follow` (offload()'s _AddedTensorsFollow), if given, runs. Traced by torch.compile,
    it checks a DDP's ignore list only (Note [Checks of a call under torch.compile] in
    _distributed.py; the engine's own signs begin the step). Copying or pickling the model
    is refused with the message of its streamed modules."""

    __slots__ = ("_engine_of", "_follow", "_turns", "_streamed", "_ddp_checked")

    def __init__(self, engine_of, turns: _CallTurns, follow=None, streamed=frozenset()):
        self._engine_of, self._turns, self._follow = engine_of, turns, follow
        self._streamed, self._ddp_checked = streamed, None

    def __call__(self, module, args):
        ddp = DistributedDataParallel._get_active_ddp_module()  # set while a DDP forward runs
        if ddp is not None:
            _distributed.eagerly(self._check_ddp, ddp)
        if not torch.compiler.is_compiling():
            self.enter(sys._getframe(1))

    def enter(self, frame) -> None:
        """The call's turn, and at the thread's outermost call of the model the engine's
        step and `follow`. `frame`: the pre-hook's caller (torch's Module call). Eager calls
        only (the hooks do nothing in calls torch.compile traces)."""
        if self._turns.enter(frame):
            engine = self._engine_of()
            if engine is not None:
                engine.begin_call()
            if self._follow is not None:
                self._follow()

    def _check_ddp(self, ddp) -> None:
        if ddp is not self._ddp_checked:
            _check_ddp_ignores(ddp, self._streamed)
            self._ddp_checked = ddp


def _check_ddp_ignores(ddp, streamed: set) -> None:
    """A DistributedDataParallel that reduces streamed gradients itself: it wraps a module
    holding the offloaded one, and reads the ignore list of the module it wraps, while
    offload() set it on the module it was given. Those gradients would reach .grad as
    zeros (the engine stages them after DDP's reduction): refused, naming the fix."""
    managed = {id(q) for q in ddp._module_parameters}
    names = [n for n, p in ddp.module.named_parameters() if id(p) in streamed and id(p) in managed]
    if names:
        raise LayerstreamError(
            f"DistributedDataParallel reduces {len(names)} streamed parameter(s) itself (e.g. {names[0]!r}): it "
            f"wraps a module that holds the offloaded one, and offload() put them on the ignore list of the "
            f"module it was given, which DDP does not read; their gradients would arrive as zeros. Offload the "
            f"module DDP wraps (offload(model) before DDP(model)), or name them before wrapping: "
            f"DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names of the "
            f"streamed parameters in model)")


class _CallEnds(_RefusesCopy):
    """The forward hook beside _CallBegins, called by torch when the call returns or
    raises (always_call): the turn passes on."""

    __slots__ = ("_turns",)

    def __init__(self, turns: _CallTurns):
        self._turns = turns

    def __call__(self, module, args, output):
        if not torch.compiler.is_compiling():
            self._turns.leave(sys._getframe(1))


class _EntryBegins(_DroppedInCopies):
    """_CallBegins' pre-hook on an entry module below the model's root (entry_modules()):
    the same turn and step, with no DDP check (DDP calls the root)."""

    __slots__ = ("_begins",)

    def __init__(self, begins: _CallBegins):
        self._begins = begins

    def __call__(self, module, args):
        if not torch.compiler.is_compiling():
            self._begins.enter(sys._getframe(1))


class _EntryEnds(_DroppedInCopies, _CallEnds):
    """_CallEnds on an entry module (a copy of the module drops it)."""

    __slots__ = ()


# Note [Calls that enter the model below its root]
# The model's call hooks (the turn, the engine's step, tensors added after offload(), the
# activation offload's scope) sit on the module offload() was given. Callers also enter
# below it: peft's PeftModel.generate() calls its base model's generate(), which calls the
# causal LM inside the peft wrappers; merge_and_unload() returns that inner model; a
# caller wants hidden states from model.model(...). Such a call never ran the root's
# hooks: threads serving the model met each other's slots, a late DoRA adapter was not
# refused, an adapter loaded after offload() stayed in host memory. So the hooks sit on
# the entry modules too: the modules that hold a streamed layer, from the root down to
# the first container of blocks (ModuleList, ModuleDict; a Sequential is an entry, its
# children are not). A call of an entry inside a call of the model (the usual path)
# only counts as nested; the thread's outermost call does the rest. Not entries: a
# block of a container, a streamed layer itself (model.lm_head(h) alone, model.layers[3](x));
# their calls have no turn (documented in README's Limits), as hooks on every block
# would cost each call of the model a Python hook per block.
def entry_modules(model: nn.Module, streamed_modules: set) -> list:
    """The entry modules of `model` below it (the note above): modules not in
    `streamed_modules` (ids) holding one that is, down to the first container."""
    holds = {}  # id(module) -> whether it holds a streamed module

    def held(m: nn.Module) -> bool:
        if id(m) not in holds:
            holds[id(m)] = any(id(c) in streamed_modules or held(c) for c in m.children())
        return holds[id(m)]

    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    found, todo = [], [] if isinstance(model, containers) else [model]
    while todo:
        m = todo.pop()
        for child in m.children():
            if id(child) in streamed_modules or not held(child):
                continue
            if not isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                found.append(child)
            if not isinstance(child, containers):
                todo.append(child)
    return found


class CallHooks:
    """The two hooks on the model's calls (_CallBegins, _CallEnds), on the model and its
    entry modules (Note [Calls that enter the model below its root]), and the model's
    streamed parameters (ids, `streamed`: a set the caller may still add to) that an
    optimizer step writes (Note [An optimizer step is a write]); remove() ends both."""

    __slots__ = ("begins", "entries", "_handles", "streamed", "__weakref__")

    def __init__(self, model: nn.Module, engine_of, streamed: set, streamed_modules: set, follow=None):
        turns = _CallTurns()
        self.begins = _CallBegins(engine_of, turns, follow, streamed)
        self.streamed = streamed
        # Weakly: the hooks are the modules' (Note [Nothing offload() puts on a model refers back to it]).
        self.entries = [weakref.ref(m) for m in entry_modules(model, streamed_modules)]
        self._handles = [model.register_forward_pre_hook(self.begins),
                         model.register_forward_hook(_CallEnds(turns), always_call=True)]
        begins, ends = _EntryBegins(self.begins), _EntryEnds(turns)
        for ref in self.entries:
            self._handles += [ref().register_forward_pre_hook(begins),
                              ref().register_forward_hook(ends, always_call=True)]
        _STEP_WRITES.add(self)

    def remove(self) -> None:
        _STEP_WRITES.discard(self)
        for h in self._handles:
            h.remove()


# Note [An optimizer step is a write]
# A weight cached in a device slot is reused only while the parameter's version counter
# has not moved (every reuse with cache_across_steps=True, a reuse within a step without
# it; csrc/torch/engine.cpp). An optimizer that writes through `.data` (Prodigy, and others
# older than torch.no_grad) or a raw pointer (bitsandbytes' 8-bit optimizers, DeepSpeed's
# CPU Adam) moves no counter: with cache_across_steps=True every later step computed
# with the weights from before the step, silently. The sample of the host bytes a step
# takes when it begins (Note [Writes through .data between steps] in csrc/torch/engine.cpp)
# sees bulk writes, not a step that changed a few elements (bf16 updates that mostly round
# away). So every torch.optim.Optimizer's step() also runs our global step post-hook, which
# moves the counter of each streamed parameter that step had a gradient for (what an
# optimizer writes; frozen weights keep their cached copy): the next use copies it again
# (and re-codes a trainable lossless weight, Note [Trainable coded weights] in
# csrc/torch/engine_coded.cpp). Not after layerstream.optim's steps: their C++ step moves
# the counters itself, and a sharded one records each counter it left
# (_distributed.check_shards refuses a parameter moved since, as written by another
# optimizer on memory the node's ranks share).
_STEP_WRITES: "weakref.WeakSet[CallHooks]" = weakref.WeakSet()


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    """torch's global optimizer step post-hook: Note [An optimizer step is a write]."""
    live = [hooks.streamed for hooks in list(_STEP_WRITES)]
    if not live or getattr(optimizer, "_layerstream_moves_versions", False):
        return
    written = [p for group in optimizer.param_groups for p in group["params"]
               if p.grad is not None and any(id(p) in ids for ids in live)]
    if written:
        torch.autograd.graph.increment_version(written)


register_optimizer_step_post_hook(_after_optimizer_step)


# Note [Tensors added after offload() follow to the compute device]
# offload() moves what it does not stream to the compute device. A module added to the
# model later is created where its code puts it: peft's get_peft_model() and diffusers'
# load_lora_weights() create each adapter beside its base weight, which for a streamed
# layer is in host memory, so on a GPU the adapter would meet device activations and
# fail with torch's device-mismatch error. torch's global registration hooks count every
# parameter and buffer registered in this process; a call of the offloaded model that
# finds the count changed since it last looked moves the tensors of modules that are not
# streamed and not on the compute device there, as offload() moved the model's resident
# ones (parameters keep their identity, as with model.to()). Never a streamed module's
# own tensors (a parameter replaced there is refused by its layer), not while suspended
# (that call is refused; the next one looks), not in a call torch.compile traces (move
# what you add before compiling, model.to(device)). A peft adapter whose forward reads
# its base layer's weights itself (DoRA, HRA, ...) over a streamed layer is refused
# instead, at each such call (_check_no_base_readers).
_REGISTERED = [0]  # parameters and buffers registered on any module since import


def _count_registration(*_):
    _REGISTERED[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
torch.nn.modules.module.register_module_buffer_registration_hook(_count_registration)


def _added_tensors(model: nn.Module, skip_modules: set, skip_params: set, device: torch.device) -> list:
    """(module, "param" or "buffer", name) of each tensor of `model` that a module not in
    `skip_modules` (ids) holds, that is not in `skip_params` (ids), has data and is not on
    `device`: what Note [Tensors added after offload() follow to the compute device] moves."""
    found, seen = [], set()
    for module in model.modules():
        if id(module) in skip_modules:
            continue
        for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
            for name, t in tensors.items():
                if t is None or id(t) in skip_params or id(t) in seen or t.is_meta or t.device == device:
                    continue
                seen.add(id(t))
                found.append((module, kind, name))
    return found


class _AddedTensorsFollow:
    """offload()'s `follow` of _CallBegins: Note [Tensors added after offload() follow to
    the compute device]."""

    __slots__ = ("_model", "_handle", "_skip_modules", "_skip_params", "_device", "_seen")

    def __init__(self, model: nn.Module, handle: "Handle", skip_modules: set, skip_params: set,
                 device: torch.device):
        # The model weakly: this object is its hook's (Note [Nothing offload() puts on a model refers back to it]).
        self._model, self._handle = weakref.ref(model), weakref.ref(handle)
        self._skip_modules, self._skip_params, self._device = skip_modules, skip_params, device
        self._seen = _REGISTERED[0]

    def __call__(self):
        if _REGISTERED[0] == self._seen:
            return
        handle, model = self._handle(), self._model()
        if handle is None or model is None or handle.suspended:
            return
        _check_no_base_readers(model, self._skip_modules)  # refused: the next call looks again
        guard_peft_merges()  # peft imported after offload(): its adapters came now
        self._seen = _REGISTERED[0]
        for module, kind, name in _added_tensors(model, self._skip_modules, self._skip_params, self._device):
            _move_to(module, kind, name, self._device)


def _check_no_base_readers(model: nn.Module, streamed: set) -> None:
    """Refuses a peft adapter added after offload() whose forward reads its base layer's
    weights itself (DoRA, HRA, ...: _discovery.peft_base_reader) over a streamed layer:
    it would compute with host tensors (on a GPU, torch's device-mismatch error; on the
    sim device unnoticed) or with a quantized weight's data-less stand-in. offload()
    keeps such base layers resident when the adapter is there first; a layer that
    streams cannot become resident while attached, so the way is detach() and offload()."""
    found = [(name, label, sub_name) for name, m in model.named_modules()
             for label in [peft_base_reader(m)] if label is not None
             for sub_name, sub in m.named_modules(prefix=name) if sub is not m and id(sub) in streamed]
    if not found:
        return
    name, label, base = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    w = model.get_submodule(base)._parameters.get("weight")
    if isinstance(w, _PackedWeight):
        why, how = (f"its weight is held quantized (quantize=), and {label} over a quantized layer is not "
                    f"supported: it needs the dense weight"), " (unquantized)"
    else:
        why, how = ("its weights stay in host memory (on a GPU the adapter would meet them there: torch's "
                    "device-mismatch error)"), ""
    raise LayerstreamError(
        f"peft's {label} adapter '{name}' was added after offload(), and its forward reads the weights of its "
        f"base layer '{base}'{more} itself, not through the layer's forward, while that layer streams: {why}. "
        f"Add the adapter before offload() (get_peft_model(), then offload() of the peft model): offload() keeps "
        f"the base layers of such adapters resident{how}. To go on: handle.detach() (the adapter stays), then "
        f"offload() the model again")


def _move_to(module: nn.Module, kind: str, name: str, device: torch.device) -> None:
    """Moves one of `module`'s tensors (_added_tensors' entry) to `device`; a parameter
    keeps its identity and takes its .grad along. Not as an inference tensor when the
    call runs under torch.inference_mode() (a later training step could not use it)."""
    with torch.inference_mode(False), torch.no_grad():
        if kind == "buffer":
            module._buffers[name] = module._buffers[name].to(device)
            return
        p = module._parameters[name]
        p.data = p.data.to(device)
        if p.grad is not None:
            p.grad = p.grad.to(device)
