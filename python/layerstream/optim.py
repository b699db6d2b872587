"""layerstream.optim: optimizers whose arithmetic is C++ on host threads.

``AdamW`` and ``Adafactor`` are ``torch.optim.Optimizer`` subclasses: param
groups, ``torch.optim.lr_scheduler`` schedulers (they change ``lr`` between
steps), ``state_dict()`` / ``load_state_dict()`` (also across processes; a
sharded step's: ``consolidate_state_dict()``) and ``zero_grad()`` work as with
torch's optimizers::

    opt = layerstream.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                  max_grad_norm=1.0, state_precision="bf16")
    loss.backward(); opt.step(); opt.zero_grad()

The step over parameters in host memory (streamed weights of an offloaded
model, or any CPU tensor) runs in the C++ kernels of ``csrc/core/optim/``
(vectorized, on a pool of host threads; ``csrc/layerstream/host_optim.h`` is the glue).
Parameters on another device (resident on a GPU) are stepped there with
torch's own tensor arithmetic (AdamW's with fp32 or bf16 states; Adafactor's
as transformers'). Design and numbers:
docs/design/optim.md.

Mixed precision: ``torch.amp.GradScaler`` hands ``step()`` its scale and inf
check (``scaler.step(opt)`` skips a step with Inf/NaN gradients, as for
torch's optimizers); with ``overlap()``, pass it (``grad_scaler=scaler``).

One param group may hold parameters on the host and on one device (an
offloaded model's streamed and resident parameters). Refused with an error:
sparse gradients, one group's parameters on two devices besides the host,
dtypes other than float32 / bfloat16.
"""
from __future__ import annotations

import contextlib

import torch

from . import _C
from ._interrupts import held_interrupts
from ._optim_calls import _EnterOrWarn, _Unfinished, _user_stacklevel
from ._optim_state import _LIVE, _StateDicts

__all__ = ["AdamW", "Adafactor"]


