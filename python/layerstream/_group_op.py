"""A streamed tensor group's call as operators: torch.ops.layerstream.group and
group_backward (schemas in csrc/torch/ops_library.cpp), what torch.compile and
torch.export record for a tensor group instead of breaking the graph, and the forward
and backward work that the eager path (_forward._GroupFn) shares with them.

Note [A tensor group as an operator]
A group runs its module's own forward (Python: transformers' experts implementations,
nn.MultiheadAttention) on views of a fetched slot. Inductor must neither see those views
(it could keep one past the slot's release, or move a read before the copy into the
slot) nor reorder the fetch and the release around the reads. So the whole call is one
operator: fetch, the module's forward, release, inside one kernel, whose outputs are
new tensors (check_output). The backward is a second operator that fetches again and
recomputes, as _GroupFn does eagerly. Both are opaque to Inductor, which fuses the code
around them; the slot protocol never leaves the kernel, so no compiled order can break
it (the sim device's ordering checker runs under the compile tests).

What the kernel needs besides tensors (the positions of the tensors among the call's
arguments, constant arguments such as need_weights=False, whether a gradient is
needed, which inputs require one, the autocast state) is the `call` string: a Python
literal that Dynamo computes once at trace time (assume_constant_result) and that the
kernel parses (cached). The autocast state is passed, not read from the thread at run
time: inside a compiled region autocast is already applied to the traced code, and
the kernel must compute what the fake kernel promised. The RNG state at the forward
is the operator's last output, so that the backward's recompute draws the same
dropout masks.

A call whose constant arguments are not plain literals (None, bool, int, float, str)
or that nests tensors in containers is not one operator: it runs eagerly with a graph
break (_forward._group_eagerly), exact as well.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import itertools
import threading
import weakref
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _C, _dynamo_marks
from ._discovery import as_held

LayerstreamError = _C.LayerstreamError

_ops = torch.ops.layerstream

# (engine id, layer) -> the group's _GroupForward (weak: detach() or a freed model ends it and its entry).
_GROUPS: Dict[Tuple[int, int], "weakref.ref"] = {}
# (engine id, layer, call) -> the pattern of what the module returns, how the operator's list
# of tensors maps back onto it (Note [A compiled group's own container]); set by the
# kernels (fake and real).
_PATTERNS: Dict[Tuple[int, int, str], object] = {}
# The calls whose fake kernel could not run the module (shapes that depend on the routing)
# and promised the first input's shape and dtype instead: the real kernel checks them.
_LIKE_FIRST_INPUT: set = set()


def register(fwd) -> None:
    """Make a group's forward reachable from its operator (by engine id and layer)."""
    key = (fwd._engine.id, fwd._index)
    _GROUPS[key] = weakref.ref(fwd, lambda _: _GROUPS.pop(key, None))


def _group(engine: int, layer: int):
    ref = _GROUPS.get((engine, layer))
    fwd = ref() if ref is not None else None
    if fwd is None:
        raise LayerstreamError(
            f"layerstream::group: engine {engine} has no tensor group {layer} in this process (the "
            f"offload handle that recorded this graph was detached or freed, or the graph was exported "
            f"from another process); run the program where its offload() handle lives")
    return fwd


# ---- the work, shared with the eager path (_forward._GroupFn) ----

def _as_is(t):
    return t


def leaves(tensors: Sequence[torch.Tensor], requires_grad: Sequence[bool],
           leaf: Optional[Sequence[bool]] = None) -> list:
    """Detached copies of `tensors` (no data copied) with the given requires_grad, one per
    distinct tensor: a tensor passed twice stays one object (nn.MultiheadAttention takes
    another path when query is key is value). `leaf`: per tensor, whether the caller's
    was a leaf and no view (cast_once); a copy of one that was not, and requires grad,
    is a view of the leaf copy (None: all leaves). Note [Autocast casts a leaf once]."""
    seen = {}
    with torch.enable_grad():  # a view made without grad mode would be a leaf (backward runs without)
        for i, (t, r) in enumerate(zip(tensors, requires_grad)):
            if id(t) not in seen:
                c = t.detach().requires_grad_(bool(r))
                seen[id(t)] = c if leaf is None or leaf[i] or not r else c.view_as(c)
    return [seen[id(t)] for t in tensors]


def cast_once(t: torch.Tensor) -> bool:
    """Whether `t` is a leaf and no view: of such a tensor that requires grad, torch's
    autocast casts it once per region (Note [Autocast casts a leaf once])."""
    return t.is_leaf and not t._is_view()


