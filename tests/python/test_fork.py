"""An offloaded model in a process forked from the one that offloaded it (os.fork(), a
DataLoader worker, multiprocessing's "fork" start method): refused with a message that
says what to do, never a wait without end. Note [An engine belongs to the process that
made it] (csrc/torch/engine.cpp), Note [Calls of one offloaded model take turns]
(_handle.py)."""
import copy
import gc
import os
import threading
import time
import warnings

import pytest
import torch
import torch.nn as nn

import layerstream

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork() is POSIX only")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(),
                         nn.Linear(64, 128)).requires_grad_(False)


def _offloaded(offload_sim):
    model = _model()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, budget=2 * 128 * 64 * 4 + 2048)
    assert handle.stats()["layers"] == 3, "the layers stream"
    return model, ref, handle


def _in_child(fn, timeout=30.0) -> str:
    """Runs fn() in a forked child; returns what it returned (a string), or fails when
    the child does not end within `timeout` (it is killed)."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a process with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's exit handlers
        try:
            out = fn()
        except BaseException as e:  # noqa: B902 - reported to the parent
            out = f"raised {type(e).__name__}: {e}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout
    while True:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(r)
            pytest.fail(f"the forked child did not end within {timeout:.0f} s")
        time.sleep(0.05)
    with os.fdopen(r, "rb") as f:
        return f.read().decode()


def test_a_forked_child_calling_the_model_is_refused_and_the_parent_goes_on(offload_sim):
    model, ref, handle = _offloaded(offload_sim)
    x = torch.randn(4, 64)
    assert torch.equal(model(x), ref(x))
    said = _in_child(lambda: str(model(x).sum().item()))
    assert said.startswith("raised LayerstreamError") and "forked" in said and "spawn" in said, said
    # a layer called on its own (not through the model's hooks) is refused the same way
    said = _in_child(lambda: str(model[2](torch.randn(4, 128)).sum().item()))
    assert said.startswith("raised LayerstreamError") and "forked" in said, said
    assert torch.equal(model(x), ref(x)), "the parent's engine is unaffected"


def test_a_forked_child_may_drop_the_model():
    """Dropping the model in the child (its last references there) frees nothing of the
    parent's engine (its destruction would join threads that stayed in the parent):
    the child ends."""
    model = _model()
    ref = copy.deepcopy(model)
    handle = layerstream.offload(model, device="sim", budget=2 * 128 * 64 * 4 + 2048)
    assert handle.stats()["layers"] == 3

    def drop():
        nonlocal model, handle
        del model, handle
        gc.collect()
        return "dropped"

    try:
        assert _in_child(drop) == "dropped"
        x = torch.randn(4, 64)
        assert torch.equal(model(x), ref(x))
    finally:
        handle.detach()


def test_a_turn_held_by_a_parents_thread_is_free_in_the_child(offload_sim):
    """A thread of the parent inside a call at the fork holds the model's turn; the child
    has no such thread: its call is refused at once (not after waiting for it)."""
    model, ref, handle = _offloaded(offload_sim)
    inside, leave = threading.Event(), threading.Event()

    def hold(module, args):
        if threading.current_thread().name == "holder":
            inside.set()
            leave.wait(60)

    model[1].register_forward_pre_hook(hold)
    x = torch.randn(4, 64)
    t = threading.Thread(target=lambda: model(x), name="holder")
    t.start()
    try:
        assert inside.wait(30)
        began = time.monotonic()
        said = _in_child(lambda: str(model(x).sum().item()), timeout=30)
        assert said.startswith("raised LayerstreamError") and "forked" in said, said
        assert time.monotonic() - began < 20
    finally:
        leave.set()
        t.join(60)
    assert torch.equal(model(x), ref(x))


def test_a_dataloader_worker_calling_the_model_reports_the_error_to_the_main_process(offload_sim):
    model, _, _ = _offloaded(offload_sim)

    class Encoded(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            with torch.no_grad():
                return model(torch.randn(1, 64))[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        loader = torch.utils.data.DataLoader(Encoded(), batch_size=1, num_workers=1,
                                             multiprocessing_context="fork", timeout=60)
        with pytest.raises(Exception, match="forked") as e:
            next(iter(loader))
    # ('spawn' alone leads into the pickling refusal: the worker offloads a model of its own)
    assert "worker_init_fn" in str(e.value) and "cannot be pickled" in str(e.value)


def test_offload_in_the_child_works(offload_sim):
    """What the message says to do: the child offloads a model of its own."""
    _offloaded(offload_sim)

    def own():
        model = _model()
        ref = copy.deepcopy(model)
        h = layerstream.offload(model, device="sim", budget=2 * 128 * 64 * 4 + 2048)
        x = torch.randn(4, 64)
        ok = h.stats()["layers"] == 3 and torch.equal(model(x), ref(x))
        return "ok" if ok else "differs"

    assert _in_child(own) == "ok"


def test_a_host_optimizer_steps_in_a_forked_child():
    """Note [A forked child gets a pool of its own] (csrc/core/optim/thread_pool.cpp):
    after the parent's steps started the optimizers' thread pool, a child's step ran on
    the parent's workers, which are not in the child, and waited forever. The child's
    step gives the parent's numbers."""
    import hashlib

    import layerstream.optim as lo

    def stepped():
        torch.manual_seed(1)
        p = nn.Parameter(torch.randn(1 << 20))  # many tasks of the pool
        p.grad = torch.randn(1 << 20)
        lo.AdamW([p], lr=1e-2).step()
        return hashlib.sha256(p.detach().numpy().tobytes()).hexdigest()

    here = stepped()  # starts the pool in this process
    assert _in_child(stepped) == here
