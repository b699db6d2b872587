"""The hooks offload(activations=...) puts on the model (python/layerstream/_activations.py):
what torch.compile sees of them, and which thread's scope they open and close."""
from __future__ import annotations

import copy
import functools
import threading

import pytest
import torch
import torch.nn as nn

from conftest import assert_grads_match


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _mlp(width=256):
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 8))


def _wrapped(forward, *args, **kwargs):
    return forward(*args, **kwargs)


def _plain_saves_offloaded(handle) -> bool:
    """Whether a plain tensor op on this thread, outside any model, sends its saved
    tensor (256 KiB) to `handle`'s engine: our hooks left installed on the thread."""
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return True
    handle.synchronize()
    before = handle.stats()["activation_d2h_bytes"]
    y = torch.randn(256, 256, requires_grad=True).tanh()  # saves its output
    handle.synchronize()
    del y
    return handle.stats()["activation_d2h_bytes"] != before


@pytest.mark.parametrize("how", ["torch.compile before offload", "module.compile before offload",
                                 "a wrapped forward compiled before offload",
                                 "a resident model of its class compiled first"])
def test_a_model_compiled_before_offload_offloads_its_activations(offload_sim, how):
    """offload(activations="host") of a model compiled before it (or compiled after a
    resident model of its class was: Dynamo's graphs are per class), every layer resident:
    the compiled call sends its saved tensors to the host, and the numbers equal the eager
    resident model's. Before, Dynamo kept the graph traced without our hooks (it does not
    guard on a module's hooks: skip_nnmodule_hook_guards), so the compiled call offloaded
    nothing (activation_d2h_bytes 0), silently; only torch._dynamo.reset() helped."""
    torch.manual_seed(0)
    model = _mlp()
    ref, other = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(128, 256)
    if how == "torch.compile before offload":
        step = torch.compile(model, backend="aot_eager")
        step(x).square().sum().backward()
    elif how == "a wrapped forward compiled before offload":  # a forward offload() leaves as it is
        model.forward = functools.partial(_wrapped, model.forward)
        step = torch.compile(model, backend="aot_eager")
        step(x).square().sum().backward()
    elif how == "module.compile before offload":
        model.compile(backend="aot_eager")
        step = model
        step(x).square().sum().backward()
    else:
        torch.compile(other, backend="aot_eager")(x).square().sum().backward()
    model.zero_grad(set_to_none=True)
    handle = offload_sim(model, budget="4MiB", activations="host")
    assert "(3 resident, 0 streamed)" in handle.plan  # no streamed layer's forward retraces it
    if how == "a resident model of its class compiled first":
        step = torch.compile(model, backend="aot_eager")
    for _ in range(2):
        y, yr = step(x), ref(x)
        handle.synchronize()
        sent = handle.stats()["activation_d2h_bytes"]
        assert sent > 0
        assert torch.equal(y, yr)
        y.square().sum().backward()
        yr.square().sum().backward()
        assert handle.stats()["activation_h2d_bytes"] > 0
        assert_grads_match(model, ref, exact=True)
    if how == "a resident model of its class compiled first":
        torch.compile(other, backend="aot_eager")(x).square().sum().backward()  # not offloaded
        handle.synchronize()
        assert handle.stats()["activation_d2h_bytes"] == sent
    handle.detach()
    assert ("forward" in model.__dict__) == (how == "a wrapped forward compiled before offload")
    assert torch.equal(step(x), ref(x))


