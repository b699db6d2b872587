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
docs/design/optim.md. What the two share: ``_HostOptimizer`` (_optim_base.py).

Mixed precision: ``torch.amp.GradScaler`` hands ``step()`` its scale and inf
check (``scaler.step(opt)`` skips a step with Inf/NaN gradients, as for
torch's optimizers); with ``overlap()``, pass it (``grad_scaler=scaler``).

One param group may hold parameters on the host and on one device (an
offloaded model's streamed and resident parameters). Refused with an error:
sparse gradients, one group's parameters on two devices besides the host,
dtypes other than float32 / bfloat16.
"""
from __future__ import annotations

import torch

from . import _C
from ._interrupts import held_interrupts
from ._optim_base import _HostOptimizer

__all__ = ["AdamW", "Adafactor"]


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
    ``exp_avg_absmax`` / ``exp_avg_sq_absmax``). ``state_dict()`` saves the
    codes as ``exp_avg_codes`` / ``exp_avg_sq_codes``, so that torch's AdamW
    does not take them for moments (its ``step()`` then raises
    ``KeyError: 'exp_avg'``; a state dict that has them under ``exp_avg`` /
    ``exp_avg_sq`` loads too). ``load_state_dict()`` keeps each group's
    ``state_precision``, not the checkpoint's, and converts the loaded states
    into it (8-bit to the nearest codes; docs/design/optim.md, "Converting
    states"). A ``torch.optim.AdamW`` state dict loads into any precision; to
    hand 8-bit states to torch, load them into an fp32 ``AdamW`` over the same
    parameters and save its ``state_dict()``.

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

    _OWN_OPTIONS = ("state_precision",)

    # 8-bit codes in a state dict: keys of their own, so that torch's AdamW, which would cast the
    # codes to floats as if they were moments, finds no moments (its step() raises KeyError).
    _CODE_KEYS = {"exp_avg": "exp_avg_codes", "exp_avg_sq": "exp_avg_sq_codes"}

    @classmethod
    def _saved_state(cls, st):
        m = st.get("exp_avg")
        if not (isinstance(m, torch.Tensor) and m.dtype == torch.uint8):
            return st
        return {cls._CODE_KEYS.get(k, k): v for k, v in st.items()}

    @classmethod
    def _loaded_state(cls, st):
        names = {v: k for k, v in cls._CODE_KEYS.items()}  # (a state dict saved before: the codes under exp_avg)
        return {names.get(k, k): v for k, v in st.items()}

    # The state entries kept in host memory whatever the parameter's device (_states and
    # _adopt make them there); the others sit beside the parameter (_move_states_back).
    _HOST_STATES = ("step",)

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
        with self._sharded_frame():  # Note [An error on one rank in a sharded step]
            work, grads = self._collect()
            with self._held_if_sharded():  # Note [A sharded step lands a Ctrl-C when it is done]
                scale, inv, work, stepped, skipped = self._scale_and_rest(work, grads)
                if not skipped:
                    self._last_clipped = scale < 1.0
                # Stepped during the backward: a layer's shard once its averaged gradient
                # landed, i.e. after every rank's backward of that layer (their all-reduces
                # pair), so after their last read of its weights.
                early = [p for p in stepped if hasattr(p, "_layerstream_shard")]
                # Sharded: every rank's backward has read the shared weights before any
                # rank writes its shard, and every shard is written before anyone reads on.
                self._open_sharded()
                for group, ps, gs, keys in work:
                    if not ps:
                        continue
                    fmt = group["state_precision"]
                    b1, b2 = group["betas"]
                    with held_interrupts(), self._counted_if_stepped(ps) as states:
                        states += [self._states(p, fmt, count=False) for p in ps]
                        _C.optim_adamw_step(
                            float(group["lr"]), float(b1), float(b2), float(group["eps"]),
                            float(group["weight_decay"]), fmt, [self._target(p) for p in ps],
                            [self._shard_grad(p, g) for p, g in zip(ps, gs)],
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

    _HOST_STATES = ("step", "RMS")  # as AdamW's

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
        with self._sharded_frame():  # Note [An error on one rank in a sharded step]
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
                # Sharded (offload(share_host_store="all")): whole tensors, each stepped by the
                # rank that owns it (Shard.assign_owners), after every rank's backward has read
                # the shared weights; every tensor is written before anyone reads on.
                self._open_sharded()
                if sharded:
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
                            *self._config(group), [p.detach() for p in ps], gs,
                            [s.get("exp_avg_sq_row") for s in states], [s.get("exp_avg_sq_col") for s in states],
                            [s.get("exp_avg_sq") for s in states], [s.get("exp_avg") for s in states],
                            [s["step"] + 1 for s in states], keys, scale * inv,
                            int(group["seed"]))
                        for s, r in zip(states, rms):
                            s["RMS"].fill_(r)
                seen = {id(p) for p in sharded}
                self._end_sharded(sharded + [p for p in early if id(p) not in seen])
        self._unfinished = None  # done: a step() now is a new one
        return loss
