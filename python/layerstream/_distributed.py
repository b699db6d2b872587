"""offload() with several processes (torch.distributed): the process group, the
host store shared by the ranks of one node, DistributedDataParallel's ignore
list, and no_sync(). The engine does the work (csrc/torch/engine_distributed.cpp,
core/shared_region.h); docs/design/distributed.md says why it is built this way."""
import contextlib
import functools
import hashlib
import os
import socket
import weakref
from typing import List

import torch
import torch.nn as nn

from . import _C, _dynamo_marks
from ._guards import LayerstreamError


# Note [Checks of a call under torch.compile]
# The forward pre-hooks' checks that read Python state, compare bytes or issue a
# collective (DDP's ignore list and first training forward, the writes to a shared host
# store) cannot be traced: skipped while Dynamo traced the hook, a compiled model (under
# torch.compile(DDP(model)), DDP(torch.compile(model)), or compiled alone in a process
# group) trained on silently wrong. So a traced hook calls them through checked_eagerly,
# which Dynamo does not trace: they run at every call, as in eager, with a graph break
# around them, only where a DDP's forward runs or a host store is shared (a process
# group's forward already breaks the graph there: Engine.set_gradient_sync). So
# fullgraph=True fails under DDP, naming this (a one-rank DDP compiled it before).
@_dynamo_marks.disable(reason=(
    "layerstream's checks of a call under DistributedDataParallel, and of the writes to the host store "
    "a node's ranks share, run eagerly under torch.compile, with a graph break around them: compile "
    "without fullgraph=True there (Note [Checks of a call under torch.compile], "
    "python/layerstream/_distributed.py)"))
def checked_eagerly(check, *args):
    """check(*args), outside any graph (Note [Checks of a call under torch.compile])."""
    return check(*args)


def eagerly(check, *args):
    """check(*args) from a forward pre-hook: as is in an eager call, through
    checked_eagerly in one torch.compile traces."""
    if torch.compiler.is_compiling():
        return checked_eagerly(check, *args)
    return check(*args)


def resolve_group(process_group):
    """offload(process_group=...): None means the world group when torch.distributed is
    initialized and has several ranks (else none), False means none; a group given
    explicitly is used even with one rank (its all-reduce then runs over one)."""
    if process_group is False:
        return None
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        if process_group is not None:
            raise LayerstreamError("offload(process_group=...) needs torch.distributed to be initialized "
                                   "(torch.distributed.init_process_group) in every rank first")
        return None
    if process_group is not None:
        return process_group
    pg = torch.distributed.group.WORLD
    return pg if torch.distributed.get_world_size(pg) > 1 else None


class _WeakGroup:
    """A process group held weakly, as the engine holds it (engine_distributed.cpp,
    GradientGroup): torch owns a group until destroy_process_group(); a reference
    kept here would keep its backend's threads alive into the interpreter's shutdown."""

    def __init__(self, pg):
        self._ref, self._name = weakref.ref(pg), pg.group_name

    def get(self):
        pg = self._ref()
        _C.check_group_alive(pg is not None, self._name)
        return pg