# Note [Autocast casts a leaf once]
# With its cast cache on (the default), torch.autocast casts an fp32 tensor that is a leaf,
# requires grad and is no view (a parameter, or an input leaf) once per autocast region,
# and reuses that cast at each use: the uses' gradients are summed in the autocast dtype
# before the cast back. Any other tensor (an activation) is cast at each use, and its
# gradients are summed in fp32. A group's recompute runs on copies of its inputs: as plain
# leaves, a group using an activation twice (a GLU MLP's gate and up projections, q/k/v
# projections of one input) had its input cast once and the two gradients summed in bf16,
# where the resident graph sums in fp32 (the input's gradient, and every one before it,
# off in bf16's last bit; likewise a leaf under cache_enabled=False). So each
# copy is a leaf where the caller's tensor was one, else a view of a leaf, and the
# recompute runs with the cache on or off as the forward did: the group's casts within
# one call are the resident module's. The cache holds a cast until the outermost autocast
# region exits (a region that spans the forward): the forward without a graph runs with
# it off (its casts would hold a copy of every group's weights on the device until then;
# the values are the same), and so can match only what happens inside one call. Across
# calls (a tensor the resident model's cache casts once for several layers) it cannot:
# docs/design/torch-glue.md, "Dtype rule".


def rng_state(dev: torch.device) -> tuple:
    """The CPU and (on CUDA) device RNG states a recompute restores."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None


def bind(adapters: Sequence[tuple], tensors: Sequence[torch.Tensor]) -> list:
    """(tensor index, function, tensors) per adapter from `adapters`' (index, function,
    count) and their tensors in order (_GroupForward.fetched's `adapters`)."""
    out, at = [], 0
    for slot, fn, n in adapters:
        out.append((slot, fn, tuple(tensors[at:at + n])))
        at += n
    return out


def forward_without_graph(fwd, rebuild: Callable, inputs: Sequence[torch.Tensor], experts: Sequence[int],
                          adapters: Sequence[tuple] = (), extras: Sequence[torch.Tensor] = (),
                          written: Optional[dict] = None):
    """The module's forward on the fetched slot as the resident module runs it when a
    gradient is needed: grad mode on, inputs and parameters with their requires_grad
    (the fetched views have their parameters'), so that every op takes the same path
    (at::matmul folds by requires_grad; attention picks its kernel by grad mode). The
    graph it records is dropped with the detached outputs, and nothing it saves is an
    activation to offload. `adapters` / `extras`: as recompute_gradients'. `written`:
    filled with the buffers' values before the forward, of those it wrote (Note [A
    group's buffers and the recompute]). Autocast's cast cache is off for the call
    (Note [Autocast casts a leaf once]).
    (Note [Same calls as the resident module], csrc/torch/engine.cpp)"""
    bound = bind(adapters, leaves(extras, [t.requires_grad for t in extras]))
    # Saved as detached aliases (the graph is never differentiated): a tensor saved with
    # its grad_fn closes a reference cycle where a node saves its own output (attention's
    # kernel does), through autograd's C++ nodes that Python's collector does not see, and
    # every call's graph, its activations and its weights' casts with it, was never freed.
    with torch.enable_grad(), fwd.fetched(experts=experts, adapters=bound) as views, \
            torch.autograd.graph.saved_tensors_hooks(torch.Tensor.detach, _as_is), _cast_cache(False):
        args, kwargs = rebuild(leaves(inputs, [x.requires_grad for x in inputs]))
        before = None if written is None else [(o, k, b, version_of(b), b.detach().clone())
                                               for o, k, b in _buffers(fwd._module)]
        versions = [(x, version_of(x)) for x in {id(x): x for x in inputs}.values()]
        try:
            out = fwd._original(*args, **kwargs)
        except RuntimeError as e:
            if _LEAF_INPLACE not in str(e):
                raise
            own = _own_tensor_written(fwd, rebuild, inputs, views)
            if own is not None:
                raise fwd._written(own, grad=views[own].requires_grad) from None
            if not any(x.requires_grad for x in inputs):
                raise
            raise _writes_input(fwd, e) from None
        if any(version_of(x) != v for x, v in versions):
            raise _writes_input(fwd)
        for o, k, b, version, value in before or ():
            if o._buffers.get(k) is not b or version_of(b) != version:
                written[(id(o), k)] = value
        fwd.check_output(out, views)
        return torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out)


# What autograd says of an in-place write to a leaf that requires grad (or a view of one):
# the group's inputs are such leaves while its forward runs without a graph.
_LEAF_INPLACE = "leaf Variable that requires grad is being used in an in-place operation"


