"""The hooks offload(activations=...) puts on the model (python/layerstream/_activations.py):
what torch.compile sees of them, and which thread's scope they open and close."""
from __future__ import annotations

import copy
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
            out = model(x)
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
