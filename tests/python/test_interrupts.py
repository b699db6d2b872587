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
from layerstream.optim import Adafactor


@contextlib.contextmanager
def _signal_at(event: str, name: str, signum=signal.SIGINT):
    """While the block runs: `signum` raised once, at the first profile `event` ('c_return',
    'return') of a function called `name`. Yields a list that holds True once it was sent."""
    sent = []

    def hook(frame, ev, arg):
        called = getattr(arg, "__name__", "") if ev.startswith("c_") else frame.f_code.co_name
        if not sent and ev == event and called == name:
            sent.append(True)
            sys.setprofile(None)
            signal.raise_signal(signum)

    sys.setprofile(hook)
    try:
        yield sent
    finally:
        sys.setprofile(None)


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