def _own_tensor_written(fwd, rebuild: Callable, inputs: Sequence[torch.Tensor],
                        views: Sequence[torch.Tensor]) -> Optional[int]:
    """After torch refused an in-place write to a leaf that requires grad in a group's forward
    without a graph: which of the group's tensors the forward writes (their fetched views are
    such leaves when their parameters train, as its inputs are), or None (an input, or
    nothing found). The forward runs once more, on copies: of the inputs, as leaves that
    require grad as before (a write to one is refused again, first if it came first), and of
    the group's tensors, frozen (a write bumps a copy's version). The module's buffers are
    copies for the run and the RNG is put back (as the recompute's), the module's tensors
    too; a run that fails otherwise (e.g. out of memory for the copies) finds nothing."""
    copies: Dict[int, torch.Tensor] = {}
    clone = [copies.setdefault(id(x), x.detach().clone().requires_grad_(x.requires_grad)) for x in inputs]
    slots = fwd._slots
    held = [o._parameters[k] for o, k in slots]
    dev = fwd._device
    mine: list = []
    versions: list = []
    try:
        mine = [as_held(p, v.detach().clone()) for p, v in zip(fwd._params, views)]
        versions = [version_of(t) for t in mine]
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), \
                _recompute_buffers(fwd._module, None):
            for (o, k), t in zip(slots, mine):
                o._parameters[k] = t
            args, kwargs = rebuild(clone)
            fwd._original(*args, **kwargs)
    except Exception:  # noqa: BLE001 - e.g. the input's write refused again: decided by the versions
        pass
    finally:
        for (o, k), t in zip(slots, held):
            o._parameters[k] = t
    return next((i for i, (t, v) in enumerate(zip(mine, versions)) if version_of(t) != v), None)


def _writes_input(fwd, cause: Optional[BaseException] = None) -> LayerstreamError:
    """A group whose forward wrote one of its inputs in place: its backward recomputes the
    forward from the inputs, which such a write would have changed (a silently different
    gradient), and its forward runs on leaf copies of them, which torch refuses to write when
    they require grad (docs/design/torch-glue.md, "offload(groups=[patterns])")."""
    said = f" (torch: {str(cause).rstrip('.')})" if cause is not None else ""
    return LayerstreamError(
        f"streamed tensor group '{fwd._name}' modifies an input in place in its forward{said}; a streamed "
        f"group runs its forward again in backward from its inputs as they were, which it cannot do once "
        f"they are written. Clone the input in its forward before writing it (x = x.clone()), or keep the "
        f"module resident (offload(exclude=[{fwd._name!r}])).")


# Note [A group's buffers and the recompute]
# The backward runs the group's forward again, and a forward may write its module's
# buffers: nn.BatchNorm's running statistics and num_batches_tracked in training. The
# resident model writes them once per call; written again by the recompute, the statistics
# counted each batch twice (num_batches_tracked 4 after 2 steps; momentum=None's cumulative
# average weighs by that count), and eval outputs after training differed from the
# resident model's. torch.utils.checkpoint does the same (it keeps no buffers). So the
# recompute runs on copies of the group's buffers (`_recompute_buffers`), the module's own
# objects swapped back after: the backward leaves every buffer as the forward left it, with
# no in-place write (a write would bump versions that another graph may have saved). A
# forward that reads a buffer it has just written (an observation normalizer updating its
# running mean first) must see the values it saw: the eager path keeps, until backward, a
# copy of each buffer the forward wrote or replaced (by its version counter, or a new
# object) as it was before, and the recompute starts from those. BatchNorm's kernel writes
# its running statistics without bumping their version, but never reads them in a call
# that writes them, so its recompute is exact from the current values. A compiled group
# call recomputes from the current values (its operator holds no copies).


@contextlib.contextmanager
def _cast_cache(enabled: bool):
    """Autocast's cast cache on or off while the block runs (the setting is per thread)."""
    was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(enabled)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)


def _buffers(module: torch.nn.Module) -> list:
    """(owner, key, tensor) of every buffer of `module` and its descendants."""
    return [(m, k, b) for m in module.modules() for k, b in m._buffers.items() if b is not None]


def version_of(t: torch.Tensor) -> Optional[int]:
    """t's version counter; None for an inference tensor (it has none, and nothing
    outside inference mode writes it in place)."""
    return None if t.is_inference() else t._version


@contextlib.contextmanager
def _recompute_buffers(module: torch.nn.Module, written: Optional[dict]):
    """While the block runs, the buffers of `module`'s tree are copies (of their values
    before the forward, for those in `written`; of their current values otherwise), and a
    buffer several modules share stays one tensor; the module's own objects are back after
    (Note [A group's buffers and the recompute])."""
    held = _buffers(module)
    copies: Dict[int, torch.Tensor] = {}
    for o, k, b in held:
        if id(b) not in copies:
            start = (written or {}).get((id(o), k), b)
            copies[id(b)] = start.detach().clone().requires_grad_(b.requires_grad)
    try:
        for o, k, b in held:
            o._buffers[k] = copies[id(b)]
        yield
    finally:
        for o, k, b in held:
            o._buffers[k] = b