def _interleaved_calls(offload_sim, monkeypatch, first_ends):
    """Two threads call one offloaded model (under grad), and the second thread's call
    begins in the window between the first call giving back its turn (the turn's
    forward hook) and its activation scope ending (ActivationOffload._exit), which
    events make certain (a GIL switch there does the same by chance). `first_ends`:
    whether the first call's _exit runs before the second call's (else after it).
    Returns (handle, bytes one call offloads, errors, threads whose hooks stayed)."""
    from layerstream import _activations

    torch.manual_seed(0)
    model = _mlp()
    handle = offload_sim(model, activations="host")
    x = torch.randn(128, 256)
    y = model(x)
    handle.synchronize()
    per_call = handle.stats()["activation_d2h_bytes"]
    assert per_call > 0
    del y

    first, second = threading.Event(), threading.Event()  # first call in; second call in
    first_left, second_left = threading.Event(), threading.Event()
    names = {}
    enter, exit_ = _activations.ActivationOffload._enter, _activations.ActivationOffload._exit

    def slow_enter(self, module, args):
        enter(self, module, args)
        (first if names.get(threading.get_ident()) == "a" else second).set()

    def slow_exit(self, module, args, output):
        me = names.get(threading.get_ident())
        if me == "a":
            second.wait(10)  # the second call has begun: the turn was given back
            if not first_ends:
                second_left.wait(10)
        elif me == "b" and first_ends:
            first_left.wait(10)
        try:
            return exit_(self, module, args, output)
        finally:
            (first_left if me == "a" else second_left).set()

    monkeypatch.setattr(_activations.ActivationOffload, "_enter", slow_enter)
    monkeypatch.setattr(_activations.ActivationOffload, "_exit", slow_exit)
    # The hooks are bound at install: offload again with the slow ones.
    handle.detach()
    handle = offload_sim(model, activations="host")
    errors, leaked = [], []
    both_called, one_at_a_time = threading.Barrier(2, timeout=30), threading.Lock()

    def call(name):
        names[threading.get_ident()] = name
        try:
            out = model(x.clone())  # its own input: a save of the other call's x would share its entry
            del out
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(f"{name}: {type(e).__name__}: {e}")
        both_called.wait()  # the other call's saves do not count as this thread's
        with one_at_a_time:
            if _plain_saves_offloaded(handle):
                leaked.append(name)

    a = threading.Thread(target=call, args=("a",))
    a.start()
    assert first.wait(10)
    b = threading.Thread(target=call, args=("b",))
    b.start()
    a.join(30)
    b.join(30)
    assert not a.is_alive() and not b.is_alive()
    handle.synchronize()
    return handle, per_call, errors, leaked


@pytest.mark.parametrize("first_ends", [True, False], ids=["first-scope-ends-first", "second-call-ends-first"])
def test_a_call_beginning_as_another_thread_s_call_ends_opens_its_own_scope(offload_sim, monkeypatch, first_ends):
    """Two threads calling one model offloaded with activations="host": the turn passes
    on in the forward hook registered before the activation scope's, so the second
    thread's call can begin before the first call's scope ends. Both calls offload their
    saved tensors, neither raises, and no thread keeps our hooks installed afterwards.
    Before, the scope's depth was one for all threads: the second call found it at 1 and
    opened no scope (its saves not offloaded); when the first call's scope ended after
    the second call's pre-hook, the second thread left it, on its own thread: torch's
    "is_initialized && !tls.stack.empty() INTERNAL ASSERT FAILED" (SavedTensorHooks.cpp),
    and the first thread kept our pack hook for good (its every later save, in any model,
    went to this engine, and failed once detached)."""
    handle, per_call, errors, leaked = _interleaved_calls(offload_sim, monkeypatch, first_ends)
    assert errors == []
    assert leaked == []
    assert handle.stats()["activation_d2h_bytes"] == 2 * per_call
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_the_forward_offload_sets_on_the_model_reads_as_its_bound_method(offload_sim):
    """install() puts the model's forward in its __dict__ (Note [Compiled before
    offload]); as a bound method it was a cycle through the model, which kept a dropped
    model and its engine until gc (test_del_frees). What stands there now reaches the
    model weakly and still reads as the bound method: its signature (transformers'
    Trainer keeps the dataset columns it names), __self__, __func__ and __code__
    (torch.export reads it)."""
    import inspect

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, attention_mask=None, *, scale=1.0):
            return self.lin(x) * scale

    model = Masked()
    want = inspect.signature(model.forward)
    handle = offload_sim(model, activations="host")
    fwd = model.__dict__["forward"]
    assert inspect.signature(model.forward) == want
    assert fwd.__self__ is model and fwd.__func__ is Masked.forward and fwd.__code__ is Masked.forward.__code__
    import gc
    assert not any(o is model for o in gc.get_referents(fwd))  # weakly
    handle.detach()
    assert "forward" not in model.__dict__
