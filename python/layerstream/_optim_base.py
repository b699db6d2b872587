"""_HostOptimizer, what layerstream.optim's AdamW and Adafactor share: gradient
collection and checks, param groups, zero_grad(), the sharded step's frame; with
overlap() and the step's scale (_optim_overlap.py) and state dicts (_optim_state.py)."""
from __future__ import annotations

import contextlib

import torch

from . import _C
from ._guards import LayerstreamError
from ._interrupts import held_interrupts
from ._optim_calls import _user_stacklevel
from ._optim_overlap import _OverlapAndScaling
from ._optim_state import _LIVE, _StateDicts


# Note [An error on one rank in a sharded step]
# A sharded step (offload(share_host_store="all")) is framed by collectives of the group:
# after an overlapped backward with max_grad_norm or a GradScaler, the clip norm's
# all-reduce; a barrier before this rank writes; and one after. An exception on one rank
# only (a refusal of its gradient, its C++ step, an out-of-memory, a new lr on that rank)
# left the others waiting in the next one until the group's timeout; and a re-run of
# step() on the rank that raised passed its opening barrier paired with the others'
# closing one: they went on before its shard was written, and their later collectives
# did not pair. So each of
# those collectives is one all-reduce that carries a flag per rank (Shard.exchange): a
# rank that raises anywhere in step() after the closure sends its failure at the step's
# next collective (one it has not passed: the others wait there), and every rank leaves
# the step at that one. Every rank then gathers what each wrote (nothing, all of its part,
# part of it) and raises: the failing rank its own error with a note, the others a
# LayerstreamError naming it; both say whether the weights and states were updated, partly
# or not at all. The shared tensors' versions are recorded (the writes were the step's
# own), `ended` is not: a re-run of step() on every rank passes the same collectives and
# steps what each rank has left (_Unfinished). Which collectives a step has is decided
# alike on every rank (sharded parameters, an overlapped backward, the optimizer's clip),
# never from what one rank has left to write. An exception raised by a collective itself
# (a rank that died, the group's timeout) is raised with a note of what this rank wrote.
# An exception in step()'s closure (the forward and backward) is not sent: the other
# ranks may be waiting in a collective of their own closure (DDP's all-reduces), which
# the flag's all-reduce would be paired with. The rank raises it at once, noting that
# no rank has stepped (none passes the opening barrier without it); the others raise
# their next collective's error at the group's timeout (at once if its process exits),
# with the note above or, raised inside their closure, that one.
class _ShardedFrame:
    """This rank's part in one sharded step's collectives (the Note above)."""

    __slots__ = ("shard", "overlapped", "pending", "wrote", "finished")

    def __init__(self, shard, overlapped):
        self.shard = shard  # a Shard of the step: its group
        self.overlapped = overlapped  # the step follows an overlapped backward
        self.pending = True  # the other ranks may wait for this one at a collective of the step
        self.wrote = False  # this step wrote weights or states on this rank (or may have: a kernel that raised)
        self.finished = False  # this rank wrote all of its part

    def exchange(self, payload: float = 0.0) -> float:
        """One of the step's collectives: the sum of the ranks' `payload`s."""
        failed, total = self._exchange(False, payload)
        if failed:
            raise _OtherRankFailed(failed)
        return total

    def exchange_failure(self):
        """This rank's failure, sent at the step's next collective."""
        return self._exchange(True)

    def _exchange(self, failed, payload=0.0):
        self.pending = False  # a collective that raises leaves none to pair with
        try:
            ranks, total = self.shard.exchange(failed, payload)
        except Exception as e:
            wrote = ("updated (all of its part)" if self.finished else "partly updated" if self.wrote
                     else "not updated")
            e.add_note(f"layerstream.optim: a collective of the sharded step (offload(share_host_store=\"all\")) "
                       f"raised this (the process group's timeout, or a rank that exited: another rank's error "
                       f"in step()'s closure is not sent, it keeps that rank from the step's collectives). On this "
                       f"rank the weights and optimizer states were {wrote}; restore the model and optimizer from "
                       f"the last checkpoint on every rank")
            raise
        self.pending = not ranks  # the step ends on every rank at one that carries a failure
        return ranks, total