def recompute_gradients(fwd, rebuild: Callable, saved: Sequence[torch.Tensor], needs: Sequence[bool], rng: tuple,
                        autocast: tuple, experts: Sequence[int], grads: Sequence,
                        adapters: Sequence[tuple] = (), extras: Sequence[torch.Tensor] = (),
                        written: Optional[dict] = None, leaf: Optional[Sequence[bool]] = None
                        ) -> Tuple[list, list, list]:
    """Backward of a group call: fetch again, re-run the forward with the saved inputs
    (RNG and autocast state as at the forward, buffers as forward_without_graph's
    `written` kept them, the module's left untouched) and differentiate it. `needs`: per
    input, per adapter tensor, then per group tensor; `autocast`: (enabled, dtype, cast
    cache enabled) at the forward; `adapters`: (tensor index, function, count) of the
    adapters active at the forward, `extras` their tensors (Note [Adapters on a streamed
    group's tensors], _peft_params.py); `leaf`: per input and adapter tensor, cast_once
    of the caller's (Note [Autocast casts a leaf once]; None: all leaves). Returns the
    inputs' gradients (a tensor passed at several positions gets its whole gradient at
    the first), the adapter tensors' and the group tensors' gradients on the host in
    their dtypes (averaged over the process group first when the engine averages)."""
    n_in, n_ex = len(saved), len(extras)
    inputs = leaves(saved, needs[:n_in], None if leaf is None else leaf[:n_in])
    ex = leaves(extras, needs[n_in:n_in + n_ex], None if leaf is None else leaf[n_in:])
    args, kwargs = rebuild(inputs)
    dev = fwd._device
    cpu_rng, dev_rng = rng
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.set_rng_state(cpu_rng)
        if dev_rng is not None:
            torch.cuda.set_rng_state(dev_rng, dev)
        with torch.enable_grad(), fwd.fetched(needs[n_in + n_ex:], experts, bind(adapters, ex)) as views:
            # Only the forward runs in the forward's autocast state: the backward's ops run
            # in the caller's, as the resident graph's do (and torch.utils.checkpoint's).
            # Differentiated under autocast, an fp32 region's backward (autocast off inside
            # the forward) ran in bf16, and its gradients were off in the third digit.
            with torch.autocast(dev.type, dtype=autocast[1], enabled=autocast[0]), _cast_cache(autocast[2]), \
                    _recompute_buffers(fwd._module, written):
                out = fwd._original(*args, **kwargs)
            outs = torch.utils._pytree.tree_leaves(out)  # as flatten_outputs lists them
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o is not None and o.requires_grad]
            wanted = [t for t in inputs + ex + views if t.requires_grad]
            got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                       if pairs and wanted else [None] * len(wanted))
            result = [next(got) if t.requires_grad else None for t in inputs + ex + views]
            first = {}
            for i, t in enumerate(inputs):
                if first.setdefault(id(t), i) != i:
                    result[i] = None
    host = []
    for k, p in enumerate(fwd._params):
        g = result[n_in + n_ex + k]
        if fwd._averaged and p.requires_grad:
            # Averaged over the process group before the copy to the host (the engine's
            # rule, engine_distributed.cpp); every rank reduces every trainable tensor,
            # so one that got no gradient here reduces zeros, as DDP does.
            g = (torch.zeros(p.shape, dtype=p.dtype, device=dev) if g is None else g).to(dtype=p.dtype)
            fwd._engine.average_gradient(fwd._index, g)
        host.append(None if g is None else g.to("cpu", p.dtype))  # returned to autograd: .grad on the host
    return result[:n_in], result[n_in:n_in + n_ex], host


def flatten_outputs(fwd, out) -> Tuple[list, object]:
    """(tensors, tree spec) of what a group's module returned: a tensor, or a tuple,
    namedtuple, list or dict of tensors and Nones, which the caller gets back in its own
    type (torch.utils._pytree; compiled: Note [A compiled group's own container]);
    anything else is refused."""
    leaves, spec = torch.utils._pytree.tree_flatten(out)
    if leaves and all(o is None or isinstance(o, torch.Tensor) for o in leaves):
        return leaves, spec
    raise LayerstreamError(f"streamed layer '{fwd._name}' returned {type(out).__name__} holding "
                           f"{sorted({type(o).__name__ for o in leaves}) or 'nothing'}; a streamed tensor group must "
                           f"return a tensor, or a tuple, list or dict of tensors (or None)")


# ---- the call description ----

class _Call(NamedTuple):
    nargs: int
    names: Tuple[str, ...]
    consts: tuple  # per argument: ("t", index into the tensors) or ("v", value)
    grad: bool  # a gradient is needed (the forward runs as _GroupFn's)
    grad_mode: bool  # torch.is_grad_enabled() at the call
    requires_grad: Tuple[bool, ...]  # per tensor
    trainable: Tuple[bool, ...]  # per group tensor: passed as a `params` input (requires grad)
    autocast: Tuple[bool, Optional[torch.dtype]]

    def rebuild(self, tensors: Sequence[torch.Tensor]):
        vals = [tensors[v] if kind == "t" else v for kind, v in self.consts]
        return vals[:self.nargs], dict(zip(self.names, vals[self.nargs:]))


_LITERALS = (type(None), bool, int, float, str)


