"""What layerstream.optim's public calls need around them, apart from the optimizers:
the stack level of the user's call for its warnings, and overlap()'s context manager
that warns when it is dropped without being entered."""
from __future__ import annotations


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel, called in the function that warns, for the first frame
    outside layerstream and torch: the user's step() call, also through torch.no_grad's
    wrapper or a GradScaler."""
    import sys
    level, f = 1, sys._getframe(1)
    while f is not None and f.f_globals.get("__name__", "").partition(".")[0] in ("layerstream", "torch"):
        f, level = f.f_back, level + 1
    return level


class _EnterOrWarn:
    """A context manager that warns when it is dropped without being entered:
    ``opt.overlap(handle)`` on its own line is a no-op that looks like a setting."""

    __slots__ = ("_cm", "_entered")

    def __init__(self, cm):
        self._cm, self._entered = cm, False

    def __enter__(self):
        self._entered = True
        return self._cm.__enter__()

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

    def __del__(self):
        if not self._entered:
            import warnings
            warnings.warn("layerstream.optim: overlap() was called but not entered, so it does nothing: "
                          "write `with opt.overlap(handle): loss.backward()`", RuntimeWarning, stacklevel=2)