def _node_id() -> str:
    """What tells the processes of one machine from the others'."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _fingerprint(model: nn.Module, layers: list, settings: dict, values: bool) -> List[str]:
    """What every rank's offload() must agree on: the parameters, the streamed layers
    and their formats, and the options that shape the store and the plan; with `values`,
    a sample of each streamed tensor's values (DDP's broadcast skips streamed parameters:
    ranks that initialised them differently would train different weights for good)."""
    rows = [f"{n} {tuple(p.shape)} {p.dtype} grad={p.requires_grad}" for n, p in model.named_parameters()]
    rows += [f"stream {c.name} {c.kind} {c.fmt}" for c in layers]
    rows += [f"option {k}={v!r}" for k, v in sorted(settings.items())]
    if values:
        rows += _value_rows((f"{c.name}.{n}", p) for c in layers
                            for n, p in c.module.named_parameters(recurse=c.kind == "group"))
    return rows


def _value_rows(named) -> List[str]:
    """A digest of a sample of each (name, tensor)'s values: 64 elements, evenly spaced."""
    from ._standin import StandIn
    rows = []
    for n, p in named:
        if isinstance(p, StandIn) or p.is_meta or p.numel() == 0:
            continue  # no values here (a file's, packed): the file or packing is the same
        try:
            flat = p.detach().reshape(-1)
            sample = flat[::max(1, flat.numel() // 64)][:64].to("cpu", torch.float64)
        except Exception:  # noqa: BLE001 - a tensor subclass that holds codes (bitsandbytes)
            continue
        rows.append(f"values {n} {hashlib.sha256(sample.numpy().tobytes()).hexdigest()[:16]}")
    return rows


def _first_difference(a: List[str], b: List[str]) -> str:
    """The first row of one rank's fingerprint the other lacks, against the other's (rows
    compared as sets: a layer one rank streams and the other not shifts every later row)."""
    in_a, in_b = set(a), set(b)
    only_a, only_b = [x for x in a if x not in in_b], [y for y in b if y not in in_a]
    if only_a or only_b:
        return (f"'{only_a[0]}'" if only_a else "nothing") + " against " + (f"'{only_b[0]}'" if only_b else "nothing")
    for x, y in zip(a, b):
        if x != y:
            return f"'{x}' against '{y}' (in another order)"
    return f"{len(a)} entries against {len(b)}"


class Distributed:
    """One offload()'s part in a process group: made before the engine, applied to it
    (share_store before the layers, finish after them)."""

    def __init__(self, pg, model: nn.Module, layers: list, settings: dict, share_host_store):
        dist = torch.distributed
        self._pg = _WeakGroup(pg)
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        # One host copy per node ("all") holds one rank's values; otherwise each rank's own.
        rows = _fingerprint(model, layers, settings, values=share_host_store != "all")
        digest = hashlib.sha256("\n".join(rows).encode()).hexdigest()
        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, (digest, _node_id(), os.getpid()), group=pg)
        if any(g[0] != digest for g in gathered):
            everyone: list = [None] * self.size
            dist.all_gather_object(everyone, rows, group=pg)
            other = next(r for r, g in enumerate(gathered) if g[0] != gathered[0][0])
            raise LayerstreamError(
                f"offload() with a process group of {self.size} ranks: the ranks' models or offload() options "
                f"differ (rank 0 and rank {other}: {_first_difference(everyone[0], everyone[other])}). Every "
                f"rank must start from the same streamed weights (seed the initialisation, or load one "
                f"checkpoint: DDP's broadcast skips them), and every "
                f"rank must offload the same model with the same options (budget, quantize, include/exclude, "
                f"...), or their collectives would not pair up.")
        node = gathered[self.rank][1]
        self.local = [r for r, g in enumerate(gathered) if g[1] == node]  # this node's ranks, in group order
        self.nodes = len({g[1] for g in gathered})
        # Trainable streamed tensors keep one copy per process (each rank's optimizer
        # steps its own; HostStore::add), frozen ones are shared.
        trainable = [f"{c.name}.{n}" if c.name else n for c in layers
                     for n, p in c.module.named_parameters() if p.requires_grad]
        self.trainable = len(trainable)
        self.share, self.why = self._decide(share_host_store)
        # "all": trainable tensors shared too, each rank stepping its shard (layerstream.optim).
        self.sharded = self.share and share_host_store == "all"
        self.shards: List[torch.Tensor] = []
        self.frozen = None  # the shared frozen tensors' _FrozenWrites, from finish() on
        self.region = None
        self.backwards = None  # SameBackwards, from finish() on
        if self.share:
            self._open_region(model, gathered)

    def _decide(self, wanted):
        if len(self.local) < 2:
            return False, "no other rank on this node"
        if wanted is False:
            return False, "share_host_store=False"
        return True, ""

    @property
    def pg(self):
        return self._pg.get()

    def _open_region(self, model: nn.Module, gathered: list) -> None:
        dist = torch.distributed
        leader = self.local[0]
        page = _C.SharedRegion.page_size()
        # A generous bound (the file is sparse: unwritten pages cost nothing): every
        # tensor twice (dense, or packed plus padding) plus a page of alignment each.
        tensors = list(model.parameters()) + list(model.buffers())
        capacity = 2 * sum(t.numel() * t.element_size() for t in tensors) + (2 * len(tensors) + 16) * page
        if self.rank == leader:
            self.region = _C.SharedRegion.create(capacity, "store")
            info = (self.region.pid, self.region.fd, self.region.capacity)
        else:
            info = None
        infos: list = [None] * self.size
        dist.all_gather_object(infos, info, group=self.pg)
        error = None
        if self.rank != leader:
            try:
                self.region = _C.SharedRegion.open(*infos[leader])
            except Exception as e:  # reported on every rank below, so that none waits forever
                error = str(e)
        errors: list = [None] * self.size
        dist.all_gather_object(errors, error, group=self.pg)  # also: every rank has mapped it
        if self.rank == leader:
            self.region.close_fd()  # nothing outlives the ranks (core/shared_region.h)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            raise LayerstreamError(f"rank {failed[0][0]} could not map the shared host store: {failed[0][1]}")

    def share_store(self, engine) -> None:
        """Before the first layer: the engine carves its store from the shared region."""
        if self.region is not None:
            engine.share_host_store(self.region, self.rank == self.local[0], self.sharded)

    def finish(self, engine, model: nn.Module, streamed_names: List[str]) -> None:
        """After the layers: the ranks of a node check they laid the store out alike and
        wait for its writer; the engine averages gradients over the group; the sharded
        tensors get their shards."""
        dist = torch.distributed
        if self.region is not None:
            digests: list = [None] * self.size
            dist.all_gather_object(digests, engine.host_store_digest, group=self.pg)  # the writer is done
            mine = {digests[r] for r in self.local}
            if len(mine) != 1:
                raise LayerstreamError("the ranks of this node laid the shared host store out differently "
                                       "(a bug, or models that differ in ways offload() did not check); "
                                       "pass share_host_store=False")
            named = dict(model.named_parameters())
            self.frozen = _FrozenWrites([(n, named[n]) for n in dict.fromkeys(streamed_names)
                                         if n in named and not named[n].requires_grad])
        engine.set_gradient_group(self.pg.group_name)
        if self.size > 1:
            self.backwards = SameBackwards(self, model, streamed_names)
            model.__dict__["_layerstream_same_backwards"] = self.backwards  # removed by forget_ddp_ignore
        check = model.__dict__.get("_layerstream_ddp_check")
        if check is not None:
            check.group = self  # the group its gradients are averaged over (DDPCheck)
        if self.sharded:
            named = dict(model.named_parameters(remove_duplicate=False))
            index, count = self.local.index(self.rank), len(self.local)
            for name in dict.fromkeys(streamed_names):
                p = named[name]
                if p.requires_grad and not hasattr(p, "_layerstream_shard"):
                    p._layerstream_shard = Shard(p, index, count, self.pg, name, self.nodes)
                    self.shards.append(p)
            Shard.assign_owners(self.shards, count)
            from ._optim_state import _states_made_whole
            _states_made_whole(self.shards)  # Note [States made before their parameters were sharded]

    @property
    def watched(self) -> bool:
        """Whether the store this node's ranks share holds tensors whose writes check_writes() checks."""
        return bool(self.shards) or bool(self.frozen)

    def check_writes(self) -> None:
        """Before a forward: the shared tensors were written by no one but a sharded step."""
        self.check_shards()
        if self.frozen:
            self.frozen.check()

    def check_shards(self) -> None:
        """No shared trainable tensor was written except by a sharded step."""
        for p in self.shards:
            if p._version != p._layerstream_shard.version:
                raise LayerstreamError(
                    f"streamed parameter {p._layerstream_shard.name} is in the host store this node's ranks share "
                    f"(share_host_store=\"all\") and was written by something other than layerstream.optim's "
                    f"sharded step (torch.optim, copy_, load_state_dict, ...): every rank writing the same memory "
                    f"corrupts it. Step it with layerstream.optim.AdamW (each rank steps its shard), load a "
                    f"checkpoint's weights before offload(), or offload with share_host_store=None (trainable "
                    f"weights: one copy per process).")

    def forget_shards(self) -> None:
        """detach(): nothing shared is checked any more."""
        for p in self.shards:
            del p._layerstream_shard
        self.shards = []
        self.frozen = None

    def describe(self) -> str:
        if self.sharded:
            where = (f"streamed weights: one host copy per node, shared by ranks {', '.join(map(str, self.local))} "
                     f"(written by rank {self.local[0]}); {len(self.shards)} trainable tensor(s) stepped in "
                     f"{len(self.local)} shards, one per rank (layerstream.optim)")
        elif self.share:
            where = (f"frozen streamed weights: one host copy per node, shared by ranks "
                     f"{', '.join(map(str, self.local))} (written by rank {self.local[0]})")
            if self.trainable:
                where += (f"; {self.trainable} trainable streamed tensor(s): one copy per process (each rank's "
                          f"optimizer steps its own)")
        else:
            where = f"one host copy per process ({self.why})"
        return (f"processes: rank {self.rank} of {self.size}; streamed weights' gradients averaged over the "
                f"group before their copy to the host; {where}\n")


def store_pss(pid="self") -> int:
    """The Pss bytes of a process's mappings of a shared host store (/proc/<pid>/smaps:
    each resident page's size divided by the number of processes mapping it, so that
    the ranks' sum is what the node holds). Linux; the tests and the benchmark use it."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                inside = "memfd:layerstream-store" in line
            elif inside and first == "Pss:":
                total += int(line.split()[1]) * 1024
    return total


# torch.compile's wrapper (OptimizedModule) names the model's parameters with this prefix.
_COMPILED = "_orig_mod."


def _listed(names: List[str]) -> List[str]:
    """The names offload() puts on DDP's ignore list for the streamed parameters `names`:
    each also as torch.compile's wrapper names it. DistributedDataParallel(torch.compile(
    model)) reads the model's list through the wrapper but names the parameters
    '_orig_mod.<name>': with the plain names alone it reduced the streamed gradients
    itself, and they arrived as zeros. DDP skips names its module does not have."""
    return names + [_COMPILED + n for n in names]


def wraps(ddp, model: nn.Module) -> bool:
    """Whether `ddp` wraps `model`, or torch.compile's wrapper of it."""
    return ddp.module is model or getattr(ddp.module, "_orig_mod", None) is model