@_dynamo_marks.assume_constant_result
def _describe(nargs, names, consts, grad, grad_mode, requires_grad, trainable, autocast_on, autocast_dtype,
              layout) -> str:
    return repr((nargs, names, consts, grad, grad_mode, requires_grad, trainable, autocast_on,
                 str(autocast_dtype).replace("torch.", ""), layout))


@functools.lru_cache(maxsize=None)
def _parse(call: str) -> _Call:
    nargs, names, consts, grad, grad_mode, req, trainable, on, dtype, _layout = ast.literal_eval(call)
    return _Call(nargs, tuple(names), tuple(consts), grad, grad_mode, tuple(req), tuple(trainable),
                 (on, getattr(torch, dtype)))


@_dynamo_marks.assume_constant_result
def _pattern(engine: int, layer: int, call: str):
    return _PATTERNS[(engine, layer, call)]


def _plain(v) -> bool:
    return isinstance(v, _LITERALS) or (isinstance(v, (tuple, list)) and all(isinstance(e, _LITERALS) for e in v))


def layout(module: torch.nn.Module, tensors: Sequence[torch.Tensor]) -> str:
    """What a group's outputs' shapes may follow from besides its call's arguments: the
    classes of its module tree, their plain settings (num_heads, batch_first, ...) and its
    tensors' shapes, strides and dtypes (frozen ones are no inputs of the call). The call
    names it, so that Inductor's cache, shared by processes that number engines and layers
    alike, keys on it (Note [An operator call names its layer's layout], ops_spec.cpp)."""
    parts = [f"{name}:{type(m).__qualname__}" + repr(sorted((k, v) for k, v in vars(m).items()
                                                             if k != "training" and _plain(v)))
             for name, m in module.named_modules()]
    parts += [f"{tuple(t.shape)}/{tuple(t.stride())}/{t.dtype}" for t in tensors]
    return ";".join(parts)


def describable(args, kwargs) -> bool:
    """Whether a call's arguments fit the operator: tensors, or plain literals."""
    return all(isinstance(v, torch.Tensor) or (isinstance(v, _LITERALS) and not isinstance(v, torch.SymInt))
               for v in (*args, *kwargs.values()))


def traced(fwd, args, kwargs):
    """A group's call as torch.compile records it: one layerstream::group operator."""
    names = tuple(kwargs.keys())
    tensors: List[torch.Tensor] = []
    consts = []
    for v in (*args, *(kwargs[k] for k in names)):
        if isinstance(v, torch.Tensor):
            for j, t in enumerate(tensors):
                if t is v:
                    break
            else:
                j = len(tensors)
                tensors.append(v)
            consts.append(("t", j))
        else:
            consts.append(("v", v))
    req = tuple(t.requires_grad for t in tensors)
    trainable = [False] * len(fwd._params)
    params = []
    # Non-strict export swaps the modules' parameters for the program's PARAMETER inputs:
    # those get the gradient edges (the cached ones would be lifted as constants).
    current = ([o._parameters[k] for o, k in fwd._slots] if torch.compiler.is_exporting() else fwd._params)
    for i in fwd._dense:  # packed stand-ins are frozen, and never graph inputs
        p = current[i]
        if p.requires_grad:
            trainable[i] = True
            params.append(p)
    trainable = tuple(trainable)
    grad_mode = torch.is_grad_enabled()
    grad = grad_mode and (any(req) or len(params) > 0)
    kind = fwd._device.type
    call = _describe(len(args), names, tuple(consts), grad, grad_mode, req, trainable,
                     torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), fwd._layout)
    engine = fwd._engine.id
    outs = _ops.group(tensors, params, engine, fwd._index, call)
    return _build(_pattern(engine, fwd._index, call), iter(outs))


# Note [A compiled group's own container]
# Eagerly, a group's outputs are flattened by torch.utils._pytree and the caller gets them
# back in the module's own container from the tree spec (flatten_outputs). Compiled, the
# operator returns a list of tensors, and traced() rebuilds the container in the code
# Dynamo traces, from the pattern the fake kernel recorded at trace time (`_pattern`, a
# constant there; the real kernel checks that every call returns the same). The tree spec
# itself is no such constant: Dynamo wraps what assume_constant_result returns with a
# source it cannot evaluate once it reads the object's attributes (torch 2.14: NameError
# at trace time), and a spec read from a module dict is guarded field by field at every
# call. So the pattern is a literal, derived from the tree spec (the leaves in pytree's
# order, which the backward's recompute pairs with the gradients): None, "Tensor", or
# (kind, key, children) for a tuple, a list, a dict (key: its keys, which must be plain
# literals) or a namedtuple (key: the id of its class, which traced code looks up in
# _TYPES; Dynamo guards that one entry, which never changes). Any other container (an
# OrderedDict, a structseq, a transformers ModelOutput) is refused at trace time, with
# what to change.
_TYPES: Dict[int, type] = {}


