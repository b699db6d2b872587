"""Ctrl-C held back over the steps that change a model in several places at once.

offload() attaches layer by layer, and detach(), suspend() and resume() change the
engine and then the modules. Most of their time is one C++ call, and Python runs a
SIGINT handler when such a call returns: a KeyboardInterrupt would land between the
engine's change and the modules', leaving a model neither streamed nor plain, with
no handle able to finish either (docs/design/torch-glue.md, "Interrupted steps").
Inside ``held_interrupts()`` the handler only records the signal; the previous
handler runs when the block ends, so the interrupt is raised there, after the step
is done or undone. Only in the main thread (where handlers run) and only over a
Python handler (the default raises KeyboardInterrupt); a no-op elsewhere.
"""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def held_interrupts():
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if not callable(previous):  # another thread, SIG_IGN, SIG_DFL or a handler set outside Python
        yield
        return
    received = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            previous(signal.SIGINT, received[0])
