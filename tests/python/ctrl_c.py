"""A Ctrl-C at a chosen point, for the tests of what layerstream does with one (shared by
test_interrupts, test_loose_ends and the several-process dist_worker)."""
from __future__ import annotations

import contextlib
import signal
import sys


@contextlib.contextmanager
def signal_at(event: str, name: str, signum=signal.SIGINT):
    """While the block runs: `signum` raised once, at the first profile `event` ('c_return',
    'return') of a function called `name` (as a C function returns, CPython runs the
    handler of a Ctrl-C that came during it). Yields a list that holds True once it was sent."""
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
