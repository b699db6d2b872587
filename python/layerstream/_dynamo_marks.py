"""torch.compile's marks on layerstream's functions, put on when torch._dynamo is imported.

Note [Compile marks without importing dynamo]: torch.compiler.assume_constant_result and
torch.compiler.disable import torch._dynamo when they are called (about 2.5 of the 5.5 s
an `import layerstream` took on CI's machine), yet only dynamo reads their marks, while it
traces, and it traces only after it has been imported (torch.compile imports it; torch
itself imports it lazily for the same reason). So a mark is put on when torch._dynamo's
import finishes: a finder on sys.meta_path wraps that one import, then leaves. A marked
function is looked up as a module global at each call, so the wrapper a mark returns
(torch.compiler.disable's) replaces the function in its module before any trace.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
from typing import Callable, List, Tuple

_DYNAMO = "torch._dynamo"
# (module name, function name, mark): mark(torch._dynamo, fn) -> what the module holds.
_pending: List[Tuple[str, str, Callable]] = []
_lock = threading.Lock()


def when_compiled(mark: Callable) -> Callable:
    """Decorator: `mark(dynamo, fn)` (dynamo: the torch._dynamo module) returns what the
    function's module holds under its name once torch._dynamo is imported; until then
    the function is left as it is."""
    def decorate(fn):
        with _lock:
            if _DYNAMO not in sys.modules:
                _pending.append((fn.__module__, fn.__name__, mark))
                if _finder not in sys.meta_path:
                    sys.meta_path.insert(0, _finder)
                return fn
        # Imported (or being imported by another thread: import_module waits for it).
        return mark(importlib.import_module(_DYNAMO), fn)
    return decorate


def assume_constant_result(fn):
    """torch.compiler.assume_constant_result(fn), put on when dynamo is imported."""
    return when_compiled(lambda dynamo, f: dynamo.assume_constant_result(f))(fn)


def disable(reason: str) -> Callable:
    """torch.compiler.disable(fn, reason=reason), put on when dynamo is imported (the
    function is replaced in its module by the disabled wrapper)."""
    return when_compiled(lambda dynamo, f: dynamo.disable(f, reason=reason))


def _apply(dynamo) -> None:
    with _lock:
        todo = list(_pending)
        _pending.clear()
    for module, name, mark in todo:
        mod = sys.modules[module]
        setattr(mod, name, mark(dynamo, getattr(mod, name)))


class _Finder(importlib.abc.MetaPathFinder):
    """Finds torch._dynamo as the other finders do, and runs _apply after its module runs."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _DYNAMO:
            return None
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _apply(module)

        spec.loader.exec_module = exec_module  # this module's own loader object
        return spec


_finder = _Finder()