def _build(pattern, tensors):
    """The module's container of `pattern` (_pattern_of), holding the tensors from the
    iterator `tensors` in order and None where the module returned None."""
    if pattern is None:
        return None
    if pattern == "Tensor":
        return next(tensors)
    kind, key, children = pattern
    values = [_build(c, tensors) for c in children]
    if kind == "tuple":
        return tuple(values)
    if kind == "list":
        return values
    if kind == "dict":
        return dict(zip(key, values))
    return _TYPES[key](*values)


def _pattern_of(fwd, leaves: Sequence[Optional[torch.Tensor]], spec):
    """The literal pattern of what a group's module returned (flatten_outputs' `leaves`
    and `spec`), for a compiled call (Note [A compiled group's own container])."""
    it = iter(leaves)

    def walk(s):
        if s.is_leaf():
            return None if next(it) is None else "Tensor"
        children = tuple(walk(c) for c in s.children())
        if s.type in (tuple, list):
            return s.type.__name__, None, children
        if s.type is dict and all(isinstance(k, _LITERALS) for k in s.context):
            return "dict", tuple(s.context), children
        if s.type is torch.utils._pytree.namedtuple:
            _TYPES.setdefault(id(s.context), s.context)
            return "namedtuple", id(s.context), children
        what = f"a dict keyed by {sorted({type(k).__name__ for k in s.context})}" if s.type is dict else \
            getattr(s.type, "__name__", str(s.type))
        raise LayerstreamError(
            f"streamed layer '{fwd._name}' returned {what} under torch.compile, where a streamed tensor group "
            f"returns a tensor, or a tuple, namedtuple, list or dict (keys str, int, float, bool or None) of them "
            f"and Nones, nested or not; return one of those, or call the module outside the compiled code "
            f"(torch.compiler.disable), or keep it resident (offload(exclude=[{fwd._name!r}]))")
    return walk(spec)


def _structure(pattern) -> str:
    """A pattern as the module's container holding "Tensor" and None, for messages."""
    return repr(_build(pattern, itertools.repeat(_TENSOR)))


def _nones(pattern) -> List[bool]:
    """Per leaf of the pattern, in pytree's order: whether the module returned None there."""
    return [o is None for o in torch.utils._pytree.tree_leaves(_build(pattern, itertools.repeat(_TENSOR)))]


class _Placeholder:
    def __repr__(self):
        return "Tensor"


_TENSOR = _Placeholder()


# ---- the kernels ----

# The dispatch state of an eager call (taken at import, in eager code). A compiled graph
# calls an operator's kernel below autograd, functionalization and autocast (those are
# already applied to the traced code), but the group's kernels run a module's eager
# forward, which must see what the resident module sees: autograd (at::matmul folds by
# a weight view's requires_grad; the recompute differentiates), autocast as entered.
_EAGER_DISPATCH = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())


def _as_eager():
    return torch._C._ForceDispatchKeyGuard(*_EAGER_DISPATCH)


def _rng_tensor(dev: torch.device) -> torch.Tensor:
    cpu, cuda = rng_state(dev)
    return cpu if cuda is None else torch.cat([cpu, cuda])


def _split_rng(rng: torch.Tensor, dev: torch.device) -> tuple:
    n = torch.get_rng_state().numel()
    return rng[:n].clone(), (rng[n:].clone() if dev.type == "cuda" else None)


# Note [MultiheadAttention's fast path in a compiled group]
# nn.MultiheadAttention takes a fused kernel (torch._native_multi_head_attention) in eval
# mode without gradients. Its real kernel returns no weights (None) under
# need_weights=False, as the unfused path does, but its fake (meta) kernel returns an
# empty weights tensor: the group's fake kernel, running the module's forward on fake
# tensors, promised a second output the real kernel never returned, and a compiled eval of
# a model with a streamed MultiheadAttention (torchvision's ViT) failed with "returned 2
# outputs (None at (False, True)) where the traced call returned None at (False, False)".
# So while the fake kernel runs a MultiheadAttention, torch's switch of that path
# (torch.backends.mha, one for the process) is off: the unfused path's fake gives the
# structure both real paths return. The real kernels keep the path the eager module takes
# (the fused one there: the eager resident model's numbers). The switch is counted, so
# that overlapping fake kernels of two threads restore it once, after the last; an eager
# MultiheadAttention running meanwhile in another thread (only while a graph is traced)
# takes the unfused path: the same function, rounded otherwise.
_UNFUSED = {"depth": 0, "was": True}
_UNFUSED_LOCK = threading.Lock()


@contextlib.contextmanager
def _unfused_attention(fwd):
    if not isinstance(fwd._module, torch.nn.MultiheadAttention):
        yield
        return
    with _UNFUSED_LOCK:
        if _UNFUSED["depth"] == 0:
            _UNFUSED["was"] = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
        _UNFUSED["depth"] += 1
    try:
        yield
    finally:
        with _UNFUSED_LOCK:
            _UNFUSED["depth"] -= 1
            if _UNFUSED["depth"] == 0:
                torch.backends.mha.set_fastpath_enabled(_UNFUSED["was"])


