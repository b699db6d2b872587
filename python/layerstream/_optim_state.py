"""State dicts of layerstream.optim's optimizers: loading states torch would cast, and
the checkpoints of a sharded step (offload(share_host_store="all"): each rank's state
dict holds its shard and says whose; consolidate_state_dict() gathers whole tensors'
states). docs/design/optim.md, "The Python optimizer"; docs/design/distributed.md,
"Sharded step"; and the states Handle.suspend() moves with their parameters."""
import weakref

import torch

from ._interrupts import held_interrupts


class _Keep:
    """Carries a state tensor through ``Optimizer.load_state_dict``, which would
    cast floating-point state to the parameter's dtype (fp32 states of a bf16
    parameter, 8-bit codes); the optimizer adopts it afterwards."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


class _StateDicts:
    """state_dict(), load_state_dict() and consolidate_state_dict() of _HostOptimizer (a
    torch.optim.Optimizer). The optimizer provides _adopt(p, group, loaded, name) (a
    loaded state in the layout its kernels need), _group_of(p), _check_group_options
    and, for sharded parameters, _whole_state(p, pieces), _shard_of_state(p, loaded),
    _check_whole_states(sharded) and _check_splittable(state_dict, sharded), and its
    ``_overlap`` (an overlapped backward not yet stepped)."""

    def _init_state_dicts(self):
        self._consolidated = None  # consolidate_state_dict()'s whole states, by state-dict index, until a step
        self._shard_seen = None  # _shard_identity() of the states while they are a sharded step's
        self._unadopted = {}  # id -> meta parameter whose loaded states wait (Note [States loaded for a meta parameter])
        self._whole_states = False  # offload() sharded parameters whose states are whole (Note [States made ...])

    # The state dict's record of whose shard it holds (offload(share_host_store="all")):
    # {"rank": this rank's index among its node's ranks, "ranks": their number}.
    _SHARD_KEY = "layerstream_shard"

    def _sharded_params(self):
        """(index in the state dict, parameter) of the sharded parameters."""
        every = [p for g in self.param_groups for p in g["params"]]
        return [(i, p) for i, p in enumerate(every) if hasattr(p, "_layerstream_shard")]

    def _shard_identity(self, sharded=None):
        """Whose shards this optimizer's states are; still after handle.detach() (the
        states stay shards while the parameters are whole again)."""
        sharded = self._sharded_params() if sharded is None else sharded
        if sharded:
            shard = sharded[0][1]._layerstream_shard
            self._shard_seen = {"rank": shard.index, "ranks": shard.count}
        return self._shard_seen

    def _check_still_sharded(self):
        """Before a step: notes whose shards the states are, and refuses to step shard
        states whose parameters handle.detach() made whole again."""
        sharded = self._sharded_params()
        if sharded or self._shard_seen is None:
            self._shard_identity(sharded)
        else:
            who = self._shard_seen
            raise RuntimeError(
                f"layerstream.optim: this optimizer's states are rank {who['rank']} of {who['ranks']}'s shards of a "
                f"sharded step (offload(share_host_store=\"all\")), and its model was detached (handle.detach()): "
                f"the parameters are whole again. Save the optimizer before detach() (opt.consolidate_state_dict() "
                f"on every rank, then rank 0's opt.state_dict(): whole tensors' states) and load that into a new "
                f"optimizer of the detached model")

    def consolidate_state_dict(self, to=0):
        """Sharded (``offload(share_host_store="all")``): gathers the ranks' shards of
        the optimizer states on rank ``to`` (of offload()'s process group), whose next
        ``state_dict()`` then holds the states of whole tensors, as one process's: a
        checkpoint that loads into any number of ranks, or into one process. Call it
        on every rank after a step, and ``state_dict()`` before the next one (as
        torch's ``ZeroRedundancyOptimizer.consolidate_state_dict``). The other ranks'
        state dicts stay their shards. Without sharding it does nothing."""
        self._consolidated = None
        self._adopt_unadopted()  # and _take_shards()
        sharded = self._sharded_params()
        if not sharded:
            return
        self._check_not_pending("consolidate_state_dict()")
        shard = sharded[0][1]._layerstream_shard
        dist, group = torch.distributed, shard.group
        size, me = dist.get_world_size(group), dist.get_rank(group)
        if not 0 <= to < size:
            raise ValueError(f"consolidate_state_dict(to={to}): `to` is a rank of the {size} in the group")
        self._check_whole_states(sharded)
        mine = {i: dict(self.state[p]) for i, p in sharded if len(self.state.get(p, {})) > 0}
        # (index among the node's ranks, its states): every node's ranks hold the same
        # shards (the gradients are averaged over all of them); one of each index is kept.
        pieces = [None] * size if me == to else None
        dist.gather_object((shard.index, mine), pieces, dst=to if group is None else dist.get_global_rank(group, to),
                           group=group)
        if pieces is not None:
            by_index = {}
            for index, piece in pieces:
                by_index.setdefault(index, piece)
            ordered = [by_index[index] for index in range(shard.count)]
            self._consolidated = {i: self._whole_state(p, [piece.get(i) for piece in ordered]) for i, p in sharded}

    def _check_whole_states(self, sharded):
        """Refuses what cannot be consolidated (AdamW: 8-bit states)."""

    def _check_not_pending(self, what):
        if self._overlap is not None:
            raise RuntimeError(
                f"layerstream.optim: {what} between an overlapped backward and step(): the layers stepped during "
                f"the backward are a step ahead of the others (their states and weights), and the others' "
                f"gradients are not in the state; call step() first")

    # Group options a load_state_dict() keeps from this optimizer, not the state dict's (AdamW:
    # state_precision; the loaded states are adopted into it, as the C++ AdamW::load does).
    _OWN_OPTIONS = ()

    @staticmethod
    def _saved_state(st):
        """A parameter's state as its state dict holds it (AdamW: 8-bit codes renamed)."""
        return st

    @staticmethod
    def _loaded_state(st):
        """Undoes _saved_state for a loaded state (a new dict)."""
        return dict(st)

    def state_dict(self):
        self._check_not_pending("state_dict()")
        self._take_shards()  # Note [States made before their parameters were sharded]
        sd = super().state_dict()
        if self._consolidated is not None:
            for i, st in self._consolidated.items():
                if st:
                    sd["state"][i] = st
                else:
                    sd["state"].pop(i, None)
        sd["state"] = {i: self._saved_state(st) for i, st in sd["state"].items()}
        if self._consolidated is not None:
            return sd
        identity = self._shard_identity()
        if identity is not None:
            sd[self._SHARD_KEY] = dict(identity)
        return sd

    def _check_shard_identity(self, state_dict):
        """A sharded optimizer's state dict holds one rank's shard of the states
        (AdamW: its elements of each tensor; Adafactor: the tensors it owns): it loads
        into that rank of the same number of ranks per node, and nowhere else (another
        rank's would step this rank's elements with its moments, silently). A whole
        one (one process's, or consolidate_state_dict()'s) loads anywhere: a sharded
        optimizer takes its shard of it. Returns whether to take shards."""
        saved, mine = state_dict.get(self._SHARD_KEY), self._shard_identity()
        if saved == mine or not state_dict.get("state"):
            return False
        if saved is None:
            self._check_splittable(state_dict, self._sharded_params())
            return True
        def who(i):
            return (f"rank {i['rank']} of {i['ranks']} sharing a node's host store" if i is not None
                    else "an unsharded optimizer (the states of whole tensors)")
        raise RuntimeError(
            f"layerstream.optim: this state dict holds the optimizer states of {who(saved)}; this optimizer "
            f"is {who(mine)}. Under offload(share_host_store=\"all\") each rank steps and saves its own shard: "
            f"save and load one state dict per rank (e.g. f\"optimizer-rank{{rank}}.pt\"), with the same "
            f"number of ranks per node, or save a whole one (opt.consolidate_state_dict() on every rank, then "
            f"opt.state_dict() on rank 0), which loads anywhere (docs/design/distributed.md, \"Sharded step\")"
            + (". A rank's own loads once offload(share_host_store=\"all\") has sharded the parameters: load it "
               "after offload()" if mine is None else ""))

    def _check_splittable(self, state_dict, sharded):
        """Refuses a whole state dict this sharded optimizer cannot take its shards of."""

    def load_state_dict(self, state_dict):
        self._check_not_pending("load_state_dict()")
        for i, group in enumerate(state_dict.get("param_groups", [])):  # before anything loads
            self._check_foreign_options(group, f"param group {i} of the state dict")
        sd = dict(state_dict)
        sd["state"] = {k: self._loaded_state(v) for k, v in state_dict["state"].items()}
        split = self._check_shard_identity(sd)
        self._consolidated = None
        sd.pop(self._SHARD_KEY, None)
        sd["state"] = {
            k: {kk: (_Keep(vv) if isinstance(vv, torch.Tensor) and kk != "step" else vv) for kk, vv in v.items()}
            for k, v in sd["state"].items()
        }
        # torch's load builds new state and group objects: keeping the old ones puts them back when
        # something below refuses the load (a state's shape, a group's option), so that nothing is half
        # loaded (a retry, or a fresh start after the error, steps the states it had).
        kept = self.state, self.param_groups
        try:
            super().load_state_dict(sd)
            saved_as = {}  # id(group) -> how the state dict's differs in _OWN_OPTIONS, for the errors
            for group, mine in zip(self.param_groups, kept[1]):
                # e.g. a torch.optim.AdamW state dict: its groups lack our options
                for k, v in self.defaults.items():
                    group.setdefault(k, v)
                differ = [k for k in self._OWN_OPTIONS if group[k] != mine[k]]
                if differ:
                    saved_as[id(group)] = (" (saved with " + ", ".join(f"{k}={group[k]!r}" for k in differ)
                                           + "; its param group here keeps "
                                           + ", ".join(f"{k}={mine[k]!r}" for k in differ) + ")")
                group.update({k: mine[k] for k in self._OWN_OPTIONS})
                self._check_group_options(group)
            index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
            unadopted = {}
            for p, st in list(self.state.items()):
                if any(isinstance(v, _Keep) for v in st.values()):
                    loaded = {k: (v.tensor if isinstance(v, _Keep) else v) for k, v in st.items()}
                    st.clear()
                    group = self._group_of(p)
                    name = f"parameter {index.get(id(p), '?')}{saved_as.get(id(group), '')}"
                    if p.is_meta:  # Note [States loaded for a meta parameter]
                        # adopted for the meta parameter only to check the shapes and dtypes now
                        self._adopt(p, group, loaded, name)
                        st.update(loaded)
                        unadopted[id(p)] = p
                        continue
                    if split and hasattr(p, "_layerstream_shard"):
                        loaded = self._shard_of_state(p, loaded)
                        if loaded is None:  # another rank's to step
                            continue
                    st.update(self._adopt(p, group, loaded, name))
        except BaseException:
            self.state, self.param_groups = kept
            raise
        self._unadopted = unadopted
        self._whole_states = False  # this rank's shards if sharded now, else whole ones of whole parameters
        self._shard_seen = None
        self._shard_identity()  # the loaded states are this rank's shards, or whole ones

    # Note [States loaded for a meta parameter]
    # A model built on the meta device and given its checkpoint by load_safetensors() has
    # meta parameters (FileWeight) until offload() reads them; an optimizer state loaded
    # before that was adopted in the layout of the meta parameter: meta tensors, the moments
    # lost (step() refused them without saying why, and state_dict() saved them). The loaded
    # tensors stay as they are (state_dict() gives them back) until the parameter has
    # values; the next step() or overlap() adopts them, for the parameter as it is then
    # (streamed, resident on the device, or this rank's shard), as a load after offload() does.
    def _adopt_unadopted(self):
        self._take_shards()  # Note [States made before their parameters were sharded]
        if not self._unadopted:
            return
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        for i, p in list(self._unadopted.items()):
            if p.is_meta:
                continue
            loaded = dict(self.state.get(p, {}))
            if not loaded:
                del self._unadopted[i]
                continue
            if hasattr(p, "_layerstream_shard"):  # whole states (a shard's did not load into a meta model)
                self._check_splittable({"state": {index.get(i, -1): loaded}}, [(index.get(i, -1), p)])
                loaded = self._shard_of_state(p, loaded)
            st = self.state[p]
            adopted = None if loaded is None else self._adopt(p, self._group_of(p), loaded,
                                                              f"parameter {index.get(i, '?')}")
            st.clear()
            if adopted is not None:
                st.update(adopted)
            del self._unadopted[i]


    # Note [States made before their parameters were sharded]
    # offload(share_host_store="all") shards the trainable streamed parameters: a rank's
    # states are its elements of each (AdamW) or the tensors it owns (Adafactor). States an
    # optimizer already held (loaded before offload(), as a resume that loads the model and
    # then the optimizer may; or made by a step before it) are whole tensors': the first
    # sharded step refused AdamW's ("the states of parameter 0 do not match it"), and a
    # rank kept and saved Adafactor's of tensors another rank steps. So offload() marks
    # the optimizers that hold such states (_states_made_whole), and their next step(),
    # overlap(), state_dict() or consolidate_state_dict() takes this rank's shard of them,
    # as a whole state dict loaded after offload() is (8-bit states refused likewise).
    def _take_shards(self):
        if not self._whole_states:
            return
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        held = [(index[id(p)], p) for p, st in self.state.items()
                if len(st) > 0 and hasattr(p, "_layerstream_shard") and id(p) not in self._unadopted
                and id(p) in index]
        self._check_splittable({"state": {i: self.state[p] for i, p in held}}, held)  # before any changes
        with held_interrupts():  # all or none: a second pass would take shards of shards
            for i, p in held:
                st = self.state[p]
                piece = self._shard_of_state(p, st)
                if piece is st:  # Adafactor: whole tensors, this rank's own
                    continue
                adopted = None if piece is None else self._adopt(p, self._group_of(p), piece, f"parameter {i}")
                st.clear()
                if adopted is not None:
                    st.update(adopted)
            self._whole_states = False


def _states_made_whole(params) -> None:
    """offload(share_host_store="all") sharded `params`: the live layerstream optimizers
    holding states of any of them take their shards of those before their next use
    (Note [States made before their parameters were sharded])."""
    ids = {id(p) for p in params}
    for opt in list(_LIVE):
        if any(len(st) > 0 and id(p) in ids for p, st in opt.state.items()):
            opt._whole_states = True


# Every live AdamW / Adafactor: Handle.suspend() moves their states of the parameters
# it moves off the device (_move_states_of), and resume() puts them beside those again
# (_move_states_back).
_LIVE = weakref.WeakSet()


def _move_states_of(params, device: torch.device, move) -> None:
    """Moves the state tensors on `device` that the live layerstream optimizers keep
    for `params` by `move` (tensor -> its copy elsewhere), as Handle.suspend()
    moves the parameters. torch's own optimizers are not seen."""
    with torch.inference_mode(False):  # as _handle._moved_off
        for opt in list(_LIVE):
            for p in params:
                st = opt.state.get(p)
                for key, t in (st or {}).items():
                    if isinstance(t, torch.Tensor) and t.device == device:
                        st[key] = move(t)


def _move_states_back(params) -> None:
    """Handle.resume(): for each (parameter, the device it is back on) of `params`, every
    state tensor the live layerstream optimizers keep for it beside it (all but their
    _HOST_STATES, as a step of a parameter on that device makes them) goes to that
    device. Looked up in each optimizer now: besides the states _move_states_of moved,
    those a load_state_dict() or a first step() made while suspended, beside the
    parameter then on the host."""
    with torch.inference_mode(False):  # as _handle._moved_off
        for opt in list(_LIVE):
            for p, device in params:
                st = opt.state.get(p)
                for key, t in (st or {}).items():
                    if isinstance(t, torch.Tensor) and t.device != device and key not in opt._HOST_STATES:
                        st[key] = t.to(device)
