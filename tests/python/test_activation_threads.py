"""offload(activations=...) and threads other than the one that detaches: the saved-tensor
hooks a forward interrupted there left on it (python/layerstream/_activations.py, Note
[Hooks left on another thread])."""
from __future__ import annotations

import copy
import gc
import queue
import threading
import weakref

import pytest
import torch
import torch.nn as nn

import layerstream
from test_activations import _Interrupt



def _mlp():
    return nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.Tanh())


class _Worker:
    """One thread that runs what it is given, in turn (its saved-tensor hooks persist
    between calls, as a thread pool's do). Returns the result, or the name of what the
    call raised (not the exception: its traceback's frames would hold the model)."""

    def __init__(self):
        self._calls, self._results = queue.Queue(), queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while (fn := self._calls.get()) is not None:
            try:
                self._results.put(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the test
                self._results.put(type(e).__name__)
            del fn

    def __call__(self, fn):
        self._calls.put(fn)
        return self._results.get(timeout=60)

    def stop(self):
        self._calls.put(None)
        self._thread.join(60)


def _hooks_on_top():
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def test_after_detach_a_thread_whose_forward_was_interrupted_saves_as_plain_torch():
    """A forward of the offloaded model on another thread, interrupted by Ctrl-C, leaves
    the activation hooks entered on that thread; detach() runs on the main thread. Then
    the engine and the model are freed (reference counting alone), and a plain resident
    model on that thread trains with gradients equal to the run without layerstream,
    leaving no hooks there. Before, detach() closed only its own thread's scope: that
    thread's every later save went to the detached engine (LayerstreamError "this
    layerstream handle was detached", in a model that never was offloaded), and its hooks
    (and the interrupted call's frame) kept the engine and the model alive."""
    worker = _Worker()
    was = gc.isenabled()
    gc.disable()
    try:
        stop = _Interrupt()
        model = nn.Sequential(*_mlp()[:2], stop, *_mlp()[2:])
        handle = layerstream.offload(model, device="sim", activations="host")
        engine, dropped = weakref.ref(handle._engine), weakref.ref(model)
        x = torch.randn(128, 256)
        stop.armed = True
        assert worker(lambda: model(x)) == "KeyboardInterrupt"
        assert worker(_hooks_on_top)  # left there: torch ran no forward hook
        handle.detach()
        del handle, model, stop
        assert engine() is None and dropped() is None

        torch.manual_seed(0)
        other = _mlp()
        ref = copy.deepcopy(other)
        xo = torch.randn(128, 256, requires_grad=True)
        xr = xo.detach().clone().requires_grad_()

        def train():
            y = other(xo)
            y.square().sum().backward()
            return y

        y = worker(train)
        assert isinstance(y, torch.Tensor), y
        yr = ref(xr)
        yr.square().sum().backward()
        assert torch.equal(y, yr)
        assert torch.equal(xo.grad, xr.grad)
        for p, q in zip(other.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
        assert not worker(_hooks_on_top)
    finally:
        if was:
            gc.enable()
        worker.stop()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