def _run(fwd, c: _Call, inputs: Sequence[torch.Tensor]):
    def rebuild(ts):
        return c.rebuild(ts)
    args, kwargs = c.rebuild(inputs)
    experts = fwd.routed_experts(args, kwargs)
    with torch.autocast(fwd._device.type, dtype=c.autocast[1], enabled=c.autocast[0]):
        if c.grad:
            inputs = [t.detach().requires_grad_(r) for t, r in zip(inputs, c.requires_grad)]
            return forward_without_graph(fwd, rebuild, inputs, experts)
        with torch.set_grad_enabled(c.grad_mode), fwd.fetched(experts=experts) as views:
            out = fwd._original(*args, **kwargs)
            fwd.check_output(out, views)
            return out


def _group_kernel(inputs, params, engine, layer, call):
    fwd, c = _group(engine, layer), _parse(call)
    rng = _rng_tensor(fwd._device)
    with _as_eager():
        outs, spec = flatten_outputs(fwd, _run(fwd, c, inputs))
    pattern = _pattern_of(fwd, outs, spec)
    expected = _PATTERNS.get((engine, layer, call))
    if expected is not None and expected != pattern:
        raise LayerstreamError(f"streamed layer '{fwd._name}' returned {_structure(pattern)} where the traced "
                               f"call returned {_structure(expected)}; a compiled tensor group must return the "
                               f"same structure on every call")
    _PATTERNS[(engine, layer, call)] = pattern
    if (engine, layer, call) in _LIKE_FIRST_INPUT:
        args, _ = c.rebuild(inputs)
        first = args[0] if args else inputs[0]
        if pattern != "Tensor" or outs[0].shape != first.shape or outs[0].dtype != first.dtype:
            raise LayerstreamError(
                f"streamed layer '{fwd._name}' returned {[tuple(o.shape) for o in outs if o is not None]} where its "
                f"compiled call promised one tensor shaped like its first input {tuple(first.shape)} "
                f"({first.dtype}): its shapes depend on the data, so the fake kernel could not run it. Keep this "
                f"module resident (offload(exclude=[...])), or do not compile it (torch.compiler.disable)")
    return [_like(o, o) for o in outs if o is not None] + [rng]  # in fake's layouts: torch.empty_like


def _data_dependent():
    """The errors fake tensors raise when a forward's shapes depend on the data
    (transformers' eager experts loop over the experts a batch hits), and the test for a
    size computed from data. Imported here: symbolic_shapes (and sympy with it) loads
    with torch.compile, not with layerstream (Note [Compile marks without importing
    dynamo], _dynamo_marks.py)."""
    from torch.fx.experimental import symbolic_shapes
    return ((torch._subclasses.fake_tensor.DynamicOutputShapeException,
             torch._subclasses.fake_tensor.DataDependentOutputException,
             symbolic_shapes.GuardOnDataDependentSymNode), symbolic_shapes.free_unbacked_symbols)


def fake(inputs, params, engine, layer, call):
    """The module's own forward on stand-ins of the group's tensors (empty tensors of the
    fetched views' shapes and dtypes on the compute device, where the real kernel's views
    are: not the first input's, which may be a host tensor such as lengths), so the shapes come from the
    module's code. An experts module whose shapes depend on the routing (the eager
    implementation) returns its first input's shape and dtype, as transformers' experts
    do; the real kernel checks it."""
    fwd, c = _group(engine, layer), _parse(call)
    dev = fwd._device
    # As the kernel runs it: grad mode and requires_grad decide paths (and what
    # nn.MultiheadAttention returns in eval mode).
    args, kwargs = c.rebuild([t.detach().requires_grad_(r and c.grad) for t, r in zip(inputs, c.requires_grad)])
    # Sizes the forward computes from data (torch.unique, nonzero) are symbols that no output
    # returns: let the trial make them; an output sized by one counts as data-dependent.
    env = getattr(torch._guards.detect_fake_mode(inputs), "shape_env", None)
    data_dependent, free_unbacked_symbols = _data_dependent()
    # The trial puts back what the module held, which is not always offload()'s tensors:
    # non-strict export swaps them for the program's PARAMETER inputs while it traces. Put
    # back as offload()'s, a second call of the group in the same forward read those, export
    # lifted them as constants, and the program's gradients lacked that call's part.
    held = [o._parameters[k] for o, k in fwd._slots]
    try:
        for (o, k), p in zip(fwd._slots, fwd._params):
            o._parameters[k] = as_held(p, torch.empty(p.shape, dtype=p.dtype, device=dev).requires_grad_(
                p.requires_grad), trial=True)
        fresh = env.ignore_fresh_unbacked_symbols() if env is not None else contextlib.nullcontext()
        with torch.set_grad_enabled(c.grad_mode), fresh, _unfused_attention(fwd), \
                torch.autocast(dev.type, dtype=c.autocast[1], enabled=c.autocast[0]):
            out = fwd._original(*args, **kwargs)
        if any(isinstance(t, torch.Tensor) and free_unbacked_symbols(t.shape)
               for t in torch.utils._pytree.tree_leaves(out)):
            raise torch._subclasses.fake_tensor.DataDependentOutputException(torch.ops.layerstream.group.default)
    except Exception as e:  # noqa: BLE001 - experts modules: see below; others re-raise
        # An experts module whose trial cannot run on fake tensors: shapes that depend on
        # the routing (data_dependent), or a kernel path fake tensors refuse (transformers
        # picks grouped_mm unless Dynamo traces its own frame, which a fake kernel is not;
        # torch 2.11's meta grouped_mm accepts bf16 only). It returns its first input's
        # shape and dtype, which the real kernel checks.
        if not fwd._experts_module or not inputs or not isinstance(e, (*data_dependent, RuntimeError)):
            raise
        out = torch.empty_like(args[0] if args else inputs[0])
        _LIKE_FIRST_INPUT.add((engine, layer, call))
    finally:
        for (o, k), p in zip(fwd._slots, held):
            o._parameters[k] = p
    outs, spec = flatten_outputs(fwd, out)
    _PATTERNS[(engine, layer, call)] = _pattern_of(fwd, outs, spec)
    return [torch.empty_like(o, requires_grad=False) for o in outs if o is not None] + \
        [torch.empty(_rng_tensor(fwd._device).shape, dtype=torch.uint8)]