class _HostOptimizer(_StateDicts, torch.optim.Optimizer):
    """What AdamW and Adafactor share: gradient collection and checks, the
    global clip (``max_grad_norm``), loss scaling and state loading."""

    # torch.amp.GradScaler.step() then hands step() the scale the gradients carry
    # and its inf check (as the attributes ``grad_scale`` and ``found_inf``) instead
    # of unscaling ``.grad`` first: step() unscales as the kernels read and skips a
    # step with a non-finite gradient (docs/design/optim.md, "Loss scaling").
    _step_supports_amp_scaling = True
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

    def _grad_scale(self, grads, inv):
        """clip_grad_norm_(all gradients / loss scale, max_grad_norm)'s coefficient
        (1.0 when not clipping); `inv`: the loss scale's reciprocal. The gradients
        themselves are not modified: the kernels multiply each gradient element
        by coefficient * inv as they read it."""
        if self.max_grad_norm is None:
            return 1.0
        norm = _C.optim_grad_norm(grads) * inv
        self.last_grad_norm = norm
        return _C.optim_clip_coefficient(norm, self.max_grad_norm)

    def _loss_scaling(self):
        """What a torch.amp.GradScaler driving this step says: (the reciprocal of
        the scale the gradients in .grad still carry, whether it found a
        non-finite one); (1.0, False) without a scaler. Checks that an
        overlapped backward was told about the scaler (and only then)."""
        driven = hasattr(self, "found_inf")  # set by GradScaler.step() (_step_supports_amp_scaling)
        told = self._overlap is not None and self._overlap_scaler is not None
        if self._overlap is not None and driven != told:
            self._abort()  # speculated layers are taken back
            if driven:
                raise RuntimeError(
                    "layerstream.optim: scaler.step(optimizer) after an overlapped backward that was not given the "
                    "GradScaler: the layers it stepped during the backward used gradients still multiplied by the "
                    "loss scale, and a step with Inf/NaN gradients could not be skipped (layers stepped with "
                    "clipping's speculation are taken back; others keep that step). Pass the scaler: "
                    "`with opt.overlap(handle, grad_scaler=scaler): scaler.scale(loss).backward()`")
            raise RuntimeError(
                "layerstream.optim: overlap(grad_scaler=...) was given, so step through the scaler: "
                "scaler.step(optimizer), then scaler.update() (the overlapped backward's step was taken back)")
        if not driven:
            return 1.0, False
        gs = getattr(self, "grad_scale", None)  # None: scaler.unscale_(optimizer) ran already
        if told and gs is None:
            # The plan unscales each gradient as it reads it, some in step() from .grad (kept
            # ones, Adafactor's, those past the speculation bytes): unscale_ divided those
            # already, and they were divided twice (silently off by the scale).
            self._abort()
            raise RuntimeError(
                "layerstream.optim: scaler.unscale_(optimizer) after an overlapped backward given the GradScaler: "
                "its plan unscales the gradients as it reads them, some of them in step() from .grad, which "
                "unscale_ divided already. Drop unscale_ here: clip with the optimizer's max_grad_norm= and read "
                "the (unscaled) norm from last_grad_norm (layers stepped with the scaler's speculation are taken "
                "back; the rest of the model was not stepped)")
        inv = 1.0 if gs is None else float(torch.as_tensor(gs).double().reciprocal().float())  # as unscale_()
        fi = self.found_inf
        return inv, bool(fi.item() if isinstance(fi, torch.Tensor) else fi)

    def _report_to_scaler(self, scaler, found):
        """Adds the inf check of the gradients an overlapped backward consumed
        (GradScaler never saw them in .grad) to the scaler's record for this
        optimizer, which update() reads to back off the scale (and needs at least
        one of: an all-streamed model leaves no .grad to check). That record is
        GradScaler's own state, the same through torch 2.x."""
        try:
            per_device = scaler._per_optimizer_states[id(self)]["found_inf_per_device"]
        except (AttributeError, KeyError, TypeError) as e:
            raise RuntimeError(
                "layerstream.optim: overlap(grad_scaler=...) reports Inf/NaN gradients into the scaler's "
                f"per-optimizer record, which this GradScaler ({type(scaler).__name__}) does not have ({e!r}); "
                "step without overlap() under this scaler") from None
        cpu = torch.device("cpu")
        mark = torch.full((), 1.0 if found else 0.0, dtype=torch.float32)
        per_device[cpu] = per_device[cpu] + mark if cpu in per_device else mark

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

    def overlap(self, handle, speculation_bytes=None, keep_grads=False, grad_scaler=None):
        """Marks the backward inside as the last one of this optimizer step:
        each streamed layer of ``handle`` (the result of ``layerstream.offload``)
        is stepped on host threads as soon as its gradient has landed, while
        the rest of the backward runs. ``step()`` then waits for those steps
        and steps the other parameters. With gradient accumulation, wrap only
        the last micro-batch's backward (a layer whose gradient lands twice in
        one block, from two backwards or a retained graph's, is an error when
        the block ends: it was stepped with the first)::

            for i, batch in enumerate(micro_batches):
                loss = model(batch).mean() / len(micro_batches)
                if i < len(micro_batches) - 1:
                    loss.backward()
                else:
                    with opt.overlap(handle):
                        loss.backward()
            opt.step()
            opt.zero_grad()

        When the block ends, every layer it stepped is done (an error on the
        stepping thread is raised there, as a failed backward). Call
        ``step()`` next. A call of the model inside the block after its
        backward is refused (its layers may still be stepping). With ``max_grad_norm``, layers are stepped
        speculatively (unclipped) after a copy of their parameters and states
        is saved, up to ``speculation_bytes`` of copies (None: no limit,
        unless the previous step clipped, then none; 0: only the norms are
        taken early; the copies are allocated once and kept by the
        optimizer); if the clip triggers, ``step()``
        restores and re-steps them, so the result equals clip + step either
        way (docs/design/optim.md, "Overlap"). If the backward raises, the
        speculated layers are restored; layers stepped without clipping stay
        stepped. ``Adafactor``: with ``max_grad_norm`` only the norms are
        taken during the backward (no speculation, ``speculation_bytes`` is
        ignored) and ``step()`` steps those layers; without it, as AdamW.
        Sharded tensors (``offload(share_host_store="all")``): AdamW steps
        this rank's shard of each, Adafactor the tensors this rank owns (the
        others' gradients are dropped here).

        Gradients: a layer's gradient is consumed where it lands, in one pass
        with its update (AdamW; docs/design/optim.md, "Fusion"), and is not
        written to ``.grad``: after ``step()`` the parameters this block
        stepped have ``.grad`` None (as after ``zero_grad()``), so
        ``clip_grad_norm_(model.parameters(), ...)`` after the block sees only
        the other parameters: clip with ``max_grad_norm``. Pass
        ``keep_grads=True`` to read them (logging, a norm): ``.grad``
        then holds what a plain backward leaves there, at the cost of writing
        it. The layers were stepped with those gradients and with the groups'
        hyperparameters of when the block was entered: ``step()`` refuses a
        ``.grad`` written or replaced since (a custom clip, of the kept ones or
        of the other parameters') or a hyperparameter set since (set ``lr``
        before the block), which would reach only the other parameters.
        Without ``keep_grads``, a model whose trainable parameters all stream
        leaves no ``.grad`` to check: clip with ``max_grad_norm``, not between
        the block and ``step()``.

        Mixed precision with ``torch.amp.GradScaler``: pass it
        (``grad_scaler=scaler``; the backward is ``scaler.scale(loss).backward()``,
        then ``scaler.step(opt)`` and ``scaler.update()``). Each layer is then
        stepped with its gradient divided by the scale, speculatively (as with
        clipping, within ``speculation_bytes``), and ``step()`` takes the whole
        step back when any gradient is Inf or NaN, as the scaler skips it, and
        tells the scaler. Without it, a scaler's step after this block is an
        error. Called without ``with``, it does nothing and warns."""
        return _EnterOrWarn(self._overlap_block(handle, speculation_bytes, keep_grads, grad_scaler))

    @contextlib.contextmanager
    def _overlap_block(self, handle, speculation_bytes, keep_grads, grad_scaler):
        if self._overlap is not None:
            raise RuntimeError("layerstream.optim: overlap() while a previous overlapped backward has not been "
                               "followed by step() (or scaler.step()); that backward already stepped its streamed "
                               "layers with the gradients it had. Call step() after each overlapped backward; with "
                               "gradient accumulation, wrap only the last micro-batch's backward in overlap()")
        engine = handle._check()
        self._adopt_unadopted()  # Note [States loaded for a meta parameter]
        self._check_groups_foreign()
        if grad_scaler is not None and not grad_scaler.is_enabled():
            grad_scaler = None  # GradScaler(enabled=False): steps as without one
        loss_scale = None if grad_scaler is None else float(grad_scaler.get_scale())
        plan, plist = self._overlap_plan(engine, speculation_bytes, bool(keep_grads), loss_scale)
        ids = {id(p) for p in plist}
        hyper = {gi: self._hyperparameters(g) for gi, g in enumerate(self.param_groups)
                 if any(id(p) in ids for p in g["params"])}
        try:
            yield plan
            plan.wait()  # the block ends when every layer's gradient is consumed (keep_grads: in .grad)
        except BaseException:
            self._abort(plan, plist)
            raise
        self._overlap, self._overlap_scaler = (plan, plist), grad_scaler
        self._overlap_hyper = hyper
        # Without keep_grads too: a clip of the .grad left (the resident parameters') reached them only;
        # and a .grad None here that step() finds set was made by another backward, which it would skip.
        self._overlap_grads = [(p, p.grad, None if p.grad is None else p.grad._version)
                               for g in self.param_groups for p in g["params"]]

    def _take_overlap(self):
        """The pending overlapped backward's (plan, its parameters, its GradScaler), forgotten here."""
        (plan, plist), scaler = self._overlap, self._overlap_scaler
        self._overlap, self._overlap_scaler, self._overlap_hyper, self._overlap_grads = None, None, {}, []
        return plan, plist, scaler

    # The group entries an overlap plan steps with, per optimizer (_hyperparameters).
    _PLAN_KEYS = ()

    def _hyperparameters(self, group):
        """A group's entries that an overlapped backward's steps used, as plain values."""
        def plain(v):
            if isinstance(v, torch.Tensor):
                return v.item()
            return tuple(plain(x) for x in v) if isinstance(v, (tuple, list)) else v
        return {k: plain(group[k]) for k in self._PLAN_KEYS}

    def _check_overlap_inputs(self):
        """step() after an overlapped backward: the streamed layers were stepped during
        that backward with the hyperparameters of when the block was entered and the
        gradients as they landed. A change since then (a scheduler or warmup setting
        lr between the block and step(); a custom clip of the .grad the block left, the
        resident parameters' and the kept ones') would reach the other parameters only,
        silently: refused, the block's step taken back as far as it can be (as a scaler
        mismatch is; docs/design/optim.md, "Overlap")."""
        changed = []
        for gi, before in self._overlap_hyper.items():
            now = self._hyperparameters(self.param_groups[gi]) if gi < len(self.param_groups) else {}
            changed += [f"param group {gi}'s {k} from {v!r} to {now.get(k)!r}" for k, v in before.items()
                        if now.get(k) != v]
        # GradScaler.unscale_() does not move the version counters (torch's amp kernel): unscaling
        # kept gradients is not an edit, a clip after it is (test_optim.py checks both).
        edited = sum(1 for p, g, v in self._overlap_grads if p.grad is not g or (g is not None and g._version != v))
        if not changed and not edited:
            return
        self._abort()  # speculated layers are taken back
        taken = ("(layers stepped with clipping's or a scaler's speculation are taken back; the others keep the "
                 "step the backward gave them, and the rest of the model was not stepped)")
        if changed:
            raise RuntimeError(
                "layerstream.optim: " + "; ".join(changed) + " after `with opt.overlap(...)` was entered: the "
                "streamed layers were stepped during the backward with the values of then, and the rest would be "
                "stepped with the new ones. Set hyperparameters before the block (a scheduler's step() after "
                "opt.step(), a warmup's lr before the overlapped backward) " + taken)
        raise RuntimeError(
            f"layerstream.optim: the .grad of {edited} parameter(s) changed (written in place or replaced: a custom "
            "clip such as clip_grad_norm_, or zero_grad; or made by another backward, which belongs before the "
            "block) between the overlapped backward and step(): the streamed "
            "layers were already stepped with the gradients as they landed (without overlap(keep_grads=True) their "
            ".grad is None, so a clip there sees only the other parameters). Clip with the optimizer's "
            "max_grad_norm= (the result of clip + step, also with overlap), read gradients without writing them "
            "(torch.nn.utils.get_total_norm, or last_grad_norm), or drop overlap() " + taken)

    def _abort(self, plan=None, plist=None):
        """plan.abort() (None: the pending plan, taken) and _aborted(). Ctrl-C is held over
        both (Note [A Ctrl-C as a C++ call returns]): raised as abort() returned, it left
        the layers that stay stepped uncounted (Adafactor's counts behind them)."""
        with held_interrupts():
            if plan is None:
                plan, plist, _ = self._take_overlap()
            plan.abort()
            self._aborted(plan, plist)

    def _aborted(self, plan, plist):
        """After overlap()'s backward raised and plan.abort(): the bookkeeping of the
        layers that stay stepped (AdamW's step counters are the plan's own)."""

    def _count_overlapped(self, stepped):
        """After an overlapped backward's step (not skipped): counts it in the states of
        the parameters it stepped (AdamW's step counters are the plan's own)."""

    def _scale_and_rest(self, work, grads):
        """What step() does: (clip coefficient, the loss scale's reciprocal for the
        gradients in .grad, what it has left to step, the parameters an overlapped
        backward stepped, whether the step is skipped). The rest: after an
        overlapped backward, the parameters its plan did not cover; else
        everything. Skipped (a GradScaler found a non-finite gradient): nothing."""
        self._consolidated = None  # consolidate_state_dict()'s gathering is of the previous step
        if self._overlap is not None:
            self._check_overlap_inputs()
        self._check_still_sharded()
        unfinished, self._unfinished = self._unfinished, None
        if unfinished is not None and self._overlap is None and unfinished.resumes(work):
            self._unfinished = unfinished  # Note [A re-run step() completes an interrupted one]
            return unfinished.scale, unfinished.inv, unfinished.rest(work), [], False
        inv, found = self._loss_scaling()
        params = [p for _, ps, _, _ in work for p in ps]
        if self._overlap is None:
            scale = 1.0 if found else self._grad_scale(grads, inv)
            self._unfinished = _Unfinished(scale, inv, params, map(id, params) if found else ())
            return scale, inv, self._unfinished.rest(work), [], found
        # Ctrl-C held from taking the plan to its counts (Note [A Ctrl-C as a C++ call
        # returns]): raised as wait() or settle() returned, it left the stepped layers'
        # counts behind, and every later step of theirs off by one.
        with held_interrupts():
            scale, done, stepped, skipped = self._finish_overlap(work, inv, found)
            if not skipped:
                self._count_overlapped(stepped)
            # What a re-run step() finishes if a Ctrl-C lands as this block ends: the rest.
            self._unfinished = _Unfinished(scale, inv, params, map(id, params) if skipped else done)
        return scale, inv, self._unfinished.rest(work), stepped, skipped

    def _finish_overlap(self, work, inv, found):
        """After an overlapped backward: waits for the layers' steps and returns
        (clip coefficient, ids of the parameters already stepped, those parameters,
        whether the loss-scaled step is skipped)."""
        plan, plist, scaler = self._take_overlap()
        status = plan.wait()
        counted = {id(p) for p, s in zip(plist, status) if s != 0}
        other = [g for _, ps, gs, _ in work for p, g in zip(ps, gs) if id(p) not in counted]
        other_sq = (_C.optim_grad_norm(other) * inv) ** 2 if (self.max_grad_norm is not None and other) else 0.0
        shard = next((p._layerstream_shard for p in plist if hasattr(p, "_layerstream_shard")), None)
        self._overlap_sharded = shard is not None  # the same on every rank: step() ends with a barrier
        if (self.max_grad_norm is not None or scaler is not None) and shard is not None:
            # Sharded: each rank's passes took the norm of its shards (AdamW) or of the
            # tensors it owns (Adafactor); every node's ranks cover each tensor once, so the
            # sum over the group counts it once per node.
            from ._distributed import collective_device
            total = torch.tensor([plan.sum_of_squares], dtype=torch.float64, device=collective_device(shard.group))
            torch.distributed.all_reduce(total, group=shard.group)
            plan.sum_of_squares = total.item() / shard.nodes
        coef, norm, skipped = plan.settle(other_sq, found)
        if self.max_grad_norm is not None:
            self.last_grad_norm = norm
        if scaler is not None:
            self._report_to_scaler(scaler, skipped and not found)
        mine = [p for p, s in zip(plist, status) if s not in (0, _C.OVERLAP_OTHER_RANK)]
        self._dropped.update((id(p), p) for p in mine)
        #: Parameters the last overlapped backward stepped (or, clipping, took the norm of) early.
        self.last_overlap_params = len(mine)
        return coef, counted, mine, skipped


