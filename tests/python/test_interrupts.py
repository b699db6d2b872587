"""Signals whose handlers raise (Ctrl-C, a SIGALRM timeout) landing inside the steps
that change a model or an optimizer's states in several places: each is held until
the step is done (or undone), at every point it can land (docs/design/torch-glue.md,
"Interrupted steps"). The points are enumerated, not timed: a profile hook raises the
signal at the n-th event, where CPython runs the handler of a signal that came just
before (signal.raise_signal runs it at once)."""
import contextlib
import copy
import signal
import sys

import pytest
import torch
import torch.nn as nn

import layerstream
from ctrl_c import signal_at as _signal_at
from layerstream.optim import Adafactor


def _stacked(n=3, d=16):
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(n) for m in (nn.Linear(d, d), nn.Tanh())])


# ------------------------------------------------ an overlapped optimizer step's counts
@pytest.mark.parametrize("returning", ["wait", "settle"])
def test_a_ctrl_c_as_an_overlapped_step_settles_lands_after_its_counts(returning):
    """Adafactor under opt.overlap(): the layers are stepped during the backward and
    step() counts those steps in their states after the plan's wait() and settle(). A
    Ctrl-C as either returned left the counts behind the steps (the plan already taken),
    so every later step's relative lr and decay were one step off, silently. Held now:
    raised once counted; re-running the step and training on gives the uninterrupted
    run's numbers and counts."""
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def train(interrupt_at=None):
        model = _stacked()
        h = layerstream.offload(model, device="sim")
        opt = Adafactor(model.parameters())
        for i, x in enumerate(xs):
            with opt.overlap(h):
                model(x).square().mean().backward()
            if i == interrupt_at:
                with _signal_at("c_return", returning) as sent, pytest.raises(KeyboardInterrupt):
                    opt.step()
                assert sent
                assert {opt.state[p]["step"] for p in model.parameters()} == {i + 1}
            opt.step()  # re-run (nothing left to step here: every parameter streams)
            opt.zero_grad()
        h.detach()
        return [p.detach().clone() for p in model.parameters()], [opt.state[p]["step"] for p in model.parameters()]

    want, want_steps = train()
    got, got_steps = train(interrupt_at=1)
    assert got_steps == want_steps == [4] * 6
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_ctrl_c_as_a_refused_overlapped_step_is_taken_back_lands_after_its_counts():
    """step() refuses an lr changed since the overlapped backward and aborts its plan: the
    layers stepped without speculation keep that step, which Adafactor counts after
    abort(). A Ctrl-C as abort() returned left them stepped and uncounted. Held now: the
    KeyboardInterrupt comes after the counts (each changed weight counts one step)."""
    model = _stacked()
    h = layerstream.offload(model, device="sim")
    opt = Adafactor(model.parameters(), lr=1e-2, relative_step=False)
    before = [p.detach().clone() for p in model.parameters()]
    with opt.overlap(h):
        model(torch.randn(4, 16)).square().mean().backward()
    opt.param_groups[0]["lr"] = 2e-2
    with _signal_at("c_return", "abort") as sent, pytest.raises(KeyboardInterrupt):
        opt.step()
    assert sent
    for p, b in zip(model.parameters(), before):
        assert not torch.equal(p, b) and opt.state[p]["step"] == 1
    h.detach()


# ------------------------------------------------ offload() and detach() under a timeout's signal
class _Timeout(Exception):
    """What a SIGALRM timeout handler raises (pytest-timeout's signal method, timeout-decorator)."""


# Sent as SIGUSR1, whose handler raises as a SIGALRM timeout's would (SIGALRM itself may
# be a test runner's own timer).
_SIGNAL = signal.SIGUSR1


@contextlib.contextmanager
def _timeout_handler():
    def raise_timeout(signum, frame):
        raise _Timeout()
    previous = signal.signal(_SIGNAL, raise_timeout)
    try:
        yield
    finally:
        signal.signal(_SIGNAL, previous)


# Counted: the events of layerstream's frames (calls, returns, the C calls they make, but
# Python's builtins and containers' methods: isinstance(), dict.items(), ...). Not the
# returns of offload() and of its last step (_attach): an exception there is offload()'s
# caller's, as after any call (Note [A signal lands between steps]); nor the returns of
# __enter__ methods: the hook would raise between __enter__ and its with-block, where
# CPython runs no signal handler (it does at the block's first instruction, which runs
# __exit__); nor its first steps, which only read the model (discovery, formats, host plan).
_READ_ONLY = ("_discovery.py", "_formats.py", "_host_plan.py", "_prequant.py")


def _counted(frame, event, arg) -> bool:
    import builtins
    import os
    path = frame.f_code.co_filename
    if not path.startswith(os.path.dirname(layerstream.__file__)) or os.path.basename(path) in _READ_ONLY:
        return False
    if event.startswith("c_"):
        owner = getattr(arg, "__self__", None)
        return not (owner is builtins or isinstance(owner, (dict, list, set, tuple, str)) or arg is signal.getsignal)
    return not (event == "return" and frame.f_code.co_name in ("offload", "_attach", "__enter__"))