def ignore_streamed_in_ddp(model: nn.Module, names: List[str]) -> None:
    """DistributedDataParallel(model), or of torch.compile(model), then leaves the streamed
    parameters to layerstream: it neither broadcasts them (host copies) nor checks their
    device nor reduces their gradients (the engine averages those); a DDPCheck on the model
    checks, at each DDP's first training forward, what that leaves undone. detach() takes
    them out again."""
    old = _plain(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    ignored = old + [n for n in _listed(names) if n not in old]
    model._layerstream_ddp_ignored = names
    if _may_run_ddp():
        model._ddp_params_and_buffers_to_ignore = ignored
        _add_ddp_check(model, names)
    else:  # DDP made later, after init_process_group(), reads the list: the check then
        model._ddp_params_and_buffers_to_ignore = _IgnoreList(ignored, model)


def _add_ddp_check(model: nn.Module, names: List[str]) -> None:
    check = DDPCheck(names)
    check.removable = model.register_forward_pre_hook(check)
    model.__dict__["_layerstream_ddp_check"] = check


class _IgnoreList(list):
    """DDP's ignore list on a model offloaded in a process that was not one of several
    ranks yet (no DDPCheck: _may_run_ddp). A job that passes rank and world size to
    init_process_group() itself (mp.spawn, srun) sets no WORLD_SIZE, and offload()
    before init_process_group() there left its DDP unchecked: the engine averaged over
    no group and the ranks' streamed weights drifted apart, silently. DDP reads this list
    when it is made (DistributedDataParallel.__init__: set(module.<list>)): read with
    torch.distributed initialized, it puts the DDPCheck on first. A copy is a plain list."""

    def __init__(self, names, model: nn.Module):
        super().__init__(names)
        self._model = weakref.ref(model)

    def __iter__(self):
        model = self._model()
        if (model is not None and "_layerstream_ddp_check" not in model.__dict__
                and "_layerstream_ddp_ignored" in model.__dict__ and _may_run_ddp()):
            _add_ddp_check(model, model._layerstream_ddp_ignored)
        return super().__iter__()

    def __reduce_ex__(self, protocol):
        return list, (list(super().__iter__()),)


def _may_run_ddp() -> bool:
    """Whether a DDP of several ranks may wrap the model: torch.distributed is initialized,
    or the launcher (torchrun) says the job has several ranks. A single process gets no
    DDPCheck (one forward pre-hook less on every call) until a DDP reads the ignore list
    after init_process_group() (_IgnoreList)."""
    dist = torch.distributed
    if not dist.is_available():
        return False
    if dist.is_initialized():
        return True
    try:
        return int(os.environ.get("WORLD_SIZE") or 1) > 1
    except ValueError:
        return False


def forget_ddp_ignore(model: nn.Module) -> None:
    """detach(): the streamed parameters off DDP's ignore list, and the checks off the model."""
    check = model.__dict__.pop("_layerstream_ddp_check", None)
    if check is not None:
        check.removable.remove()
    backwards = model.__dict__.pop("_layerstream_same_backwards", None)
    if backwards is not None:
        backwards.remove()
    names = set(_listed(model.__dict__.pop("_layerstream_ddp_ignored", [])))
    if names and hasattr(model, "_ddp_params_and_buffers_to_ignore"):
        model._ddp_params_and_buffers_to_ignore = [n for n in _plain(model._ddp_params_and_buffers_to_ignore)
                                                   if n not in names]


def _plain(names) -> list:
    """An ignore list's names, read without _IgnoreList's check."""
    return list(list.__iter__(names)) if isinstance(names, _IgnoreList) else list(names)


class DDPCheck:
    """A forward pre-hook on the offloaded model: at the first training forward (grad
    enabled, gradients synchronised) of each DistributedDataParallel that wraps it, with
    more than one rank, what DDP's ignore list leaves to layerstream is checked:

    - the engine averages the streamed gradients over DDP's ranks: without a group
      (offload(process_group=False), or offload() before init_process_group()) each rank
      would step its own gradients, and the ranks drift apart, silently;
    - the ranks hold the same streamed weights: DDP's broadcast at construction skips
      them, so a checkpoint loaded on rank 0 alone (after offload()) reached rank 0 alone.

    Only a training forward: every rank runs it together (their backwards' all-reduces
    pair up), so the all-gather of the weights' digests does too; a forward one rank
    runs alone (an evaluation on rank 0) is not checked. Compiled calls too (Note
    [Checks of a call under torch.compile])."""

    def __init__(self, names: List[str]):
        self.names = names
        self.group = None  # the offload()'s Distributed (its finish()), None without a group
        self.removable = None
        self._checked = []  # weak references to the DDPs checked

    def __call__(self, module, args):
        ddp = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
        if ddp is not None:
            eagerly(self._at_forward, module, ddp)
        return None

    def _at_forward(self, module, ddp) -> None:
        if (not wraps(ddp, module) or not torch.is_grad_enabled() or not ddp.require_backward_grad_sync
                or any(r() is ddp for r in self._checked)):
            return
        if self.check(module, ddp):
            self._checked = [r for r in self._checked if r() is not None] + [weakref.ref(ddp)]

    def check(self, model: nn.Module, ddp) -> bool:
        """Refuses what the docstring above says; False when it could not check yet."""
        dist = torch.distributed
        pg = ddp.process_group
        size = dist.get_world_size(pg)
        if size < 2:
            return True
        named = dict(model.named_parameters(remove_duplicate=False))
        streamed = [(n, named[n]) for n in self.names if n in named]
        if any(p.requires_grad for _, p in streamed):
            mine = None if self.group is None else self.group.pg
            if mine is None or dist.get_process_group_ranks(mine) != dist.get_process_group_ranks(pg):
                where = ("no group: offload() ran with process_group=False or before "
                         "torch.distributed.init_process_group()" if mine is None else
                         f"ranks {dist.get_process_group_ranks(mine)}, DDP's are {dist.get_process_group_ranks(pg)}")
                raise LayerstreamError(
                    f"DistributedDataParallel over {size} ranks leaves the streamed weights' gradients to "
                    f"layerstream (they are on its ignore list), but offload() averages them over {where}: the "
                    f"ranks would step different gradients and their weights drift apart. Call offload() after "
                    f"init_process_group() with process_group=None (the world group) or DDP's process group, or "
                    f"freeze the streamed weights.")
            if _joining(ddp) and _join_alive(ddp):
                return False  # refused by SyncHook, which comes next (no collective here: a rank may have joined)
        rows = _value_rows(streamed)
        digest = hashlib.sha256("\n".join(rows).encode()).hexdigest()
        gathered: list = [None] * size
        dist.all_gather_object(gathered, digest, group=pg)
        if any(g != digest for g in gathered):
            everyone: list = [None] * size
            dist.all_gather_object(everyone, rows, group=pg)
            other = next(r for r, g in enumerate(gathered) if g != gathered[0])
            raise LayerstreamError(
                f"DistributedDataParallel over {size} ranks: the ranks' streamed weights differ (rank 0 and rank "
                f"{other}: {_first_difference(everyone[0], everyone[other])}). DDP's broadcast at construction "
                f"skips the streamed parameters (they are on its ignore list), so a checkpoint loaded on one rank "
                f"reached that rank alone: load it on every rank (before or after offload()), or seed their "
                f"initialisation alike.")
        return True


def _dense(t: torch.Tensor) -> bool:
    """Its elements fill its storage range without gaps or overlaps, in some dimension order."""
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.size(d) != 1 and t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


class Shard:
    """A trainable streamed tensor in a store shared by `count` ranks of a node
    (share_host_store="all"). layerstream.optim.AdamW: this rank steps elements [lo, hi)
    of it in memory order; the others step theirs into the same memory. Adafactor,
    whose statistics span whole matrices: the tensor's `owner` (a local rank index,
    assign_owners()) steps all of it (docs/design/distributed.md, "Sharded step")."""

    def __init__(self, p: torch.Tensor, index: int, count: int, group, name: str, nodes: int = 1):
        if not _dense(p):
            raise LayerstreamError(f"sharded streamed tensor {name} is not dense (strides {tuple(p.stride())}); "
                                   f"offload with share_host_store=None")
        self.numel, self.index, self.count, self.owner = p.numel(), index, count, None
        self.lo, self.hi = self.bounds(index)
        self._group, self.name = _WeakGroup(group), name
        self.nodes = nodes  # nodes in the group: each covers the tensor once with its ranks' shards
        self.version = p._version  # the last version a sharded step left (Distributed.check_shards)

    @property
    def group(self):
        return self._group.get()

    @property
    def owned(self) -> bool:
        """Whether this rank steps the whole tensor (Adafactor)."""
        return self.owner == self.index

    @staticmethod
    def assign_owners(params: List[torch.Tensor], count: int) -> None:
        """Whole tensors to ranks, largest first, each to the rank with the fewest
        elements so far (ties: the lower rank), as torch's ZeroRedundancyOptimizer
        partitions parameters; the same on every rank (the same model, in order)."""
        loads = [0] * count
        for p in sorted(params, key=lambda q: -q.numel()):  # stable: equal sizes keep model order
            r = min(range(count), key=lambda i: (loads[i], i))
            p._layerstream_shard.owner = r
            loads[r] += p.numel()

    @staticmethod
    def flat(t: torch.Tensor) -> torch.Tensor:
        """The elements of a dense `t` in memory order, as one dimension (a view)."""
        return t.view(-1) if t.is_contiguous() else t.as_strided((t.numel(),), (1,), t.storage_offset())

    def bounds(self, index: int):
        """[lo, hi) of the local rank `index`'s shard of this tensor."""
        return self.numel * index // self.count, self.numel * (index + 1) // self.count

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's elements of `t` (the parameter, or a gradient laid out like it)."""
        return self.flat(t)[self.lo:self.hi]

    def exchange(self, failed: bool, payload: float = 0.0):
        """One collective of a sharded step, a barrier of the group that also carries a flag
        per rank (this rank's set when `failed`) and the sum of the ranks' `payload`s (Note
        [An error on one rank in a sharded step], _optim_base.py). Returns (the ranks whose
        flag is set, the sum)."""
        group = self.group
        size = torch.distributed.get_world_size(group)
        both = torch.zeros(size + 1, dtype=torch.float64, device=collective_device(group))
        both[size] = payload
        if failed:
            both[torch.distributed.get_rank(group)] = 1.0
        torch.distributed.all_reduce(both, group=group)
        flags = both.tolist()
        return [r for r in range(size) if flags[r]], flags[size]


# Note [Frozen weights a node's ranks share are read-only]
# By default the frozen streamed weights live once per node, in the host store its ranks
# map (Distributed._open_region): a write by one rank reaches every rank. peft's
# merge_adapter() on rank 0 alone (an evaluation with the adapter merged, LoRA under DDP)
# changed rank 1's weights too (rank 1 then applied the adapter twice, and after
# unmerge_adapter() kept weights off by the rounding), silently; on every rank it merged
# the adapter once per rank. So after offload() (whose writer filled the store) they are
# read-only: before each forward of the model, compiled or not, each rank checks that
# their version counters stand still (copy_, load_state_dict(), an in-place op) and that
# a sample of their bytes is unchanged (a write through .data, as merge_adapter() and
# diffusers' fuse_lora() do, moves no counter): 16 elements of each tensor, evenly
# spaced, gathered with one torch.cat per element size. A change is refused at that
# forward, on the rank that wrote and on the others (their weights changed too), naming
# share_host_store=False (one copy per process: each rank writes its own). Cost: the
# sampled reads miss every CPU cache; about 0.2 ms per forward for 300 tensors on the
# 2-core test machine. Not seen: a write that misses every sampled element and moves no
# counter. Quantized, lossless-coded and disk-tier weights have no dense bytes here: their
# stand-ins refuse writes, except a quantized one's copy_() and load_state_dict(), which
# re-quantize into the store: refused at once while it is shared (Engine::requantize,
# layerstream/engine.h).
class _FrozenWrites:
    """The frozen streamed tensors of a store this node's ranks share (Note [Frozen
    weights a node's ranks share are read-only])."""

    _SAMPLE = 16
    _WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # by element size

    def __init__(self, named):
        from ._standin import StandIn
        self._tensors = []  # (name, parameter, version)
        samples = {}  # word dtype -> [(name, a view of the sampled elements)]
        seen = set()
        for name, p in named:
            if id(p) in seen or isinstance(p, StandIn) or p.is_meta or p.numel() == 0:
                continue
            seen.add(id(p))
            self._tensors.append((name, p, p._version))
            word = self._WORDS.get(p.element_size())
            if word is None or not _dense(p):
                continue  # its counter only
            flat = Shard.flat(p.detach()).view(word)
            samples.setdefault(word, []).append((name, flat[::max(1, flat.numel() // self._SAMPLE)][:self._SAMPLE]))
        # Per element size: the names (one per sampled element), the views, and their bytes now.
        self._samples = []
        for rows in samples.values():
            views = [v for _, v in rows]
            names = [n for n, v in rows for _ in range(v.numel())]
            self._samples.append((names, views, torch.cat(views)))

    def __bool__(self) -> bool:
        return bool(self._tensors)

    def check(self) -> None:
        for name, p, version in self._tensors:
            if p._version != version:
                raise LayerstreamError(_C.shared_write_refusal(
                    f"frozen streamed weight {name}",
                    "was written in place after offload() (copy_, load_state_dict(), an in-place op)"))
        for names, views, before in self._samples:
            now = torch.cat(views)
            if not torch.equal(now, before):
                raise LayerstreamError(_C.shared_write_refusal(
                    f"frozen streamed weight {names[int((now != before).nonzero()[0])]}",
                    "changed after offload() without a write through the parameter on this rank (a write "
                    "through .data, as peft's merge_adapter() does, or another rank's)"))


class SyncHook:
    """Before each forward of the model: whether the coming backward averages its
    streamed gradients (not inside handle.no_sync() nor DDP's no_sync()), and that
    no shared trainable tensor was written except by a sharded step."""

    def __init__(self, engine, group=None, trains_streamed=lambda: True):
        self._engine = engine
        self._group = group
        self._trains_streamed = trains_streamed  # whether a streamed weight requires grad now
        self.local = False  # handle.no_sync()

    def __call__(self, module, args):
        if self._group is not None and self._group.watched:
            eagerly(self._group.check_writes)
        ddp = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
        if ddp is not None and _joining(ddp) and torch.is_grad_enabled() and self._trains_streamed() and \
                _join_alive(ddp):  # last: it may scan for the join's hook
            raise LayerstreamError(
                "DistributedDataParallel's join() (uneven inputs) is not supported while streamed weights train: "
                "a rank that runs out of batches shadows DDP's collectives but not the all-reduces of the streamed "
                "gradients, so the ranks' collectives would no longer pair (a crash or a hang). Give every rank "
                "the same number of batches (DistributedSampler(..., drop_last=True); accelerate: "
                "even_batches=True), or keep the trained weights resident (exclude=, e.g. LoRA adapters: "
                "exclude=['*lora_*'])")
        sync = not self.local and (ddp is None or ddp.require_backward_grad_sync)
        self._engine.set_gradient_sync(sync)
        if self._group is not None and self._group.backwards is not None:
            self._group.backwards.begin(module, ddp, sync)
        return None

    @contextlib.contextmanager
    def no_sync(self):
        old, self.local = self.local, True
        try:
            yield
        finally:
            self.local = old


class SameBackwards:
    """The rule under DDP: every rank runs the same streamed layers' backwards, in the
    same order. The engine all-reduces each streamed layer's gradient in that layer's
    backward (DDP's find_unused_parameters=True covers DDP's own parameters only: the
    streamed ones are on its ignore list), so a rank whose control flow skipped a
    streamed layer, or ran one more, left the ranks' collectives unpaired: gloo aborted a
    rank ("collective mismatch") or timed out, naming neither the rule nor the layer.

    Each eager training forward under DDP (grad enabled, gradients synchronised, a
    streamed weight trainable: every rank runs it together, as DDPCheck's) records the
    trainable streamed layers it runs (a forward pre-hook on each) and at its end
    all-reduces a digest of them and of those run under no_sync() since the last
    synchronising forward (whose gradients this backward averages whole): two integers
    per step. A difference is refused on every rank, before any backward, naming the
    first layer that differs. A forward outside DDP is not checked (a rank may run one
    alone: an evaluation), nor one torch.compile traced."""

    def __init__(self, group: "Distributed", model: nn.Module, streamed_names: List[str]):
        self._group = group
        keys = {}
        for name in dict.fromkeys(streamed_names):
            prefix, _, key = name.rpartition(".")
            keys.setdefault(prefix, []).append(key)
        self._layers = [(model.get_submodule(prefix), k) for prefix, k in keys.items()]
        self._removables = [model.register_forward_hook(self._end, prepend=True)]  # before the call's turn ends
        for (module, k), prefix in zip(self._layers, keys):
            self._removables.append(module.register_forward_pre_hook(functools.partial(self._ran, prefix, k)))
        self._now = None  # the trainable streamed layers this training forward ran; None outside one
        self._sync = False
        self._under_ddp = False
        self._accumulated = set()  # those run under no_sync() since the last synchronising forward

    def remove(self) -> None:
        for r in self._removables:
            r.remove()
        self._removables = []

    def begin(self, model: nn.Module, ddp, sync: bool) -> None:
        """From SyncHook, before each forward of the model."""
        if torch.compiler.is_compiling():
            return
        self._now = [] if torch.is_grad_enabled() else None
        self._sync = sync
        self._under_ddp = ddp is not None and wraps(ddp, model)

    def _ran(self, name: str, keys: List[str], module, args) -> None:
        if self._now is None or torch.compiler.is_compiling():
            return
        if any(p is not None and p.requires_grad for p in map(module._parameters.get, keys)):
            self._now.append(name)

    def _trains(self) -> bool:
        return any(p is not None and p.requires_grad for m, keys in self._layers for p in map(m._parameters.get, keys))

    def _end(self, model, args, output) -> None:
        now, self._now = self._now, None
        if now is None or torch.compiler.is_compiling():
            return
        if not self._sync:
            self._accumulated.update(now)
            return
        accumulated, self._accumulated = sorted(self._accumulated), set()
        if not self._under_ddp or not self._trains():
            return
        dist = torch.distributed
        pg = self._group.pg
        digest = hashlib.sha256(repr((now, accumulated)).encode()).digest()
        mine = int.from_bytes(digest[:7], "little")
        both = torch.tensor([mine, -mine], dtype=torch.int64, device=collective_device(pg))
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=pg)
        highest, lowest = both.tolist()
        if highest == -lowest:
            return
        everyone: list = [None] * dist.get_world_size(pg)
        dist.all_gather_object(everyone, (now, accumulated), group=pg)
        other = next(r for r, e in enumerate(everyone) if e != everyone[0])
        (a, acc_a), (b, acc_b) = everyone[0], everyone[other]
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            name = lambda seq: f"'{seq[i]}'" if i < len(seq) else "nothing"  # noqa: E731
            where = (f"the {_ordinal(i + 1)} trainable streamed layer of the forward: {name(a)} on rank 0, "
                     f"{name(b)} on rank {other}")
        else:
            where = (f"the streamed layers run under no_sync() since the last synchronising forward: "
                     f"{acc_a} on rank 0, {acc_b} on rank {other}")
        raise LayerstreamError(
            f"DistributedDataParallel over {len(everyone)} ranks: the ranks ran different streamed layers in this "
            f"training forward ({where}). The engine all-reduces each streamed layer's gradient in its backward, "
            f"so every rank must run the same streamed layers' backwards in the same order (DDP's "
            f"find_unused_parameters=True covers DDP's own parameters, not the streamed ones on its ignore list); "
            f"otherwise the ranks' collectives would not pair (a crash or a hang). Make the control flow alike on "
            f"every rank (e.g. decide a skipped layer from a seed all ranks share, or broadcast the decision), or "
            f"keep the layers whose use differs resident (offload(exclude=[...])).")


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _joining(ddp) -> bool:
    """Whether `ddp` may run inside a join() context (cheap; _join_alive() tells).
    torch.distributed.algorithms.Join sets an enabled config on each Joinable when made
    and never resets it: after the block the flag stays set, and training outside join()
    was refused. A join ends (every rank has joined) in DDP's join post-hook, which syncs
    the final model: wrapped at the first forward inside the join, it records the config
    that ended (_JoinEnd)."""
    config = getattr(ddp, "_join_config", None)
    if not getattr(config, "enable", False):
        return False
    if ddp.__dict__.get("_layerstream_join_ended") is config:
        return False
    if "_sync_final_model" not in ddp.__dict__ and hasattr(type(ddp), "_sync_final_model"):
        ddp.__dict__["_sync_final_model"] = _JoinEnd(ddp)
    return True


def _join_alive(ddp) -> bool:
    """Whether the join() whose config `ddp` holds (_joining() said so) is still there.
    A join left by an exception (SyncHook's refusal, a user's error) runs no post-hook,
    so its config read as joining and every later training forward was refused, until
    another join() ended. Its Join object, though, is gone with its `with` block: it alone
    holds the _DDPJoinHook it made for `ddp`. That hook is looked up once per join (a
    scan of the garbage collector's objects: only on the way to a refusal) and held
    weakly; once it is gone the join has ended (recorded as the post-hook's end is)."""
    config = ddp._join_config
    seen = ddp.__dict__.get("_layerstream_join_hook")
    if seen is None or seen[0] is not config:
        hook = _join_hook_of(ddp)
        seen = (config, None if hook is None else weakref.ref(hook))
        ddp.__dict__["_layerstream_join_hook"] = seen
    if seen[1] is not None and seen[1]() is not None:
        return True
    ddp.__dict__["_layerstream_join_ended"] = config
    return False


def _join_hook_of(ddp):
    """A live _DDPJoinHook made for `ddp` (by a Join, in ddp.join()), or None."""
    import gc
    hook_type = getattr(torch.nn.parallel.distributed, "_DDPJoinHook", None)
    if hook_type is None:  # another torch: taken as alive, as before
        return _AliveJoin
    for o in gc.get_referrers(ddp):
        if isinstance(o, hook_type) and getattr(o, "ddp", None) is ddp:
            return o
        if type(o) is dict and o.get("ddp") is ddp:  # a hook whose __dict__ was materialised
            for owner in gc.get_referrers(o):
                if isinstance(owner, hook_type) and getattr(owner, "__dict__", None) is o:
                    return owner
    return None


class _AliveJoin:
    """Stands for a join hook that cannot be looked up: never collected."""


class _JoinEnd:
    """Stands for DistributedDataParallel._sync_final_model on one DDP while a join()
    runs: torch's join post-hook calls it once every rank has joined; it syncs as torch
    does, records the config of the join that ended, and takes itself off (held weakly:
    DDP holds it)."""

    __slots__ = ("_ddp",)

    def __init__(self, ddp):
        self._ddp = weakref.ref(ddp)

    def __call__(self, *args, **kwargs):
        ddp = self._ddp()
        config = ddp._join_config
        try:
            return type(ddp)._sync_final_model(ddp, *args, **kwargs)
        finally:
            ddp.__dict__.pop("_sync_final_model", None)
            ddp.__dict__["_layerstream_join_ended"] = config


def collective_device(group) -> torch.device:
    """Where a tensor of a collective on `group` must be: this rank's current GPU for
    NCCL (which takes CUDA tensors only), the host for gloo."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
