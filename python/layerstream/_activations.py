"""Activation offload (docs/design/activations.md): while an offloaded model's forward runs,
the tensors autograd saves go through the engine (Engine.stash_activation: to pinned host
memory on the device-to-host stream, or kept on the device), and come back when backward
unpacks them (Engine.restore_activation, which also starts the next ones back)."""
from __future__ import annotations

import os
import sys
import threading
import warnings
import weakref
from typing import List, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import _C, _dynamo_marks
from ._forward import _DroppedInCopies, _OwnForward
from ._interrupts import held_interrupts


class _Kept:
    """A saved tensor the engine does not take (a parameter, a view of one, not dense),
    with its version when saved: unpacking runs autograd's check, which torch skips
    under saved-tensor hooks (_C.check_saved_version). Its data only, as autograd saves
    it: an output saved with its own autograd node is a cycle through the graph that
    not even gc frees, so a forward without backward kept its graph (autograd gives the
    unpacked data its node and the leaf's accumulator back)."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        t = t.detach()
        self.tensor = t
        try:
            self.version = t._version
        except RuntimeError:  # an inference tensor has no version counter
            self.version = None

    def unpack(self) -> torch.Tensor:
        if self.version is not None:
            _C.check_saved_version(self.tensor, self.version)
        return self.tensor


@_dynamo_marks.disable(reason=(
    "offload(activations=...) opens a saved-tensor hooks scope around the model's call, which "
    "torch.compile cannot trace: the graph breaks at the model's start and end (the compiled regions' "
    "saved tensors still go through the hooks). With fullgraph=True compile the model's blocks instead "
    "of the whole model, or drop fullgraph=True"))
def _scope_outside_graphs(step, *args):
    """Runs the activation scope's hooks' work (`step(*args)`) eagerly under torch.compile:
    a graph break there, with the reason above, instead of one inside them at a call Dynamo
    cannot trace, and the per-thread state (_Scope) read as Python reads it."""
    step(*args)


_DYNAMO_DIR = os.path.join("torch", "_dynamo", "")


def _call_frame():
    """The frame of the model's call running our hook (nn.Module's call): the first frame
    above this module's and torch.compiler.disable's wrapper (under torch.compile the hook
    reaches _open through it, after a graph break)."""
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename == __file__ or _DYNAMO_DIR in f.f_code.co_filename):
        f = f.f_back
    return f


_NOT_EXPORTED = (
    "torch.export cannot export a model offloaded with activations=...: its activation offload is "
    "saved-tensor hooks around the model's eager calls, which an exported program does not run. For the "
    "export, offload the model without activations= (handle.detach(), then layerstream.offload() without it)")


@_dynamo_marks.disable(reason=_NOT_EXPORTED)
def _not_exported():
    """Refuses torch.export of a model with activation offload (non-strict export runs the
    hooks on fake tensors, whose data pointers the scope would read; strict export fails on
    this function's mark, with its reason)."""
    raise _C.LayerstreamError(_NOT_EXPORTED)


class _Scope(threading.local):
    """One thread's scope (Note [One scope per thread]): its call depth, the saved-tensor
    hooks it entered, the model's storages taken at its call, and the frame of the call
    that opened it."""

    def __init__(self):
        self.depth, self.context, self.held, self.caller = 0, None, set(), None


class ActivationOffload:
    """The saved-tensor hooks around the model's forward (forward pre-hook and an
    always-called forward hook on the root module, and on its entry modules: _ScopeBelow).

    Note [One scope per thread]
    torch keeps saved-tensor hooks per thread, and so does this object: the depth and
    the entered hooks are the calling thread's (_Scope). Calls of one model from several
    threads take turns (Note [Calls of one offloaded model take turns]), but the turn
    passes on in the forward hook registered before ours, so the next thread's call
    begins before this one's _exit: with one depth for all threads it found the depth
    at 1 and opened no scope (a call not offloaded), then left the first thread's
    hooks on its own thread (torch's assertion that the hooks stack is not empty, and
    a thread whose every later save went to this engine)."""

    def __init__(self, engine, device_budget: int):
        self.engine, self.device_budget = engine, device_budget
        self._scope = _Scope()
        self._held = set()  # storages of the model's parameters and buffers, at the newest call
        self._root = self._forward = None  # the model and the forward install() set on it
        self._warned_hooks = False  # Note [Other saved-tensor hooks around the model]

    def pack(self, t: torch.Tensor):
        engine = self.engine  # read once: detach() may clear it meanwhile
        if engine is None:
            return self._pass_through(t)
        # Held by the model anyway (a resident weight, or a view of it such as the
        # transposed weight a linear saves): a copy would free nothing. Not dense
        # (sparse, nested, a wrapper subclass such as DTensor): left as it is.
        # (A backward inside the forward packs on autograd's threads, which torch gives
        # the caller's hooks and not our _Scope: the newest call's storages then.)
        held = self._scope.held if self._scope.depth else self._held
        if (isinstance(t, nn.Parameter) or t.layout != torch.strided or t.is_nested
                or is_traceable_wrapper_subclass(t) or t.device.type == "meta"
                or t.untyped_storage().data_ptr() in held):
            return _Kept(t)
        # Ctrl-C: once the StashedActivation owns the token (Note [A Ctrl-C as a C++ call
        # returns]); it drops the token in C++ when autograd frees the graph (no Python runs there).
        with held_interrupts():
            token = engine.stash_activation(t)
            saved = _Kept(t) if token < 0 else _C.StashedActivation(engine, token)
        return saved

    def unpack(self, saved):
        # Under saved-tensor hooks torch skips its version check: the engine's restore
        # and _Kept keep it (check_saved_version).
        return saved.unpack() if isinstance(saved, _Kept) else saved.engine.restore_activation(saved.token)

    def _pass_through(self, t: torch.Tensor) -> _Kept:
        """pack() once detached (Note [Hooks left on another thread]): the tensor saved as
        plain autograd saves it (its data, without its autograd history: an output holding
        its own node is a cycle that a forward without backward never frees), and these
        hooks taken off this thread when they are on top of its stack."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] == self.pack:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        return _Kept(t)

    def _enter(self, module, args):
        if torch.compiler.is_exporting():
            _not_exported()
        if torch.compiler.is_compiling():
            _scope_outside_graphs(self._open, module)
        else:
            self._open(module)

    @property
    def _depth(self) -> int:
        """This thread's depth of calls of the model (Note [One scope per thread])."""
        return self._scope.depth

    def _open(self, module) -> None:
        scope = self._scope
        if self._depth and not self._entering_call_running():
            self.close()  # Note [An interrupted forward's scope]
        if scope.depth == 0 and not self._in_charge():
            return  # Note [Other saved-tensor hooks around the model]
        if scope.depth == 0:
            scope.caller = _call_frame()
            self.engine.begin_activations(self.device_budget)
            scope.held = self._held = {t.untyped_storage().data_ptr()
                                       for t in (*module.parameters(), *module.buffers()) if t.device.type != "meta"}
            scope.context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            scope.context.__enter__()
        scope.depth += 1

    def _in_charge(self) -> bool:
        """Whether a call of the model opens this thread's scope.

        Note [Other saved-tensor hooks around the model]
        Hooks entered around the model's call are the caller's: torch.utils.checkpoint
        around the whole model (non-reentrant: its hooks drop every save and the
        backward recomputes them) or save_on_cpu. Ours entered on top of them took every
        save, and the checkpoint then kept them all and recomputed nothing (with a device
        budget they all stayed on the device), so the call is left to them, with a
        warning. A call inside a backward (the reentrant checkpoint's recomputation of
        the whole model) saves for that backward only: offloaded, its tensors went to the
        host and straight back. Checkpointed blocks inside the model are unaffected: our
        scope is entered first, at the model's call, the checkpoint's hooks inside it.
        Another offloaded model's scope on top (or a detached one's, Note [Hooks left on
        another thread]) is layerstream's: ours is entered over it, as before."""
        if torch._C._current_graph_task_id() != -1:
            return False
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or isinstance(getattr(top[0], "__self__", None), ActivationOffload):
            return True
        if not self._warned_hooks:
            self._warned_hooks = True
            warnings.warn(
                "layerstream: the offloaded model was called under other saved-tensor hooks (torch.utils.checkpoint "
                "around the whole model, or torch.autograd.graph.save_on_cpu): those keep what the call saves, and "
                "activations= offloads none of it. Checkpoint the model's blocks instead (e.g. "
                "model.gradient_checkpointing_enable()), not the whole model", RuntimeWarning, stacklevel=4)
        return False

    def _exit(self, module, args, output):
        if torch.compiler.is_compiling():
            _scope_outside_graphs(self._leave)
        else:
            self._leave()

    def _leave(self) -> None:
        scope = self._scope
        if scope.depth == 0:  # its scope was closed as interrupted (close()), or its pre-hook did not run
            return
        scope.depth -= 1
        if scope.depth == 0:
            context, scope.context, scope.caller = scope.context, None, None
            scope.held = set()
            context.__exit__(None, None, None)

    def _entering_call_running(self) -> bool:
        """Whether the call of the model that opened this thread's scope is still on its
        stack (a call of the model inside its own forward), rather than unwound."""
        frame = self._scope.caller
        f = sys._getframe()
        while f is not None and f is not frame:
            f = f.f_back
        return f is not None

    def close(self) -> None:
        """Closes this thread's scope if its forward never reached the forward hook (also
        detach()).

        Note [An interrupted forward's scope]
        torch runs a module's always-called forward hooks when its forward raises an
        Exception, not a KeyboardInterrupt (Ctrl-C in a notebook) or another
        BaseException, so such a forward leaves the saved-tensor hooks entered: every
        tensor autograd saves in this thread, in any model, would still go through this
        engine. The next call of the model sees the scope of a call no longer on the
        stack and closes it first; detach() closes it too (on another thread: Note
        [Hooks left on another thread]). Until then other saves are offloaded (their
        values unchanged). torch keeps the hooks as a stack: the scope is popped only
        when it is on top, else it is left there with a warning (a scope pushed after it
        was not closed either)."""
        scope = self._scope
        context, scope.context, scope.caller = scope.context, None, None
        scope.depth, scope.held = 0, set()
        if context is None:
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] == self.pack:
            context.__exit__(None, None, None)
        else:
            warnings.warn("layerstream: the activation offload of an interrupted forward is under another "
                          "saved_tensors_hooks scope that was not closed either; it stays installed until "
                          "that one is closed", RuntimeWarning, stacklevel=3)

    def remove(self) -> None:
        """As a hook handle: detach() takes back the forward install() set and closes a
        scope left open (close()).

        Note [Hooks left on another thread]
        close() can close only the calling thread's scope: torch lets a thread pop only
        its own saved-tensor hooks. A forward interrupted on another thread (Note [An
        interrupted forward's scope]) left ours entered there, and after detach() that
        thread's next call of the model, which would close them, never comes: every
        save on it, in any model, went to the detached engine ("this layerstream handle
        was detached"), and its hooks kept the engine alive. So detach() lets go of the
        engine and of every thread's scope (the frame of the interrupted call, which
        holds the model), and pack() then passes each tensor through as plain autograd
        saves it and pops the hooks once they are on top of that thread's stack: its
        first save after detach() does. Until then (a thread that saves nothing more)
        they stay on its stack, with this object, which no longer holds the engine."""
        self.close()
        self.engine, self._scope, self._held = None, _Scope(), set()
        root, self._root = (self._root() if self._root is not None else None), None
        if root is not None and root.__dict__.get("forward") is self._forward:
            del root.__dict__["forward"]
        self._forward = None

    def install(self, model: nn.Module, entries: Sequence[nn.Module] = ()) -> List:
        """The hook handles, and this object as one (removed by Handle.detach()): on the
        model, and (eager calls only) on its `entries` (_calls.entry_modules).

        Note [Compiled before offload]
        torch.compile does not guard on a module's hooks (torch._dynamo.config.
        skip_nnmodule_hook_guards): a model compiled before offload() (or another
        model of its class compiled first: the graphs are per class) kept its graph
        without our hooks, and its compiled calls offloaded nothing. Dynamo does guard
        on whether the model's __dict__ holds "forward" (nn.Module's call reads
        self.forward), so the model's own forward is put there (an _OwnForward, which
        reads as the bound method): every graph made
        before no longer matches, and the model is traced again with its hooks.
        detach() takes it back. A forward already there (a streamed root layer's, a
        wrapper's) is left as it is: Dynamo traces such a model again anyway. It and
        this object reach the model weakly (a bound method in its __dict__ was a cycle
        that kept a dropped model and its engine until gc)."""
        handles = [model.register_forward_pre_hook(self._enter),
                   model.register_forward_hook(self._exit, always_call=True), self]
        for m in entries:
            handles += [m.register_forward_pre_hook(_ScopeBelow(self, True)),
                        m.register_forward_hook(_ScopeBelow(self, False), always_call=True)]
        if "forward" not in model.__dict__:
            self._root, self._forward = weakref.ref(model), _OwnForward(type(model).forward, model)
            model.__dict__["forward"] = self._forward
        return handles


class _ScopeBelow(_DroppedInCopies):
    """The activation scope's hooks on an entry module below the root (Note [Calls that
    enter the model below its root] in _calls.py), eager calls only: inside a call of
    the model the scope only nests."""

    __slots__ = ("_offload", "_opens")

    def __init__(self, offload: ActivationOffload, opens: bool):
        self._offload, self._opens = offload, opens

    def __call__(self, module, args, output=None):
        if not torch.compiler.is_compiling():
            if self._opens:
                self._offload._open(module)
            else:
                self._offload._leave()


def parse_activations(value, parse_bytes) -> int:
    """offload(activations=...): "host" = every saved tensor that can goes to the host (a
    device budget of 0), a size = that many bytes of them stay on the device."""
    if isinstance(value, str) and value == "host":
        return 0
    try:
        budget = parse_bytes(value)
    except (ValueError, TypeError, RuntimeError):  # LayerstreamError is a RuntimeError
        budget = -1
    if budget < 0:
        raise ValueError(f"activations={value!r}: use None (off), 'host', or a device budget for saved "
                         f"activations such as '8GiB' or a number of bytes")
    return budget
