"""_HostOptimizer, what layerstream.optim's AdamW and Adafactor share: gradient
collection and checks, param groups, zero_grad(), the sharded step's frame; with
overlap() and the step's scale (_optim_overlap.py) and state dicts (_optim_state.py)."""
from __future__ import annotations

import contextlib

import torch

from . import _C
from ._interrupts import held_interrupts
from ._optim_calls import _user_stacklevel
from ._optim_overlap import _OverlapAndScaling
from ._optim_state import _LIVE, _StateDicts


class _HostOptimizer(_OverlapAndScaling, _StateDicts, torch.optim.Optimizer):
    """What AdamW and Adafactor share: gradient collection and checks, the
    global clip (``max_grad_norm``), loss scaling and state loading."""

    # Its C++ step moves the version counters of what it writes (host_optim.cpp), and
    # a sharded step records them: _calls' step post-hook leaves them alone (Note
    # [An optimizer step is a write]).
    _layerstream_moves_versions = True

    def __init__(self, params, defaults, max_grad_norm):
        if max_grad_norm is not None:
            max_grad_norm = float(max_grad_norm)
            if not max_grad_norm > 0.0:
                raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        self.max_grad_norm = max_grad_norm
        #: The total gradient norm the last step clipped with (None when not clipping).
        self.last_grad_norm = None
        self._overlap = None  # (the _C overlap plan, its parameters) between overlap() and step()
        self._overlap_sharded = False  # that plan covered sharded parameters (set by _finish_overlap)
        self._overlap_scaler = None  # the GradScaler that plan was given (overlap(grad_scaler=))
        # What that plan stepped with and left (checked by step(): _check_overlap_inputs):
        # {group index: its hyperparameters} and (param, .grad, its version) of each of its
        # parameters that holds a .grad after the block (with keep_grads, the streamed ones too).
        self._overlap_hyper = {}
        self._overlap_grads = []
        self._budget_checked = False  # _warn_uncounted_training ran (at the first step)
        # Note [Zeroed gradients an overlapped step dropped]: an overlapped step leaves the .grad
        # of what it stepped None. torch's zero_grad(set_to_none=False) would leave zeros there,
        # and torch's next step moves such a parameter from them (weight decay, momentum) when no
        # gradient reaches it (a branch not taken, an expert not routed to, frozen since):
        # zero_grad(set_to_none=False) marks them, and a step gives them a zero gradient (made
        # then, not kept) while .grad is still None. id -> parameter.
        self._dropped = {}  # stepped by the last overlapped backward (their .grad None unless kept)
        self._zeroed = {}  # dropped, then zeroed by zero_grad(set_to_none=False)
        self._unfinished = None  # the step() under way, or one a Ctrl-C stopped (Note [A re-run step() ...])
        self._init_state_dicts()
        super().__init__(params, defaults)
        _LIVE.add(self)

    @staticmethod
    def _run_closure(closure):
        """step()'s closure (torch's contract: re-evaluates the loss with grad enabled)."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    @contextlib.contextmanager
    def _counted_if_stepped(self, params):
        """Around one group's kernel call (it takes each state's count + 1): the counts
        advance only when it returned. A refused step (a bad lr or betas set through
        param_groups, an fp16 parameter) left them advanced and the later steps' bias
        correction off by one; the states it created for parameters never stepped go.
        Its callers hold Ctrl-C over it (Note [A Ctrl-C as a C++ call returns]): raised
        as the kernel returned, it left the update applied and the counts behind it."""
        fresh = [p for p in params if len(self.state[p]) == 0]
        states = []
        try:
            yield states
        except BaseException:
            for p in fresh:
                self.state.pop(p, None)
            raise
        for st in states:
            st["step"] += 1
        self._unfinished.done.update(map(id, params))

    def _collect(self):
        """Per group: (group, params with a gradient, their gradients, their keys).
        A key is the parameter's position in the optimizer (its stochastic
        rounding stream)."""
        self._adopt_unadopted()  # Note [States loaded for a meta parameter]
        self._check_groups_foreign()
        work, grads, key = [], [], 0
        for gi, group in enumerate(self.param_groups):
            ps, gs, keys, at = [], [], [], []
            for pos, p in enumerate(group["params"]):
                g = p.grad
                if g is None and id(p) in self._zeroed:  # Note [Zeroed gradients an overlapped step dropped]
                    g = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif g is not None:
                    self._zeroed.pop(id(p), None)
                if g is not None:
                    ps.append(p)
                    gs.append(g)
                    keys.append(key)
                    at.append(pos)
                key += 1
            _C.optim_check_group(ps, gs, gi, at)
            work.append((group, ps, gs, keys))
            grads += gs
        if not self._budget_checked:
            self._budget_checked = True
            self._warn_uncounted_training(work)
        return work, grads

    def _warn_uncounted_training(self, work):
        """Once: parameters an offload() budget kept on the device train there, and
        their gradients and states were not counted in it (offload(train=...))."""
        n, nbytes, spec = 0, 0, None
        for group, ps, _, _ in work:
            for p in ps:
                if _C.optim_uncounted(p):
                    spec = self._train_spec(group)
                    n += 1
                    nbytes += _C.optim_train_bytes(spec, list(p.shape), p.element_size())
        if n:
            import warnings
            warnings.warn(
                f"layerstream.optim: {n} parameter(s) that offload(budget=...) kept on the device train there: "
                f"their gradients and optimizer states take {nbytes / 2**20:.2f} MiB beyond the budget, which "
                f"counted their weights only; offload(..., train={spec!r}) makes the budget hold them "
                "(docs/design/planner.md, \"Training\")", RuntimeWarning, stacklevel=_user_stacklevel())

    @staticmethod
    def _target(p):
        """What this rank steps of `p`: all of it, or, for a streamed tensor in a host store
        shared by a node's ranks (offload(share_host_store="all")), its shard of the
        elements (docs/design/distributed.md, "Sharded step")."""
        shard = getattr(p, "_layerstream_shard", None)
        return p.detach() if shard is None else shard.view(p.detach())

    @staticmethod
    def _shards(work):
        return [p._layerstream_shard for _, ps, _, _ in work for p in ps if hasattr(p, "_layerstream_shard")]

    def _held_if_sharded(self):
        """Ctrl-C held over a sharded step whole (Note [A sharded step lands a Ctrl-C when it
        is done]); a no-op without sharded parameters."""
        return held_interrupts() if self._sharded_params() else contextlib.nullcontext()

    def _end_sharded(self, written):
        """A sharded step's end, once per step (a re-run of one a Ctrl-C stopped after it
        skips it): the barrier that orders every rank's writes before any rank's next
        forward, and the versions of the shared tensors it wrote (Distributed.check_shards)."""
        unfinished = self._unfinished
        if written and not unfinished.ended:
            written[0]._layerstream_shard.barrier()
            for p in written:
                p._layerstream_shard.version = p._version
        unfinished.ended = True

    def _group_of(self, p):
        for group in self.param_groups:
            for q in group["params"]:
                if q is p:
                    return group
        raise KeyError("parameter not in this optimizer")

    def add_param_group(self, param_group):
        self._check_foreign_options(param_group, f"param group {len(self.param_groups)}")
        params = param_group["params"]
        if isinstance(params, set):
            # As torch refuses it: a set's order (state dict indices, stochastic rounding keys)
            # changes between runs, so a checkpoint's moments would reach other parameters.
            raise TypeError(f"param group {len(self.param_groups)}: its parameters are a set, whose order changes "
                            f"between runs (state dict indices, rounding streams); give a list, e.g. "
                            f"sorted by name from model.named_parameters()")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if len({id(p) for p in params}) != len(params):
            # torch warns (and will refuse); stepping one tensor twice in one kernel call
            # with one count gave numbers of neither torch's two steps nor one.
            raise ValueError(f"param group {len(self.param_groups)} lists a parameter more than once: list "
                             f"each parameter once (torch.optim warns that this will become an error)")
        param_group = dict(param_group, params=params)
        super().add_param_group(param_group)
        self._check_group_options(self.param_groups[-1])

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)
        if set_to_none:
            self._zeroed.clear()
        else:  # Note [Zeroed gradients an overlapped step dropped]
            self._zeroed.update((i, p) for i, p in self._dropped.items() if p.grad is None)
        self._dropped.clear()

    def _check_groups_foreign(self):
        """At each step: an option turned on through ``param_groups`` after the group
        was added (``opt.param_groups[0]["amsgrad"] = True``) is refused as at
        add_param_group(), not stepped without."""
        for gi, group in enumerate(self.param_groups):
            self._check_foreign_options(group, f"param group {gi}")

    @staticmethod
    def _check_foreign_options(group, where):
        """Options of torch's optimizers that change the numbers and that this one does
        not implement, in a param group given as a dict or in a state dict's group
        (e.g. torch.optim.AdamW's): refused, not ignored."""
