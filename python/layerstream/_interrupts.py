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

Note [A Ctrl-C as a C++ call returns]
The same handler run dropped what a C++ call hands back before the caller kept it
where it is released: a tensor group's slot token (Engine.fetch: every slot held
after a few Ctrl-Cs), a saved activation's host copy (stash_activation); and it
split an optimizer kernel's update from the step counts it implies. So those calls
run held up to where their result is owned. A tensor group's call is held whole,
its module's forward included: its context manager's hand-offs (after fetch(), at
the swap back) are windows too, and the forward of one module is short. Locks taken
in Python code (threading.Condition's) are held the same way (_CallTurns). The block
gets the list of the interrupts held so far, non-empty once one came: a wait inside
can stop and let it land (a handler that raises nothing lets the wait go on).
"""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def held_interrupts():
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    received = []
    if not callable(previous):  # another thread, SIG_IGN, SIG_DFL or a handler set outside Python
        yield received
        return
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    try:
        yield received
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            previous(signal.SIGINT, received[0])
