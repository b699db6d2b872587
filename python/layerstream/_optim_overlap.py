"""overlap() of layerstream.optim's optimizers and the scale step() settles before its
kernels run: the overlapped backward's plan (its checks, abort and counts), the global
clip's coefficient, and a torch.amp.GradScaler's loss scale and inf check.
docs/design/optim.md, "Overlap" and "Loss scaling"."""
from __future__ import annotations

import contextlib

import torch

from . import _C
from ._interrupts import held_interrupts
from ._optim_calls import _EnterOrWarn, _Unfinished


class _OverlapAndScaling:
    """overlap() and step()'s first part (_scale_and_rest) of _HostOptimizer (a
    torch.optim.Optimizer). Each optimizer provides _overlap_plan(engine,
    speculation_bytes, keep_grads, loss_scale) and _PLAN_KEYS; _HostOptimizer the
    attributes its __init__ sets and its checks (_check_groups_foreign, and _StateDicts'
    _adopt_unadopted() and _check_still_sharded())."""

    # torch.amp.GradScaler.step() then hands step() the scale the gradients carry
    # and its inf check (as the attributes ``grad_scale`` and ``found_inf``) instead
    # of unscaling ``.grad`` first: step() unscales as the kernels read and skips a
    # step with a non-finite gradient (docs/design/optim.md, "Loss scaling").
    _step_supports_amp_scaling = True

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
        self._check_dtypes()
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
            if self._frame is not None and _C.OVERLAP_STEPPED in plan.wait():  # steps it keeps
                self._frame.wrote = True

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
            if unfinished.ended and self._frame is not None:  # its collectives ran
                self._frame.pending = False
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
        try:  # until it is settled: an error (here, or another rank's in a sharded step) takes it back
            status = plan.wait()
            counted = {id(p) for p, s in zip(plist, status) if s != 0}
            other = [g for _, ps, gs, _ in work for p, g in zip(ps, gs) if id(p) not in counted]
            other_sq = (_C.optim_grad_norm(other) * inv) ** 2 if (self.max_grad_norm is not None and other) else 0.0
            shard = next((p._layerstream_shard for p in plist if hasattr(p, "_layerstream_shard")), None)
            self._overlap_sharded = shard is not None  # step() records the versions of what it stepped
            if (self.max_grad_norm is not None or scaler is not None) and shard is not None:
                # Sharded: each rank's passes took the norm of its shards (AdamW) or of the
                # tensors it owns (Adafactor); every node's ranks cover each tensor once, so the
                # sum over the group counts it once per node.
                plan.sum_of_squares = self._frame.exchange(plan.sum_of_squares) / shard.nodes
            coef, norm, skipped = plan.settle(other_sq, found)
        except BaseException:
            self._abort(plan, plist)
            raise
        if self.max_grad_norm is not None:
            self.last_grad_norm = norm
        if scaler is not None:
            self._report_to_scaler(scaler, skipped and not found)
        mine = [p for p, s in zip(plist, status) if s not in (0, _C.OVERLAP_OTHER_RANK)]
        if self._frame is not None and mine and not skipped:
            self._frame.wrote = True
        self._dropped.update((id(p), p) for p in mine)
        #: Parameters the last overlapped backward stepped (or, clipping, took the norm of) early.
        self.last_overlap_params = len(mine)
        return coef, counted, mine, skipped