def _group_backward_kernel(grads, inputs, rng, engine, layer, call, mask):
    """`mask`: per input, then per group tensor (False for a frozen one); returns the
    gradients the mask asks for, in that order (the group tensors' on the host)."""
    fwd, c = _group(engine, layer), _parse(call)
    args, kwargs = c.rebuild(inputs)
    experts = fwd.routed_experts(args, kwargs)
    it = iter(grads)
    full = [None if n else next(it) for n in _nones(_PATTERNS[(engine, layer, call)])]
    with _as_eager():
        # The compiled call records neither the cache setting nor which inputs were
        # leaves: the thread's setting, and leaves (Note [Autocast casts a leaf once]).
        ins, _, host = recompute_gradients(fwd, c.rebuild, inputs, list(mask), _split_rng(rng, fwd._device),
                                           (*c.autocast, torch.is_autocast_cache_enabled()), experts, full)
    # In the layouts backward_fake promises (Inductor's code relies on them): an input's
    # gradient laid out like the input, a group tensor's contiguous.
    n_in = len(inputs)
    out = [_like(g, t) for g, t, m in zip(ins, inputs, mask[:n_in]) if m]
    return out + [g.contiguous() if g is not None else torch.zeros(p.shape, dtype=p.dtype)
                  for g, p, m in zip(host, fwd._params, mask[n_in:]) if m]


def _like(g: Optional[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """g (None: zeros) in the layout torch.empty_like(t) has."""
    out = torch.empty_like(t)
    if g is None:
        return out.zero_()
    return g if g.stride() == out.stride() else out.copy_(g)


def backward_fake(grads, inputs, rng, engine, layer, call, mask):
    fwd = _group(engine, layer)
    n_in = len(inputs)
    out = [torch.empty_like(t) for t, m in zip(inputs, mask[:n_in]) if m]
    return out + [torch.empty(p.shape, dtype=p.dtype, device="cpu") for p, m in zip(fwd._params, mask[n_in:]) if m]


def _setup(ctx, inputs, output):
    tensors, params, engine, layer, call = inputs
    ctx.save_for_backward(*tensors, output[-1])
    ctx.meta = (engine, layer, call, len(tensors))
    ctx.mark_non_differentiable(output[-1])


def _backward(ctx, grads):
    engine, layer, call, n_in = ctx.meta
    saved = ctx.saved_tensors
    needs_in, needs_params = list(ctx.needs_input_grad[0]), list(ctx.needs_input_grad[1])
    it = iter(needs_params)  # one per trainable group tensor (the `params` input)
    per_tensor = [bool(next(it)) if t else False for t in _parse(call).trainable]
    got = iter(_ops.group_backward(list(grads[:-1]), list(saved[:n_in]), saved[n_in], engine, layer, call,
                                   [bool(m) for m in needs_in] + per_tensor))
    return ([next(got) if m else None for m in needs_in], [next(got) if m else None for m in needs_params],
            None, None, None)


# The fake kernels are registered by layerstream._ops, the operators' Python module.
torch.library.impl("layerstream::group", "CompositeExplicitAutograd")(_group_kernel)
torch.library.impl("layerstream::group_backward", "CompositeExplicitAutograd")(_group_backward_kernel)
torch.library.register_autograd("layerstream::group", _backward, setup_context=_setup)