def _run_signalled(fn, n: int):
    """fn() with the signal raised at its n-th counted event (0: none): (fn's result or None,
    the _Timeout it raised or None, the events counted)."""
    counted = []
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(_SIGNAL)

    def hook(frame, event, arg):
        if _counted(frame, event, arg):
            counted.append(event)
            if len(counted) == n:
                signal.raise_signal(_SIGNAL)
    sys.setprofile(hook)
    try:
        return fn(), None, len(counted)
    except _Timeout as e:
        return None, e, len(counted)
    finally:
        sys.setprofile(None)
        # Wherever the signal landed, a later Ctrl-C raises and every handler is back: a
        # timeout's exception as a holder's __exit__ was entered (or, before, as a
        # generator's holder set SIGINT's) left the recorder in place, and every later
        # Ctrl-C was swallowed (Note [A signal lands between steps]).
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(_SIGNAL)) == handlers, n


def _left_on(model, ref) -> list:
    """What offload() left on `model` that `ref` (its copy from before) does not have."""
    left = []
    for name, m in model.named_modules():
        left += [f"{name}.{k}" for k in ("forward", "_apply", "_layerstream_handle", "__deepcopy__", "to", "cpu",
                                          "cuda") if k in m.__dict__]
        left += [f"{name}: hooks"] if m._forward_pre_hooks or m._forward_hooks else []
        left += [f"{name}.{k}: {type(p).__name__}" for k, p in m._parameters.items()
                 if type(p) is not nn.Parameter or hasattr(p, "_is_memory_managed")]
    if not all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters())):
        left.append("values")
    return left


def test_a_timeout_signal_anywhere_in_offload_lands_with_the_model_as_it_was():
    """A SIGALRM handler's exception (a timeout) landing in offload() as a C++ call
    returned (engine.add_linear: before the layer was recorded) left layers the undo did
    not know ("offload() failed and undoing it failed too: detach needs one device per
    layer"), forwards streaming from a dropped engine: a model neither plain nor
    offloaded. Only Ctrl-C was held. Now every signal with a Python handler is held and
    lands between layers or at the end, inside the undo: at every event of offload()'s
    code it raises, the model as it was, and offload() works again."""
    model = _stacked()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 16)
    with torch.no_grad():
        want = ref(x)

    def offload():
        return layerstream.offload(model, device="sim", activations="host")
    with _timeout_handler():
        h, _, events = _run_signalled(offload, 0)
        h.detach()
        assert events > 100
        for n in range(1, events + 1):
            h, raised, _ = _run_signalled(offload, n)
            assert raised is not None and _left_on(model, ref) == [], n
        h = offload()
        with torch.no_grad():
            assert torch.equal(model(x), want)
        h.detach()
        assert _left_on(model, ref) == []


def test_a_timeout_signal_anywhere_in_detach_lands_after_it():
    """detach() held only Ctrl-C: a timeout's exception as engine.detach() returned left
    the handle attached to a detached engine ("this layerstream handle was already
    detached" on the next detach) and the modules streaming from it ("the weight of
    streamed layer '0' was replaced or moved"). At every event of detach()'s code now:
    raised before it began, the handle still works; else once it is done: a plain model
    that offloads again."""
    model = _stacked(5)
    ref = copy.deepcopy(model)
    x = torch.randn(3, 16)
    with torch.no_grad():
        want = ref(x)

    def offload():  # 4 layers streamed, one kept resident
        return layerstream.offload(model, device="sim", activations="host", budget=5130)
    with _timeout_handler():
        h = offload()
        assert len(h.layers) == 4
        _, _, events = _run_signalled(h.detach, 0)
        assert events > 50
        for n in range(1, events + 1):
            h = offload()
            _, raised, _ = _run_signalled(h.detach, n)
            assert raised is not None, n
            if h._engine is not None:  # landed before detach() began
                with torch.no_grad():
                    assert torch.equal(model(x), want), n
                h.detach()
            assert _left_on(model, ref) == [], n
    h = offload()
    with torch.no_grad():
        assert torch.equal(model(x), want)
    h.detach()


class _Planted(BaseException):
    pass


@pytest.mark.parametrize("step", ["put_forward_back", "remove_subtree_checks", "CallHooks.remove",
                                  "ResidentQuantized.remove"])
def test_a_step_of_detach_that_raises_after_the_engine_let_go_does_not_stop_the_others(monkeypatch, step):
    """Once engine.detach() returned there is no way back, yet an exception from one of
    the steps after it (any BaseException: a planted one here, once, after the step did
    its work) ended detach() there: the modules after it kept streaming from the detached
    engine, the handle stayed attached to it, and no call could finish. Now every step
    runs and the exception propagates after them: the handle detached, the model plain."""
    import layerstream._handle as handle_module
    import layerstream._calls as calls_module
    where = calls_module if step.startswith("CallHooks.") else handle_module
    owner, name = (handle_module, step) if "." not in step else (getattr(where, step.split(".")[0]),
                                                                 step.split(".")[1])
    original, raised = getattr(owner, name), []

    def once_then_raise(*args, **kw):
        result = original(*args, **kw)
        if not raised:
            raised.append(True)
            raise _Planted()
        return result
    model = _stacked()
    ref = copy.deepcopy(model)
    h = layerstream.offload(model, device="sim")
    monkeypatch.setattr(owner, name, once_then_raise)
    with pytest.raises(_Planted):
        h.detach()
    monkeypatch.undo()
    assert h._engine is None and _left_on(model, ref) == []
    h = layerstream.offload(model, device="sim")
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    h.detach()
