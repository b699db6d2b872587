"""Ctrl-C (and, over the one-off steps, every signal with a Python handler: HeldSignals,
Note [A signal lands between steps]) held back over the steps that change a model in
several places at once.

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

import signal
import sys
import threading


def held_interrupts() -> "HeldSignals":
    """Ctrl-C (SIGINT) held over the block, which gets the list of those held so far
    (non-empty once one came). A HeldSignals of SIGINT alone: a generator's
    ``signal.signal(...)`` before its ``try`` left SIGINT's recorder in place for good
    when another signal's handler raised just then (a timeout's, Note [A signal lands
    between steps]): every later Ctrl-C was recorded by a block long gone."""
    return HeldSignals((signal.SIGINT,))


# Note [A signal lands between steps]
# A Python signal handler runs in the main thread between two bytecodes (e.g. as a C++
# call returns), and what it raises is raised there: Ctrl-C's KeyboardInterrupt, and a
# timeout's exception (a SIGALRM handler: pytest-timeout's signal method,
# timeout-decorator). offload(), detach(), suspend() and resume() change the engine and
# then the modules; such an exception between the two left a model neither streamed nor
# plain (a layer the engine held and offload()'s undo did not know: "detach needs one
# device per layer", forwards left streamed; a handle whose engine was detached under
# modules still streaming). So those one-off steps hold every signal with a Python
# handler (HeldSignals), as held_interrupts() holds SIGINT: its handler records the
# signal, and the handler it replaced runs once the step is done or undone. The calls on
# the hot paths (a call's turn, a group's fetch, a saved activation, an optimizer kernel)
# hold SIGINT alone: finding the others is a sweep of signal.valid_signals() (0.1 to 0.4
# ms here), too dear per layer call. offload() lets them land between layers (a long
# load still stops within a layer's time) and last inside its undo; detach(), suspend()
# and resume() once done. Main thread only (where handlers run). One
# landing as offload() returns (after the undo's end) is its caller's, as after any call:
# the model stays offloaded, its handle in the layers' _layerstream_handle.
#
# One window no holder closes: a handler can run as __exit__ is entered (CPython checks
# for signals at a function's first instruction), before it puts the handlers back, and
# its exception leaves the with-block with the recorder in place. Every later Ctrl-C was
# then recorded by a block long gone, and swallowed. So the recorder knows the frame that
# held (the first outside this file): a signal that finds it no longer on the stack puts
# the handlers back and runs the one it replaced, as if the block had ended in time.
class HeldSignals:
    """Holds the signals with a Python handler (Note [A signal lands between steps]), or
    those of `signals` that have one: hold(), release() (puts the handlers back and runs
    those of the signals that came, in order, each once), land() (release, then hold
    again); entered: held until exit, the block gets the list of those that came."""

    def __init__(self, signals=None):
        self._signals = signals  # None: every valid signal (a sweep at each hold())
        self._held = {}  # signal -> the handler it had
        self._received = []  # (handler, signal, frame) in order of arrival, each signal once
        self._frame = None  # the frame that holds them (its block: while it runs)

    def __enter__(self):
        try:
            self.hold()
        except BaseException:  # a handler ran while they were being replaced: nothing changed yet
            self.release()
            raise
        return self._received

    def __exit__(self, *exc):
        self.release()

    def _record(self, signum, frame):
        if not self._holding(frame):  # its block ended without putting them back (the Note's window)
            handler = self._held[signum]
            self._frame = None
            self._restore()
            handler(signum, frame)
            return
        if all(s != signum for _, s, _ in self._received):
            self._received.append((self._held[signum], signum, frame))

    def _holding(self, frame) -> bool:
        """Whether the frame that held is on the stack of `frame` (where the signal landed)."""
        while frame is not None:
            if frame is self._frame:
                return True
            frame = frame.f_back
        return False

    def hold(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_code.co_filename == __file__:
            frame = frame.f_back
        self._frame = frame
        for s in signal.valid_signals() if self._signals is None else self._signals:
            handler = signal.getsignal(s)
            # Our recorder is a bound method of this object, made here: kept on it, it
            # was a cycle (each block's HeldSignals was left to the cyclic collector).
            if callable(handler) and getattr(handler, "__self__", None) is not self:
                self._held[s] = handler  # first: _record and _restore look it up
                signal.signal(s, self._record)

    def _restore(self) -> None:
        try:
            while self._held:
                s, handler = next(iter(self._held.items()))
                signal.signal(s, handler)
                del self._held[s]
        finally:
            if self._held:  # a handler put back ran and raised: the others go back too
                self._restore()

    def release(self) -> None:
        try:
            self._restore()
            self._frame = None  # after: a _restore() a signal stopped leaves the recorder knowing its frame
        finally:
            received, self._received = self._received, []
            _run_handlers(received)

    def land(self) -> None:
        try:
            self.release()
        finally:
            self.hold()


def _run_handlers(received: list) -> None:
    """Runs each held signal's handler, all of them even when one raises (the last
    exception raised propagates, the others as its context)."""
    if received:
        handler, signum, frame = received[0]
        try:
            handler(signum, frame)
        finally:
            _run_handlers(received[1:])