class AdamW(_HostOptimizer):
    """AdamW with torch.optim.AdamW's semantics, stepped by C++ kernels.

    Arguments as ``torch.optim.AdamW`` (``lr``, ``betas``, ``eps``,
    ``weight_decay``; no ``amsgrad``, ``maximize``, ``foreach``, ``fused``),
    plus:

    * ``max_grad_norm``: the step gives the result of
      ``torch.nn.utils.clip_grad_norm_(all params of this optimizer,
      max_grad_norm)`` followed by the step (the norm is over every param
      group, host and device parameters together). ``.grad`` is left
      unscaled; ``last_grad_norm`` is the total norm.
    * ``state_precision`` (per param group): ``"fp32"`` (default; fp32
      parameters then get torch's single-tensor AdamW arithmetic operation for
      operation, each rounded to fp32, without fused multiply-adds and with a
      correctly rounded sqrt, so the same on every CPU; torch's own CPU
      kernels fuse lerp and round sqrt otherwise: the two agree to about 1 ulp
      per step, which the tests check to 1e-6 relative), ``"bf16"`` (2 + 2 bytes per
      parameter, written by stochastic rounding) or ``"8bit"`` (1 + 1 bytes
      per parameter plus an fp32 absmax per block of 256 per state: a
      floating-point code per element relative to its block's absmax,
      chosen by stochastic rounding; docs/design/optim.md).
    * ``seed`` (per param group): the stochastic rounding seed (bf16
      parameters are always written by stochastic rounding; fp32 parameters
      with fp32 states use none). Results are deterministic for a seed,
      whatever the thread count.

    State per parameter: ``step`` (float32 tensor, as torch), ``exp_avg``,
    ``exp_avg_sq`` (float32 / bfloat16, or uint8 codes with
    ``exp_avg_absmax`` / ``exp_avg_sq_absmax``). A ``torch.optim.AdamW``
    state dict loads into an fp32 or bf16 one (and back, for fp32).

    NaN or Inf in a gradient propagate as in torch (with clipping, a NaN or
    infinite total norm reaches every parameter, as after
    ``clip_grad_norm_``); with 8-bit states, a non-finite moment makes its
    whole block of 256 NaN.
    """

    _PLAN_KEYS = ("lr", "betas", "eps", "weight_decay", "state_precision", "seed")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 max_grad_norm=None, state_precision="fp32", seed=0):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        state_precision=state_precision, seed=int(seed))
        super().__init__(params, defaults, max_grad_norm)
        self._backups = None  # _C.OverlapBackups: the copies speculative steps keep (overlap with clipping)
        self._last_clipped = False  # the last step's clip coefficient was below 1

    @staticmethod
    def _check_foreign_options(group, where):
        on = [k for k in ("amsgrad", "maximize") if group.get(k)]
        if group.get("decoupled_weight_decay") is False and group.get("weight_decay"):
            on.append("decoupled_weight_decay=False (torch.optim.Adam's weight decay, added to the gradient)")
        if on:
            raise ValueError(
                f"layerstream.optim.AdamW: {where} turns on {', '.join(on)}, which this optimizer does not "
                f"implement (it would step without them): leave them off, or keep torch's optimizer for this "
                f"run (a torch.optim.AdamW state dict without them loads)")

    @staticmethod
    def _check_group_options(group):
        b1, b2 = group["betas"]
        _C.optim_check_adamw(float(group["lr"]), float(b1), float(b2), float(group["eps"]),
                             float(group["weight_decay"]))
        group["state_precision"] = _C.optim_state_precision(group["state_precision"])

    def _adopt(self, p, group, loaded, name):
        fmt = group["state_precision"]
        m, v, a1, a2 = _C.optim_adamw_adopt_states(
            self._target(p), fmt, loaded.get("exp_avg"), loaded.get("exp_avg_sq"), loaded.get("exp_avg_absmax"),
            loaded.get("exp_avg_sq_absmax"), name)
        st = {"step": torch.as_tensor(loaded.get("step", 0.0), dtype=torch.float32).detach().clone().cpu(),
              "exp_avg": m, "exp_avg_sq": v}
        if a1 is not None:
            st["exp_avg_absmax"], st["exp_avg_sq_absmax"] = a1, a2
        return st

    @staticmethod
    def _train_spec(group):
        """offload(train=...)'s name for what this group keeps per parameter."""
        return "adamw-" + group["state_precision"]  # the canonical names: fp32, bf16, 8bit

    # Sharded checkpoints: a rank's states are its elements [lo, hi) of each tensor in
    # memory order (docs/design/distributed.md, "Sharded step").
    _NO_8BIT = ("layerstream.optim.AdamW: 8-bit states (state_precision='8bit') of a sharded step {what}: "
                "their blocks of 256 start at each rank's shard, so they do not line up with whole tensors'. "
                "Save one state dict per rank, or train with state_precision='fp32' or 'bf16'")

    def _check_whole_states(self, sharded):
        ids = {id(p) for _, p in sharded}
        if any(g["state_precision"] == "8bit" and any(id(p) in ids for p in g["params"]) for g in self.param_groups):
            raise RuntimeError(self._NO_8BIT.format(what="cannot be consolidated"))

    def _whole_state(self, p, pieces):
        if all(piece is None for piece in pieces):
            return {}
        shard = p._layerstream_shard
        if any(piece is None for piece in pieces):
            raise RuntimeError(f"layerstream.optim: consolidate_state_dict(): some ranks hold no optimizer state for "
                               f"{shard.name} and others do (every rank steps its shard of each tensor)")
        whole = {k: v for k, v in pieces[0].items() if k not in ("exp_avg", "exp_avg_sq")}
        for key in ("exp_avg", "exp_avg_sq"):
            t = torch.empty_like(p.detach(), dtype=pieces[0][key].dtype, device="cpu")  # p's layout
            flat = shard.flat(t)
            for index, piece in enumerate(pieces):
                lo, hi = shard.bounds(index)
                flat[lo:hi].copy_(piece[key])
            whole[key] = t
        return whole

    def _check_splittable(self, state_dict, sharded):
        states = state_dict["state"]
        for i, p in sharded:
            for key in ("exp_avg", "exp_avg_sq"):
                t = states.get(i, {}).get(key)
                if not isinstance(t, torch.Tensor):
                    continue
                if t.dtype == torch.uint8:
                    raise RuntimeError(self._NO_8BIT.format(what="cannot be taken from a whole state dict"))
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"layerstream.optim.AdamW: the loaded state '{key}' of parameter "
                                     f"{p._layerstream_shard.name} has shape {tuple(t.shape)}, the parameter "
                                     f"{tuple(p.shape)}")

    @staticmethod
    def _shard_of_state(p, loaded):
        out = dict(loaded)
        for key in ("exp_avg", "exp_avg_sq"):
            t = loaded.get(key)
            if isinstance(t, torch.Tensor):
                laid = torch.empty_like(p.detach(), dtype=t.dtype, device="cpu").copy_(t)  # p's memory order
                out[key] = p._layerstream_shard.view(laid).clone()
        return out

    def _states(self, p, fmt, count=True):
        st = self.state[p]
        if len(st) == 0:
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            m, v, a1, a2 = _C.optim_adamw_init_states(self._target(p), fmt)
            st["exp_avg"], st["exp_avg_sq"] = m, v
            if a1 is not None:
                st["exp_avg_absmax"], st["exp_avg_sq_absmax"] = a1, a2
        if count:
            st["step"] += 1
        return st

    def _overlap_plan(self, engine, speculation_bytes, keep_grads, loss_scale):
        groups, params = [], []
        key = 0
        for gi, group in enumerate(self.param_groups):
            b1, b2 = group["betas"]
            groups.append((float(group["lr"]), float(b1), float(b2), float(group["eps"]),
                           float(group["weight_decay"]), group["state_precision"], int(group["seed"])))
            for p in group["params"]:
                if p.device.type == "cpu" and p.requires_grad:
                    st = self._states(p, group["state_precision"], count=False)
                    shard = getattr(p, "_layerstream_shard", None)  # its elements only ("Sharded step")
                    params.append((p, st["exp_avg"], st["exp_avg_sq"], st.get("exp_avg_absmax"),
                                   st.get("exp_avg_sq_absmax"), st["step"], key, gi,
                                   shard.lo if shard else 0, shard.hi if shard else -1))
                key += 1
        if (self.max_grad_norm is not None or loss_scale is not None) and self._backups is None:
            self._backups = _C.OverlapBackups()  # the speculation's copies, kept across steps
        if speculation_bytes is None:
            # Speculate unless the last step clipped: a clip that triggers now
            # would restore and re-step every speculated layer in step().
            speculation_bytes = 0 if self._last_clipped else -1
        plan = _C.AdamWOverlap(engine, groups, params, self.max_grad_norm, int(speculation_bytes), self._backups,
                               keep_grads, loss_scale)
        return plan, [p for p, *_ in params]

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._run_closure(closure)  # before _collect(): it may compute the gradients
        work, grads = self._collect()
        with self._held_if_sharded():  # Note [A sharded step lands a Ctrl-C when it is done]
            scale, inv, work, stepped, skipped = self._scale_and_rest(work, grads)
            if not skipped:
                self._last_clipped = scale < 1.0
            shards = self._shards(work)
            # Stepped during the backward: a layer's shard once its averaged gradient
            # landed, i.e. after every rank's backward of that layer (their all-reduces
            # pair), so after their last read of its weights.
            early = [p for p in stepped if hasattr(p, "_layerstream_shard")]
            if shards:
                # Sharded: every rank's backward has read the shared weights before any
                # rank writes its shard, and every shard is written before anyone reads on.
                shards[0].barrier()
            for group, ps, gs, keys in work:
                if not ps:
                    continue
                fmt = group["state_precision"]
                b1, b2 = group["betas"]
                with held_interrupts(), self._counted_if_stepped(ps) as states:
                    states += [self._states(p, fmt, count=False) for p in ps]
                    _C.optim_adamw_step(
                        float(group["lr"]), float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]),
                        fmt, [self._target(p) for p in ps], [self._shard_grad(p, g) for p, g in zip(ps, gs)],
                        [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                        [s.get("exp_avg_absmax") for s in states], [s.get("exp_avg_sq_absmax") for s in states],
                        [int(s["step"].item()) + 1 for s in states], keys, scale * inv, int(group["seed"]))
            self._end_sharded(early + [p for _, ps, _, _ in work for p in ps if hasattr(p, "_layerstream_shard")])
        self._unfinished = None  # done: a step() now is a new one
        return loss

    @staticmethod
    def _shard_grad(p, g):
        shard = getattr(p, "_layerstream_shard", None)
        if shard is None:
            return g
        if g.stride() != p.stride():
            raise RuntimeError(f"layerstream.optim: the gradient of sharded parameter {shard.name} is laid out "
                               f"differently from it (strides {tuple(g.stride())} vs {tuple(p.stride())})")
        return shard.view(g)