class _OtherRankFailed(Exception):
    """Raised in a sharded step at a collective that carries another rank's failure."""

    def __init__(self, ranks):
        super().__init__(f"ranks {ranks} failed")
        self.ranks = ranks


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
        self._frame = None  # a sharded step()'s _ShardedFrame while it runs
        self._init_state_dicts()
        super().__init__(params, defaults)
        _LIVE.add(self)

    def _run_closure(self, closure):
        """step()'s closure (torch's contract: re-evaluates the loss with grad enabled).
        Sharded, an exception in it says what the step left (Note [An error on one rank
        in a sharded step])."""
        if closure is None:
            return None
        try:
            with torch.enable_grad():
                return closure()
        except Exception as e:
            if self._sharded_params():
                state = ("no rank has updated weights or optimizer states in this step (none steps before every "
                         "rank has run its closure)" if self._overlap is None and self._unfinished is None else
                         "this rank's weights and optimizer states are as what came before it left them (an "
                         "overlapped backward's steps, a step() that did not finish)")
                e.add_note(
                    f"layerstream.optim: this error was raised in step()'s closure, before this rank's part of the "
                    f"sharded step (offload(share_host_store=\"all\")): {state}. It is not sent to the other "
                    f"ranks (they may be waiting in a collective of their own closure): they raise at their next "
                    f"collective when the process group's timeout runs out, or at once if this process exits. Fix "
                    f"the cause and restart the run from the last checkpoint on every rank")
            raise

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
        if self._frame is not None:
            self._frame.wrote = True  # or may have, if its kernel raises
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
        self._check_dtypes()
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

    @contextlib.contextmanager
    def _sharded_frame(self):
        """Around a sharded step() after its closure: its collectives carry each rank's
        failure, and an exception on this rank is sent at the next one (Note [An error on
        one rank in a sharded step]); a no-op without sharded parameters."""
        sharded = self._sharded_params()
        if not sharded:
            yield
            return
        self._frame = frame = _ShardedFrame(sharded[0][1]._layerstream_shard, self._overlap is not None)
        try:
            yield
        except BaseException as e:
            if isinstance(e, _OtherRankFailed):
                self._sharded_step_failed(frame, e.ranks, None)
            elif frame.pending:  # the other ranks wait for this one at the step's next collective
                failed, _ = frame.exchange_failure()
                if self._overlap is not None:  # not taken yet: taken back as step()'s own refusals do
                    self._abort()
                self._sharded_step_failed(frame, failed, e)
            raise
        finally:
            self._frame = None

    def _held_if_sharded(self):
        """Ctrl-C held over a sharded step whole (Note [A sharded step lands a Ctrl-C when it
        is done]); a no-op without sharded parameters."""
        return held_interrupts() if self._frame is not None else contextlib.nullcontext()

    def _open_sharded(self):
        """A sharded step's barrier before this rank writes: every rank's backward has read
        the shared weights (and no rank writes after another one's error)."""
        if self._frame is not None and self._frame.pending:
            self._frame.exchange()

    def _end_sharded(self, written):
        """A sharded step's end, once per step (a re-run of one a Ctrl-C stopped after it
        skips it): the barrier that orders every rank's writes before any rank's next
        forward, and the versions of the shared tensors it wrote (Distributed.check_shards)."""
        frame = self._frame
        if frame is not None and frame.pending:
            frame.finished = True
            frame.exchange()
            frame.pending = False
            for p in written:
                p._layerstream_shard.version = p._version
        self._unfinished.ended = True

    def _sharded_step_failed(self, frame, failed, error):
        """After the collective at which every rank learnt that ranks `failed` raised in this
        sharded step: each says what it wrote (one all_gather_object, on every rank), and
        this rank raises (`error`, its own, with a note; else a LayerstreamError)."""
        for _, p in self._sharded_params():  # the step's own writes: not refused at the next forward
            p._layerstream_shard.version = p._version
        dist, group = torch.distributed, frame.shard.group
        mine = (None if error is None else f"{type(error).__name__}: {error}",
                "all" if frame.finished else "part" if frame.wrote else "none")
        reports: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(reports, mine, group=group)
        who = " and ".join(f"rank {r} ({reports[r][0]})" for r in failed)
        if all(w == "none" for _, w in reports):
            state = "The weights and optimizer states were not updated on any rank."
            todo = ("Fix the cause, then zero_grad() and go on (or run this batch again) on every rank." if
                    frame.overlapped else
                    "Fix the cause and run step() again on every rank (it steps the whole step), or zero_grad() "
                    "and go on.")
        else:
            wrote = {"all": "its part", "part": "part of its part", "none": "nothing"}
            state = ("The weights and optimizer states are partly updated: " +
                     ", ".join(f"rank {r} wrote {wrote[w]}" for r, (_, w) in enumerate(reports)) + ".")
            todo = ("Restore the model and optimizer from the last checkpoint on every rank, or accept the step "
                    "as it stands and go on with the next batch (the overlapped backward consumed its gradients)."
                    if frame.overlapped else
                    "Fix the cause and run step() again on every rank: each steps what it has left of this step (if "
                    "the error came from inside a C++ step, its parameters may be stepped twice: restore the model "
                    "and optimizer from the last checkpoint on every rank instead).")
        if error is not None:
            me = dist.get_rank(group)
            also = "".join(f"; rank {r} failed too ({reports[r][0]})" for r in failed if r != me)
            error.add_note(f"layerstream.optim: this error stopped the sharded step (offload(share_host_store=\"all\")) "
                           f"on every rank at its next collective (the others raised an error naming rank {me}{also}). "
                           f"{state} {todo}")
            return
        raise LayerstreamError(
            f"layerstream.optim.{type(self).__name__}: the sharded step (offload(share_host_store=\"all\")) failed on "
            f"{who}; this rank stopped at the step's next collective instead of waiting there. {state} {todo}") from None

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
        _C.optim_check_param_dtypes([p for p in params if isinstance(p, torch.Tensor)], len(self.param_groups))
        param_group = dict(param_group, params=params)
        super().add_param_group(param_group)
        self._check_group_options(self.param_groups[-1])

    def _check_dtypes(self):
        """Each trainable parameter's dtype, named by its place (unfrozen since
        add_param_group()): before a step or an overlapped backward changes anything."""
        for gi, g in enumerate(self.param_groups):
            _C.optim_check_param_dtypes(g["params"], gi)

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
