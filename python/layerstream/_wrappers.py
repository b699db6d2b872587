"""detach() under wrappers installed after offload(): where a wrapper of a streamed
layer's forward keeps ours, and the layer's own forward put in its place (Note [A
wrapper installed over a streamed forward])."""
from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn

from . import _C

LayerstreamError = _C.LayerstreamError


# Note [A wrapper installed over a streamed forward]
# offload() puts its forward (_Attached.forward) on each streamed module's instance. Code
# that wraps the module's forward after that (accelerate's add_hook_to_module, which keeps
# the forward it wraps in module._old_forward; a callable object or a closure that holds
# it) calls ours from inside its wrapper. detach() undoes only its own forward: where the
# wrapper keeps ours (an attribute of the module, an attribute of a callable or a closure
# cell along the wrapper's chain of functools.partial objects, bound methods, functions
# and __wrapped__), it puts the forward offload() replaced (the module's own: the instance
# forward it had, else its class's, bound) in its place, and the wrapper stays and works;
# removing it afterwards (accelerate's remove_hook_from_module) leaves the module as it was
# before offload(). A wrapper that keeps ours where it cannot be replaced (a partial's
# function or arguments, a bound method's), or where detach() does not find it, would call
# the stale streamed forward after detach(), or be dropped: detach() refuses, before
# anything changes, naming the wrapper.
_WRAPPER_DEPTH = 8  # how deep detach() follows a wrapper's chain


def _wrapper_refs(wrapper, ours) -> tuple:
    """(places, fixed): where `wrapper` (a module's forward installed over `ours`) keeps
    `ours`, each place a function that puts another value there (an attribute, a closure
    cell, a default argument); and the objects that hold it where it cannot be replaced
    (Note [A wrapper installed over a streamed forward]). Modules met on the way are not
    searched (their attributes are the caller's)."""
    places, fixed, seen = [], [], set()

    def in_dict(d, key):
        def put(value):
            d[key] = value
        return put

    def in_cell(cell):
        def put(value):
            cell.cell_contents = value
        return put

    def in_defaults(fn):
        def put(value):
            fn.__defaults__ = tuple(value if d is ours else d for d in fn.__defaults__)
        return put

    def visit(obj, depth):
        if obj is ours or id(obj) in seen or depth > _WRAPPER_DEPTH or isinstance(obj, nn.Module):
            return
        seen.add(id(obj))
        inner = []
        if isinstance(obj, functools.partial):
            inner += [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, types.MethodType):
            inner += [obj.__func__, obj.__self__]
        if any(x is ours for x in inner):
            fixed.append(obj)
        if isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    value = cell.cell_contents
                except ValueError:  # a cell not filled yet
                    continue
                if value is ours:
                    places.append(in_cell(cell))
                else:
                    inner.append(value)
            defaults = obj.__defaults__ or ()
            if any(d is ours for d in defaults):  # def fwd(x, base=module.forward): the loop idiom
                places.append(in_defaults(obj))
            inner += [d for d in defaults if d is not ours]
            kwdefaults = obj.__kwdefaults__ or {}
            places.extend(in_dict(kwdefaults, k) for k, v in kwdefaults.items() if v is ours)
            inner += [v for v in kwdefaults.values() if v is not ours]
        attrs = getattr(obj, "__dict__", None)
        if type(attrs) is dict:  # an instance's or a function's own (a class's is a mappingproxy)
            for key, value in attrs.items():
                if value is ours:
                    places.append(in_dict(attrs, key))
                else:
                    inner.append(value)
        for x in inner:
            # Callables, and plain objects a wrapper keeps its state in (diffusers'
            # HookRegistry: the wrapped forward in a HookFunctionReference's attribute);
            # not tensors, whose __dict__ holds nothing of a wrapper's.
            if callable(x) or (type(getattr(x, "__dict__", None)) is dict and not isinstance(x, torch.Tensor)):
                visit(x, depth + 1)

    visit(wrapper, 0)
    return places, fixed


def _describe_callable(f) -> str:
    """A wrapper as a refusal names it: its function's qualified name."""
    while isinstance(f, functools.partial):
        f = f.func
    if isinstance(f, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        return f"{getattr(f, '__module__', None) or '?'}.{getattr(f, '__qualname__', f.__name__)}"
    return f"a {type(f).__module__}.{type(f).__qualname__} object"


def forward_restore(a):
    """How detach() puts `a`'s forward back: None (offload() installed none: an
    embedding subclass, or a failure before the forward was swapped), "own" (ours is the
    module's forward, or the forward was deleted since), or the places where a wrapper
    keeps ours. Raises a LayerstreamError, changing nothing, for a wrapper that keeps it
    where it cannot be replaced or found (Note [A wrapper installed over a streamed forward])."""
    module, ours = a.module, a.forward
    if ours is None:
        return None
    current = module.__dict__.get("forward")
    if current is ours or current is None:
        return "own"
    places, fixed = _wrapper_refs(current, ours)
    for key in [k for k, v in module.__dict__.items() if v is ours and k != "forward"]:  # module._old_forward
        places.append(functools.partial(module.__dict__.__setitem__, key))
    if places and not fixed:
        return places
    where = ("keeps it where detach() cannot replace it (in a functools.partial's arguments or a bound "
             "method)" if fixed else "keeps it where detach() does not find it")
    hook = getattr(module, "_hf_hook", None)
    remedy = (f"remove the {type(hook).__name__} first (accelerate.hooks.remove_hook_from_module(module); "
              f"recurse=True for a whole model accelerate hooked), then detach()" if hook is not None else
              "remove that wrapper first (put back the forward it wrapped), then detach()")
    raise LayerstreamError(
        f"detach(): the forward of streamed layer '{a.name or '<root>'}' was wrapped after offload() by "
        f"{_describe_callable(current)}{' (an accelerate hook)' if hook is not None else ''}, which calls "
        f"layerstream's streamed forward and {where}; detach() would leave the wrapper calling a forward "
        f"that no longer works, or drop the wrapper. Nothing was changed: {remedy}.")


def put_forward_back(a, restore) -> None:
    """Undoes offload()'s forward on `a`'s module (a _handle._Attached) as forward_restore said."""
    module = a.module
    if restore is None or restore == "own":
        if a.had_forward:
            module.forward = a.old_forward
        else:
            module.__dict__.pop("forward", None)
        return
    # A wrapper keeps ours: the module's own forward takes its place, the wrapper stays.
    original = a.old_forward if a.had_forward else types.MethodType(type(module).forward, module)
    for put in restore:
        put(original)