class Adafactor(_HostOptimizer):
    """Adafactor with the semantics of ``transformers.optimization.Adafactor``
    (Shazeer & Stern, 2018, as transformers implements it), stepped by C++
    kernels. Same arguments and defaults::

        Adafactor(params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0,
                  decay_rate=-0.8, beta1=None, weight_decay=0.0,
                  scale_parameter=True, relative_step=True, warmup_init=False)

    Per step and parameter: ``beta2t = 1 - step ** decay_rate``; the second
    moment of ``grad**2 + eps[0]`` is kept factored (a row and a column
    mean over the last two dimensions) for parameters of 2 or more
    dimensions, else whole; ``update = grad / sqrt(second moment)``, divided
    by ``max(rms(update) / clip_threshold, 1)``; the learning rate is
    ``lr`` or, with ``relative_step``, ``min(1e-2 (1e-6 * step with
    warmup_init), 1 / sqrt(step))``, times ``max(eps[1], rms(param))`` with
    ``scale_parameter``; with ``beta1`` the update is averaged (first
    moment); ``weight_decay`` subtracts ``weight_decay * lr * param``.

    Differences: bf16 parameters are written back by stochastic rounding
    (transformers rounds to nearest), and ``max_grad_norm`` (clip over all
    parameters first, as for AdamW) and ``seed`` are added. State per
    parameter uses transformers' names (``step``, ``exp_avg_sq_row``,
    ``exp_avg_sq_col`` or ``exp_avg_sq``, ``exp_avg``, ``RMS``), all fp32.
    Host parameters are stepped by the C++ kernels; parameters on a GPU (layers
    a budget keeps resident) by torch's tensor arithmetic, as transformers'.
    """

    _PLAN_KEYS = ("lr", "eps", "clip_threshold", "decay_rate", "beta1", "weight_decay", "scale_parameter",
                  "relative_step", "warmup_init", "seed")

    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                 weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False, *,
                 max_grad_norm=None, seed=0):
        defaults = dict(lr=lr, eps=tuple(eps), clip_threshold=clip_threshold, decay_rate=decay_rate, beta1=beta1,
                        weight_decay=weight_decay, scale_parameter=scale_parameter, relative_step=relative_step,
                        warmup_init=warmup_init, seed=int(seed))
        super().__init__(params, defaults, max_grad_norm)

    @staticmethod
    def _check_foreign_options(group, where):
        if group.get("maximize"):
            raise ValueError(
                f"layerstream.optim.Adafactor: {where} turns on maximize, which this optimizer does not implement "
                f"(it would minimize): leave it off (negate the loss), or keep torch's optimizer for this run")

    @staticmethod
    def _config(group):
        lr = group["lr"]
        beta1 = group["beta1"]
        return (None if lr is None else float(lr), float(group["eps"][0]), float(group["eps"][1]),
                float(group["clip_threshold"]), float(group["decay_rate"]),
                None if beta1 is None else float(beta1), float(group["weight_decay"]),
                bool(group["scale_parameter"]), bool(group["relative_step"]), bool(group["warmup_init"]))

    @classmethod
    def _check_group_options(cls, group):
        _C.optim_check_adafactor(*cls._config(group))

    @staticmethod
    def _train_spec(group):
        """offload(train=...)'s name for what this group keeps per parameter."""
        return "adafactor" if group["beta1"] is None else "adafactor-beta1"

    # Sharded checkpoints: a rank holds the whole states of the tensors it owns.
    @staticmethod
    def _whole_state(p, pieces):
        return next((piece for piece in pieces if piece), {})

    @staticmethod
    def _shard_of_state(p, loaded):
        return loaded if p._layerstream_shard.owned else None

    def _adopt(self, p, group, loaded, name):
        row, col, v, m = _C.optim_adafactor_init_states(p.detach(), group["beta1"] is not None)
        st = {"step": int(loaded.get("step", 0))}
        for key, fresh in (("exp_avg_sq_row", row), ("exp_avg_sq_col", col), ("exp_avg_sq", v), ("exp_avg", m)):
            if fresh is None:
                continue
            t = loaded.get(key)
            if not isinstance(t, torch.Tensor) or t.shape != fresh.shape:
                raise ValueError(f"layerstream.optim.Adafactor: the loaded state of {name} needs '{key}' of shape "
                                 f"{tuple(fresh.shape)}, got {None if t is None else tuple(t.shape)}")
            st[key] = fresh.copy_(t)
        st["RMS"] = torch.as_tensor(loaded.get("RMS", 0.0), dtype=torch.float32).detach().clone().cpu()
        return st

    def _states(self, p, group, count=True):
        st = self.state[p]
        if len(st) == 0:
            row, col, v, m = _C.optim_adafactor_init_states(p.detach(), group["beta1"] is not None)
            st["step"] = 0
            for key, t in (("exp_avg_sq_row", row), ("exp_avg_sq_col", col), ("exp_avg_sq", v), ("exp_avg", m)):
                if t is not None:
                    st[key] = t
            st["RMS"] = torch.tensor(0.0)
        if count:
            st["step"] += 1
        return st

    def _aborted(self, plan, plist):
        for p, status in zip(plist, plan.wait()):  # wait() after abort(): the plan's final status
            if status == _C.OVERLAP_STEPPED:  # stepped without clipping: it stays stepped, counted
                self.state[p]["step"] += 1

    def _count_overlapped(self, stepped):
        for p in stepped:  # stepped during the backward with the state's count + 1
            self.state[p]["step"] += 1

    def _overlap_plan(self, engine, speculation_bytes, keep_grads, loss_scale):
        groups, params = [], []
        key = 0
        for gi, group in enumerate(self.param_groups):
            groups.append((self._config(group), int(group["seed"])))
            for p in group["params"]:
                if p.device.type != "cpu" or not p.requires_grad:
                    pass
                elif hasattr(p, "_layerstream_shard") and not p._layerstream_shard.owned:
                    # Sharded by whole tensors: another rank steps it (and counts its norm).
                    params.append((p, None, None, None, None, 1, torch.tensor(0.0), key, gi, False))
                else:
                    st = self._states(p, group, count=False)
                    params.append((p, st.get("exp_avg_sq_row"), st.get("exp_avg_sq_col"), st.get("exp_avg_sq"),
                                   st.get("exp_avg"), st["step"] + 1, st["RMS"], key, gi, True))
                key += 1
        plan = _C.AdafactorOverlap(engine, groups, params, self.max_grad_norm, keep_grads, loss_scale)
        return plan, [p for p, *_ in params]

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._run_closure(closure)  # before _collect(): it may compute the gradients
        work, grads = self._collect()
        with self._held_if_sharded():  # Note [A sharded step lands a Ctrl-C when it is done]
            scale, inv, work, stepped, skipped = self._scale_and_rest(work, grads)
            sharded = [p for _, ps, _, _ in work for p in ps if hasattr(p, "_layerstream_shard")]
            # An overlapped backward stepped sharded tensors already (each on its owner, once
            # every rank's backward of its layer was done: no barrier before); the one after
            # the step still orders those writes before any rank's next forward.
            early = ([p for g in self.param_groups for p in g["params"] if hasattr(p, "_layerstream_shard")]
                     if self._overlap_sharded else [])
            self._overlap_sharded = False
            if sharded:
                # Sharded (offload(share_host_store="all")): whole tensors, each stepped by the
                # rank that owns it (Shard.assign_owners), after every rank's backward has read
                # the shared weights; every tensor is written before anyone reads on.
                sharded[0]._layerstream_shard.barrier()
                mine = [[i for i, p in enumerate(ps) if not hasattr(p, "_layerstream_shard")
                         or p._layerstream_shard.owned] for _, ps, _, _ in work]
                work = [(group, [ps[i] for i in m], [gs[i] for i in m], [keys[i] for i in m])
                        for (group, ps, gs, keys), m in zip(work, mine)]
                # Another rank's to step: done here (a re-run finds nothing of this step left).
                self._unfinished.done.update(id(p) for p in sharded if not p._layerstream_shard.owned)
            for group, ps, gs, keys in work:
                if not ps:
                    continue
                with held_interrupts(), self._counted_if_stepped(ps) as states:
                    states += [self._states(p, group, count=False) for p in ps]
                    rms = _C.optim_adafactor_step(
                        *self._config(group), [p.detach() for p in ps], gs, [s.get("exp_avg_sq_row") for s in states],
                        [s.get("exp_avg_sq_col") for s in states], [s.get("exp_avg_sq") for s in states],
                        [s.get("exp_avg") for s in states], [s["step"] + 1 for s in states], keys, scale * inv,
                        int(group["seed"]))
                    for s, r in zip(states, rms):
                        s["RMS"].fill_(r)
            seen = {id(p) for p in sharded}
            self._end_sharded(sharded + [p for p in early if id(p) not in seen])
        self._unfinished = None  # done: a step() now is a new one
        return loss
