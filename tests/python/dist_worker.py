"""One rank of the multi-process tests (test_distributed.py): gloo, the sim device.

Run as: python dist_worker.py SCENARIO OUT_DIR (RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in the environment, as torchrun sets them). Writes OUT_DIR/rank<R>.pt."""
import copy
import datetime
import functools
import gc
import os
import signal
import sys
import time
import warnings

import torch
import torch._dynamo  # noqa: F401 - before init_process_group: see main()
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_models import (BATCH, LORA_LR, MICRO, STEPS, batch_of, host_adafactor, host_adafactor_clipped,  # noqa: E402
                         host_adamw, host_adamw_clipped, lora_model, make_model, train_steps)

import layerstream  # noqa: E402
from ctrl_c import signal_at  # noqa: E402
from layerstream._distributed import store_pss  # noqa: E402


def _train_shared(rank, result, optimizer, **offload_kw):
    """Full fine-tuning under DDP with one host copy shared by the node's ranks
    (share_host_store="all"), stepped by `optimizer` (layerstream.optim, sharded);
    fills result's losses, params and stats. Returns (model, ddp, handle, optimizer)."""
    model = make_model()
    handle = layerstream.offload(model, device="sim", share_host_store="all", **offload_kw)
    ddp = nn.parallel.DistributedDataParallel(model)
    result["losses"] = train_steps(ddp, lambda step, micro: batch_of(step, micro)[rank * BATCH:(rank + 1) * BATCH],
                                   accumulate_with=ddp.no_sync, optimizer=optimizer)
    result["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    result["stats"] = handle.stats()
    return model, ddp, handle, train_steps.optimizer


class _EditGrad(torch.autograd.Function):
    """Identity; its backward returns edit(gradient) instead."""

    @staticmethod
    def forward(ctx, x, edit):
        ctx.edit = edit
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return ctx.edit(g), None


def _nan_in_column0(g):
    g = g.clone()
    g[..., 0] = float("nan")
    return g


def _scaled_modes(rank, result, init_scale, poison_step=None):
    """fp16 autocast with a GradScaler on a shared host copy (each rank stepping its
    shards): twice from the same weights, the step after the backward ("plain"), then
    overlapped (opt.overlap(handle, grad_scaler=)); result[mode] has the scales and
    weights. poison_step: that step's gradient of fc1 (its weight's row 0, bias[0]) is
    NaN, and nothing else's."""
    from layerstream.optim import AdamW
    for mode in ("plain", "overlap"):
        model = make_model()
        handle = layerstream.offload(model, device="sim", share_host_store="all")
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)
        scales = []
        for step in range(8):
            hooks = []
            if step == poison_step:
                # NaN in fc1's output gradient column 0; turned to 0 below fc1 (the layers
                # below get finite gradients).
                zero_nan = functools.partial(torch.nan_to_num, nan=0.0)
                hooks = [model.fc1.register_forward_pre_hook(lambda m, args: (_EditGrad.apply(args[0], zero_nan),)),
                         model.fc1.register_forward_hook(lambda m, args, out: _EditGrad.apply(out, _nan_in_column0))]
            ids, target = batch_of(step % STEPS, 0, ranks=dist.get_world_size())[rank * BATCH:(rank + 1) * BATCH]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(ddp(ids).float(), target)
            if mode == "overlap":
                with opt.overlap(handle, grad_scaler=scaler):
                    scaler.scale(loss).backward()
            else:
                scaler.scale(loss).backward()
            for h in hooks:
                h.remove()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        result[mode] = {"scales": scales, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
        del ddp
        dist.barrier()
        handle.detach()


def _sigint_as_returns(name, call):
    """call(), with SIGINT raised once as the first C function `name` returns inside it
    (where CPython runs the handler of a Ctrl-C that came during that call). Returns
    (whether it was sent, call()'s KeyboardInterrupt or None)."""
    with signal_at("c_return", name) as sent:
        try:
            call()
        except KeyboardInterrupt as e:
            return bool(sent), e
    return bool(sent), None


def _interrupted_sharded_steps(rank, result):
    """3 steps of each optimizer on a shared host copy (share_host_store="all"); rank 0's
    second step() gets a Ctrl-C as the opening barrier's wait or the kernel returns, then
    is run again ("rerun") or not ("go_on": zero_grad() and the next step). result[name]:
    {case: (weights, step counts)}, case None for the run without a Ctrl-C."""
    from layerstream.optim import Adafactor, AdamW
    makers = {"adamw": lambda ps: AdamW(ps, lr=1e-2),
              "adafactor": lambda ps: Adafactor(ps, lr=1e-2, relative_step=False)}
    kernels = {"adamw": "optim_adamw_step", "adafactor": "optim_adafactor_step"}
    for name, make_opt in makers.items():
        runs = {}
        for case in (None, ("kernel", "rerun"), ("kernel", "go_on"), ("wait", "rerun"), ("wait", "go_on")):
            model = make_model()
            handle = layerstream.offload(model, device="sim", share_host_store="all")
            ddp = nn.parallel.DistributedDataParallel(model)
            params = [p for p in model.parameters() if p.requires_grad]
            opt = make_opt(params)
            for step in range(3):
                ids, target = batch_of(step, 0, ranks=dist.get_world_size())[rank * BATCH:(rank + 1) * BATCH]
                nn.functional.mse_loss(ddp(ids), target).backward()
                if step == 1 and rank == 0 and case is not None:
                    at, then = case
                    sent, stopped = _sigint_as_returns(kernels[name] if at == "kernel" else "wait", opt.step)
                    assert sent and stopped is not None, (name, case, sent)
                    if then == "rerun":
                        opt.step()
                else:
                    opt.step()
                opt.zero_grad()
            runs[case] = ({n: p.detach().clone() for n, p in model.named_parameters()},
                          [int(opt.state[p]["step"]) if p in opt.state else 0 for p in params])
            del ddp
            dist.barrier()
            handle.detach()
        result[name] = runs


def _fail_once(owner, name, error):
    """owner.name (a function) raises `error` at its next call, once, then is itself again."""
    real = getattr(owner, name)

    def failing(*args, **kwargs):
        setattr(owner, name, real)
        raise error
    setattr(owner, name, failing)


def _one_rank_fails(rank, result):
    """Steps of a shared host copy (share_host_store="all") in which rank 1 alone raises in
    one step(), at a point injected on rank 1 only: "refusal", a check before the step's
    first collective (_C.optim_check_group, as a bad gradient's refusal); "kernel", the C++
    step of its first group, between the barriers, before it writes anything (as an
    out-of-memory); after the first overlapped backward (with a clip: its layers were
    stepped speculatively), "overlap_lr": rank 1 alone set a new lr (step()'s own refusal,
    before the clip norm's all-reduce), "overlap_refusal": as "refusal". Every rank records
    what its step() raised, runs step() again (not after an overlapped backward), and
    trains on. result[case]: (each
    step's error or None, the weights at the end, the step counts, the weights right after
    the error); case None: no failure."""
    from layerstream import _C
    from layerstream.optim import AdamW
    world = dist.get_world_size()
    makers = {"adamw": host_adamw, "adafactor": host_adafactor, "adamw_clipped": host_adamw_clipped}
    cases = [("adamw", None), ("adamw", "refusal"), ("adamw", "kernel"), ("adafactor", None),
             ("adafactor", "kernel"), ("adamw_clipped", "overlap_lr"), ("adamw_clipped", "overlap_refusal")]
    for name, point in cases:
        model = make_model()
        handle = layerstream.offload(model, device="sim", share_host_store="all")
        ddp = nn.parallel.DistributedDataParallel(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = makers[name](params)
        lr = opt.param_groups[0]["lr"]
        errors, stopped = [], None
        overlapped = point is not None and point.startswith("overlap")
        fail_at = 0 if overlapped else 1
        for step in range(3):
            ids, target = batch_of(step, 0, ranks=world)[rank * BATCH:(rank + 1) * BATCH]
            loss = nn.functional.mse_loss(ddp(ids), target)
            if overlapped:
                with opt.overlap(handle):
                    loss.backward()
            else:
                loss.backward()
            if step == fail_at and rank == 1:
                if point in ("refusal", "overlap_refusal"):
                    _fail_once(_C, "optim_check_group", ValueError("injected: rank 1's gradient is refused"))
                elif point == "kernel":
                    kernel = "optim_adamw_step" if isinstance(opt, AdamW) else "optim_adafactor_step"
                    _fail_once(_C, kernel, RuntimeError("injected: out of memory in rank 1's kernel"))
                elif point == "overlap_lr":
                    opt.param_groups[0]["lr"] = 2 * lr
            try:
                opt.step()
                errors.append(None)
            except Exception as e:  # noqa: BLE001 - recorded for the test
                errors.append((type(e).__name__, str(e), getattr(e, "__notes__", [])))
                stopped = {n: p.detach().clone() for n, p in model.named_parameters()}
                if not overlapped:
                    opt.step()  # torch's answer to a step() that raised: run it again
            opt.param_groups[0]["lr"] = lr
            opt.zero_grad()
        result[(name, point)] = (errors, {n: p.detach().clone() for n, p in model.named_parameters()},
                                 [int(opt.state[p]["step"]) if p in opt.state else 0 for p in params], stopped)
        del ddp
        dist.barrier()
        handle.detach()


def _closure_fails(rank, out, point, result):
    """One step(closure) of a shared host copy (share_host_store="all") whose closure raises
    on rank 1 alone: "forward", before its forward (the other ranks then wait in their
    backward's all-reduce), or "after_backward" (they wait at the step's opening barrier).
    Rank 1 waits for rank 0's error (a file), so that rank 0 raises at the group's timeout,
    not at rank 1's exit. result: its error (type, message, notes), the seconds step()
    took, whether the weights are the initial ones, the number of optimizer states."""
    model = make_model()
    handle = layerstream.offload(model, device="sim", share_host_store="all")
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = host_adamw([p for p in model.parameters() if p.requires_grad])
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, target = batch_of(0, 0, ranks=dist.get_world_size())[rank * BATCH:(rank + 1) * BATCH]

    def closure():
        opt.zero_grad()
        if rank == 1 and point == "forward":
            raise ValueError("injected: rank 1's forward")
        loss = nn.functional.mse_loss(ddp(ids), target)
        loss.backward()
        if rank == 1 and point == "after_backward":
            raise ValueError("injected: rank 1 after its backward")
        return loss

    marker = os.path.join(out, "rank0-raised")
    start = time.monotonic()
    try:
        opt.step(closure)
        result["error"] = None
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result["error"] = (type(e).__name__, str(e), getattr(e, "__notes__", []))
    result["seconds"] = time.monotonic() - start
    if rank == 0:
        open(marker, "w").close()
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
    result["unchanged"] = all(torch.equal(p, initial[n]) for n, p in model.named_parameters())
    result["states"] = sum(len(st) > 0 for st in opt.state.values())
    del ddp
    handle.detach()


def _meta_state_resumes(rank, out, result):
    """A resume on a shared host copy (share_host_store="all") whose optimizer state, a
    whole one (one process's), is loaded before offload() into a model built on meta and
    filled by load_safetensors() ("before"; "before_overlap": the first step after it
    overlapped with the backward), against the same state loaded after offload() and
    against one process without offload() ("one_process": the ranks' rows together;
    AdamW's is torch.optim.AdamW's). Per optimizer, 2 steps in one process make the
    checkpoint (every rank makes the same), then 3 steps each way. result[name][way]:
    the weights after them; [way + "_state"]: the optimizer's state dict; "meta_at_load":
    the parameters still meta when the state was loaded."""
    from safetensors.torch import save_file
    world = dist.get_world_size()
    torch_adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-3, weight_decay=0.01)  # noqa: E731 - host_adamw's
    makers = {"adamw": (torch_adamw, torch_adamw, host_adamw), "adafactor": (host_adafactor,) * 3}

    def steps(model, opt, which, rows, overlap_with=None):
        for step in which:
            ids, target = batch_of(step, 0, ranks=world)[rows]
            loss = nn.functional.mse_loss(model(ids), target)
            if overlap_with is not None and step == which[0]:
                with opt.overlap(overlap_with):
                    loss.backward()
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()

    for name, (make_first, make_one, make_opt) in makers.items():
        model = make_model()
        opt = make_first(list(model.parameters()))
        steps(model, opt, range(2), slice(0, world * BATCH))
        weights = os.path.join(out, f"{name}-rank{rank}.safetensors")
        save_file(model.state_dict(), weights)
        state = copy.deepcopy(opt.state_dict())
        runs = {}
        one = make_model()  # the same run in one process, without offload(): the ranks' rows together
        one.load_state_dict(model.state_dict())
        one_opt = make_one(list(one.parameters()))
        one_opt.load_state_dict(copy.deepcopy(state))
        steps(one, one_opt, range(2, 5), slice(0, world * BATCH))
        runs["one_process"] = {n: p.detach().clone() for n, p in one.named_parameters()}
        for way in ("before", "after", "before_overlap"):
            if way.startswith("before"):
                with torch.device("meta"):
                    resumed = make_model()
                layerstream.load_safetensors(resumed, weights)
                opt = make_opt(list(resumed.parameters()))
                opt.load_state_dict(copy.deepcopy(state))
                runs["meta_at_load"] = [n for n, p in resumed.named_parameters() if p.is_meta]
                handle = layerstream.offload(resumed, device="sim", share_host_store="all")
            else:
                resumed = make_model()
                resumed.load_state_dict(model.state_dict())
                handle = layerstream.offload(resumed, device="sim", share_host_store="all")
                opt = make_opt(list(resumed.parameters()))
                opt.load_state_dict(copy.deepcopy(state))
            ddp = nn.parallel.DistributedDataParallel(resumed)
            steps(ddp, opt, range(2, 5), slice(rank * BATCH, (rank + 1) * BATCH),
                  overlap_with=handle if way.endswith("overlap") else None)
            runs[way] = {n: p.detach().clone() for n, p in resumed.named_parameters()}
            runs[way + "_state"] = copy.deepcopy(opt.state_dict())
            del ddp
            dist.barrier()
            handle.detach()
        with torch.device("meta"):  # this rank's own state dict (its shards) before offload()
            early = make_model()
        layerstream.load_safetensors(early, weights)
        try:
            make_opt(list(early.parameters())).load_state_dict(runs["after_state"])
        except RuntimeError as e:
            runs["shards_before_offload"] = str(e)
        result[name] = runs


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def run(scenario, out, rank, result):
    """The scenario's work; its objects (DDP, which holds the group, among them) die when
    it returns, before main() destroys the process group."""
    if scenario in ("full", "lora", "full_ddp_of_compiled"):
        model = make_model() if scenario != "lora" else lora_model(wide=True)
        # LoRA: the adapters stay resident, where DDP averages them; the frozen base streams.
        handle = layerstream.offload(model, device="sim", exclude=None if scenario != "lora" else ["*lora_*"])
        # DDP(torch.compile(model)) reads the model's ignore list through the compiled wrapper.
        ddp = nn.parallel.DistributedDataParallel(
            torch.compile(model, backend="aot_eager") if scenario == "full_ddp_of_compiled" else model)
        # This rank's share of each step's batch: rows rank*B .. (rank+1)*B.
        result["losses"] = train_steps(ddp, lambda step, micro: batch_of(step, micro)[rank * BATCH:(rank + 1) * BATCH],
                                       accumulate_with=ddp.no_sync, lr=LORA_LR if scenario == "lora" else 0.05)
        result["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        result["stats"] = handle.stats()
        result["plan"] = handle.plan
        result["pss"] = store_pss()
        dist.barrier()  # every rank measured before any exits
    elif scenario == "sharded":
        # Full fine-tuning, one shared host copy, each rank stepping its shard of every
        # streamed tensor with layerstream.optim.AdamW.
        model, ddp, handle, opt = _train_shared(rank, result, host_adamw)
        result["plan"] = handle.plan
        result["pss"] = store_pss()
        result["state_numel"] = sum(s["exp_avg"].numel() for p, s in opt.state.items()
                                    if hasattr(p, "_layerstream_shard"))
        dist.barrier()
        # torch.optim writing the shared weights (every rank the same memory) is refused.
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp(batch_of(0, 0)[rank * BATCH:(rank + 1) * BATCH][0]).sum().backward()
        sgd.step()
        try:
            ddp(batch_of(0, 0)[:BATCH][0])
        except layerstream.LayerstreamError as e:
            result["torch_optim"] = str(e)
    elif scenario in ("sharded_overlap", "sharded_overlap_clip", "sharded_adafactor_overlap",
                      "sharded_adafactor_overlap_clip"):
        # The sharded step overlapped with the backward: each rank steps its shard of a
        # layer (AdamW) or the layer's tensors it owns (Adafactor) as soon as that
        # layer's averaged gradient lands (the last micro-batch's backward inside
        # opt.overlap(handle); the first one plain). AdamW without the clip: the Linear
        # weights cross the bus lossless-coded: each rank re-codes its own copy once
        # every rank wrote its shard (not during the backward).
        adafactor = "adafactor" in scenario
        clip = scenario.endswith("clip")
        model = make_model()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the attention group is not coded
            handle = layerstream.offload(model, device="sim", share_host_store="all",
                                         quantize="lossless" if not clip and not adafactor else None)
        ddp = nn.parallel.DistributedDataParallel(model)
        factory = {(False, False): host_adamw, (False, True): host_adamw_clipped,
                   (True, False): host_adafactor, (True, True): host_adafactor_clipped}[adafactor, clip]
        opt = factory([p for p in model.parameters() if p.requires_grad])
        result["losses"], result["early"] = [], []
        for step in range(STEPS):
            total = 0.0
            for micro in range(MICRO):
                ids, target = batch_of(step, micro)[rank * BATCH:(rank + 1) * BATCH]
                loss = nn.functional.mse_loss(ddp(ids), target) / MICRO
                if micro < MICRO - 1:
                    loss.backward()
                else:
                    with opt.overlap(handle):
                        loss.backward()
                total += loss.item()
            opt.step()
            result["early"].append(opt.last_overlap_params)
            opt.zero_grad()
            result["losses"].append(total)
        result["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        result["stats"] = handle.stats()
        if not adafactor:
            try:  # refused before any backward: nothing to pair up between the ranks
                with opt.overlap(handle, keep_grads=True):
                    pass
            except RuntimeError as e:
                result["keep_grads_error"] = str(e)
        dist.barrier()
    elif scenario == "sharded_overlap_scaled":
        # The scale starts high enough that the first steps overflow: every rank skips
        # them alike (the plan's inf check summed over the ranks' shards).
        _scaled_modes(rank, result, init_scale=2.0 ** 18)
    elif scenario == "sharded_overlap_scaled_one_shard":
        # No overflow, but step 3's gradient has NaN in fc1's row 0 and bias[0] alone:
        # elements of rank 0's shards, so rank 1's see none and skip only if told.
        _scaled_modes(rank, result, init_scale=2.0 ** 8, poison_step=3)
    elif scenario == "sharded_checkpoint":
        # Each optimizer (AdamW: element shards; Adafactor: whole tensors by owner) trains
        # 6 steps straight, and 3 + 3 resumed from each rank's own checkpoint (weights
        # loaded before offload(), the rank's optimizer state dict after). Then rank 0's
        # state dict offered to every rank.
        import copy
        from layerstream.optim import Adafactor, AdamW
        makers = {"adamw": lambda ps: AdamW(ps, lr=1e-2), "adafactor": lambda ps: Adafactor(ps, lr=1e-2, relative_step=False)}

        def train(make_opt, steps, weights=None, opt_state=None, consolidate=False, detach_first=False):
            model = make_model()
            if weights is not None:
                model.load_state_dict(weights)
            handle = layerstream.offload(model, device="sim", share_host_store="all")
            ddp = nn.parallel.DistributedDataParallel(model)
            opt = make_opt([p for p in model.parameters() if p.requires_grad])
            error = None
            try:
                if opt_state is not None:
                    opt.load_state_dict(opt_state)
            except Exception as e:  # noqa: BLE001 - reported to the test
                error = f"{type(e).__name__}: {e}"
            for step in steps if error is None else []:
                ids, target = batch_of(step % STEPS, 0, ranks=dist.get_world_size())[rank * BATCH:(rank + 1) * BATCH]
                nn.functional.mse_loss(ddp(ids), target).backward()
                opt.step()
                opt.zero_grad()
            if consolidate:
                opt.consolidate_state_dict()  # on rank 0: the states of whole tensors
            if detach_first:  # the states stay this rank's shards; a step is refused
                del ddp
                dist.barrier()
                handle.detach()
                try:
                    model(batch_of(0, 0)[:BATCH][0]).sum().backward()
                    opt.step()
                except RuntimeError as e:
                    error = str(e)
                return None, copy.deepcopy(opt.state_dict()), error
            out = ({n: t.detach().clone() for n, t in model.state_dict().items()},
                   copy.deepcopy(opt.state_dict()), error)
            del ddp
            dist.barrier()
            handle.detach()
            return out

        for name, make_opt in makers.items():
            straight, _, _ = train(make_opt, range(6))
            weights, opt_state, _ = train(make_opt, range(3))
            resumed, _, error = train(make_opt, range(3, 6), weights, opt_state)
            assert error is None, error
            offered = [opt_state]
            dist.broadcast_object_list(offered, src=0)
            _, _, wrong = train(make_opt, [], weights, offered[0])
            # A whole state dict (consolidated on rank 0), loaded by every rank (each
            # takes its shard) and by one process.
            _, whole, _ = train(make_opt, range(3), consolidate=True)
            offered = [whole]
            dist.broadcast_object_list(offered, src=0)
            whole = offered[0]
            from_whole, _, error = train(make_opt, range(3, 6), weights, whole)
            assert error is None, error
            single = make_model()
            single_opt = make_opt([p for p in single.parameters() if p.requires_grad])
            single_opt.load_state_dict(whole)
            if name == "adamw":  # 8-bit states do not line up with whole tensors' blocks
                model = make_model()
                handle = layerstream.offload(model, device="sim", share_host_store="all")
                try:
                    AdamW([p for p in model.parameters() if p.requires_grad], state_precision="8bit")\
                        .consolidate_state_dict()
                except RuntimeError as e:
                    result["eightbit_error"] = str(e)
                dist.barrier()
                handle.detach()
            _, detached_state, detached_error = train(make_opt, range(1), detach_first=True)
            result[name + "_detached"] = {"shard": detached_state.get("layerstream_shard"), "error": detached_error}
            result[name] = {"straight": straight, "resumed": resumed, "wrong_rank_error": wrong,
                            "from_whole": from_whole, "whole": whole,
                            "single_state": copy.deepcopy(single_opt.state_dict())}
    elif scenario == "sharded_interrupted":  # a sharded step stopped on one rank: a Ctrl-C, an exception
        _interrupted_sharded_steps(rank, result)
        _one_rank_fails(rank, result)
    elif scenario.startswith("sharded_closure_fails_"):  # one rank's step() closure raises
        _closure_fails(rank, out, scenario[len("sharded_closure_fails_"):], result)
    elif scenario == "sharded_meta_state":
        _meta_state_resumes(rank, out, result)
    elif scenario == "sharded_adafactor":
        # The same with layerstream.optim.Adafactor (whole tensors, each stepped by its
        # owner rank), and the Linear weights crossing the bus lossless-coded.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the attention group is not coded
            model, _, _, opt = _train_shared(rank, result, host_adafactor, quantize="lossless")
        result["owned"] = sorted(n for n, p in model.named_parameters()
                                 if hasattr(p, "_layerstream_shard") and len(opt.state[p]) > 0)
        result["sharded"] = sorted(n for n, p in model.named_parameters() if hasattr(p, "_layerstream_shard"))
        result["owned_numel"] = sum(p.numel() for n, p in model.named_parameters() if n in result["owned"])
        dist.barrier()
    elif scenario == "overlap":
        # Rank 1 starts its backward only once rank 0's backward has computed every
        # layer (a hook on the input's gradient writes a file): rank 0 must not wait
        # for rank 1 in any layer's all-reduce before that (the all-reduces run
        # beside the backward, the gradient stream waits for them; Note [Averaging
        # overlapped with the backward]). A blocking all-reduce would hold rank 0 in
        # the last layer's backward: rank 1 would give up waiting and say so.
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        # Slots for 4 layers' gradients in flight, a layer's weights and its gradients.
        handle = layerstream.offload(model, device="sim", slots=6)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        marker = os.path.join(out, "rank0-backward-computed")
        if rank == 0:
            x.register_hook(lambda g: open(marker, "w").close())
        loss = model(x).square().mean()
        if rank == 1:
            deadline = time.monotonic() + 30
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.01)
            result["saw_marker"] = os.path.exists(marker)
        loss.backward()
        result["grads"] = [p.grad.clone() for p in model.parameters()]
        result["stats"] = handle.stats()
    elif scenario == "crash":
        model = lora_model(wide=True)
        handle = layerstream.offload(model, device="sim")
        result["shared_bytes"] = handle.stats()["shared_bytes"]
        dist.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)
        w = model.base_model.model.fc1.base_layer.weight
        w.requires_grad_(True)
        try:
            model(batch_of(0, 0)[:BATCH][0])
        except layerstream.LayerstreamError as e:
            result["unfrozen"] = str(e)
        w.requires_grad_(False)
        # The store outlives a crashed rank in the others: still readable.
        with torch.no_grad():
            result["out"] = model(batch_of(0, 0)[:BATCH][0]).sum().item()
        # The store's memory file (device, inode): the test looks for its mappers by it,
        # not by name (other layerstream processes on the machine map files of that name).
        with open("/proc/self/maps") as f:
            result["store_files"] = sorted({tuple(line.split()[3:5]) for line in f
                                            if "memfd:layerstream-store" in line})
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        os._exit(0)  # no collective with a dead rank (destroy_process_group would wait)
    elif scenario == "group_destroyed":
        # The model, its handle and its optimizer outlive destroy_process_group() (a
        # script's module-level objects): offload() holds the group weakly, so destroying
        # it joins gloo's threads at once; a use of the group after that says it is gone.
        model = make_model()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the attention group is not coded
            layerstream.offload(model, device="sim", share_host_store="all")
        params = [p for p in model.parameters() if p.requires_grad]
        opt = host_adafactor(params)
        ids, target = batch_of(0, 0)[rank * BATCH:(rank + 1) * BATCH]
        nn.functional.mse_loss(model(ids), target).backward()
        opt.step()
        opt.zero_grad()
        before = _threads()
        dist.destroy_process_group()
        result["threads_joined"] = before - _threads()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the failed backward's dropped gradients
                nn.functional.mse_loss(model(ids), target).backward()
        except RuntimeError as e:
            result["backward_error"] = str(e)
        for p in params:
            p.grad = torch.zeros_like(p)
        try:
            opt.step()
        except layerstream.LayerstreamError as e:
            result["step_error"] = str(e)
    elif scenario == "mismatch":
        model = make_model(hidden=32 if rank == 0 else 48)
        try:
            layerstream.offload(model, device="sim")
        except layerstream.LayerstreamError as e:
            result["error"] = str(e)
        try:  # the same model, another budget
            layerstream.offload(make_model(), device="sim", budget=None if rank == 0 else "1MiB")
        except layerstream.LayerstreamError as e:
            result["budget_error"] = str(e)
        unseeded = make_model()
        with torch.no_grad():  # initialised with another seed on rank 1 (DDP's broadcast skips them)
            unseeded.fc1.weight.add_(rank)
        try:
            layerstream.offload(unseeded, device="sim")
        except layerstream.LayerstreamError as e:
            result["values_error"] = str(e)
    elif scenario in ("ddp_first_forward", "ddp_first_forward_compiled"):
        # What DDP's ignore list leaves to layerstream, checked at a DDP's first training
        # forward: the ranks' streamed weights (DDP's broadcast skips them) and the group
        # their gradients are averaged over. Every rank starts from another initialisation
        # than the checkpoint's (alike on every rank), then loads it after offload().
        # Compiled: torch.compile(DDP(model)) (Dynamo traces the model's hooks).
        checkpoint = make_model().state_dict()
        compiled = scenario.endswith("compiled")

        class Parent(nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, ids):
                return self.inner(ids)

        def attempt(loaders, parent=False, **offload_kw):
            model = make_model()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            handle = layerstream.offload(model, device="sim", **offload_kw)
            if rank in loaders:
                model.load_state_dict(checkpoint)
            ddp = nn.parallel.DistributedDataParallel(Parent(model) if parent else model)
            if compiled:
                torch._dynamo.reset()  # each attempt traced afresh, as in its own process
                ddp = torch.compile(ddp, backend="aot_eager")
            try:
                out = {"losses": train_steps(ddp, lambda step, micro: batch_of(step, micro)[rank * BATCH:(rank + 1) * BATCH],
                                             accumulate_with=ddp.no_sync),
                       "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
            except layerstream.LayerstreamError as e:
                out = str(e)
            del ddp
            dist.barrier()
            handle.detach()
            return out

        result["rank0_only"] = attempt([0])
        result["every_rank"] = attempt([0, 1])
        result["no_group"] = attempt([0, 1], process_group=False)
        result["parent"] = attempt([0, 1], parent=True)
    elif scenario == "shared_frozen_write":
        # LoRA under DDP, the frozen base in the host store the node's ranks share. Rank 0
        # alone merges the adapter (peft's merge_adapter(): a write through .data) for an
        # evaluation; then rank 0 alone loads weights (load_state_dict: copy_). Each rank
        # then calls the model: rank 0 eagerly, rank 1 compiled. With share_host_store=False
        # rank 0 merges and evaluates, and rank 1's outputs stay its own.
        ids = batch_of(0, 0)[:BATCH][0]
        for share in (None, False):
            model = lora_model()
            with torch.no_grad():  # an adapter that changes the weights it merges into (B starts at 0)
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
            handle = layerstream.offload(model, device="sim", exclude=["*lora_*"], share_host_store=share)
            assert (handle.stats()["shared_bytes"] > 0) == (share is None)
            ddp = nn.parallel.DistributedDataParallel(model)
            # A training step first: what the check saw at offload() still holds.
            nn.functional.mse_loss(ddp(ids), batch_of(0, 0)[:BATCH][1]).backward()
            call = model if rank == 0 else torch.compile(model, backend="aot_eager")
            with torch.no_grad():
                before = call(ids)
            frozen = {k: v + 1 for k, v in model.state_dict().items() if "base_layer" in k}
            for name, write in (("merge", model.merge_adapter), ("load", lambda: model.load_state_dict(frozen, strict=False))):
                dist.barrier()
                if rank == 0:
                    write()
                dist.barrier()  # rank 1 calls the model after rank 0 wrote
                try:
                    with torch.no_grad():
                        out = call(ids)
                    result[f"{name}_{share}"] = (out - before).abs().max().item()
                except layerstream.LayerstreamError as e:
                    result[f"{name}_{share}"] = str(e)
                if rank == 0 and name == "merge":
                    model.unmerge_adapter()
            del ddp
            dist.barrier()
            handle.detach()
        # A quantized frozen weight's copy_() re-quantizes into the store: refused while shared.
        for share in (None, False):
            model = make_model().requires_grad_(False)
            handle = layerstream.offload(model, device="sim", quantize="int8", share_host_store=share)
            for way, write in (("load", lambda: model.load_state_dict(make_model().state_dict())),
                               ("copy", lambda: model.fc1.weight.copy_(make_model().fc1.weight))):
                try:
                    with torch.no_grad():
                        write()
                    result[f"requantize_{way}_{share}"] = None
                except (layerstream.LayerstreamError, RuntimeError) as e:  # load_state_dict's joins the errors
                    result[f"requantize_{way}_{share}"] = str(e)
            dist.barrier()
            handle.detach()
    else:
        raise SystemExit(f"unknown scenario {scenario}")


def main():
    # torch._dynamo is imported above, before the group exists: imported after it (as
    # torch.optim does on an optimizer's first parameter group), torch 2.14 itself keeps
    # the group alive past destroy_process_group(), and "group_destroyed" could not tell
    # whether offload() holds it.
    scenario, out = sys.argv[1], sys.argv[2]
    result = {"threads_at_start": _threads()}
    # A scenario whose ranks must not wait for each other long gives up sooner.
    wait = 20 if scenario == "sharded_interrupted" else 5 if scenario.startswith("sharded_closure_fails") else 60
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=wait))
    result["threads_at_init"] = _threads()
    rank = dist.get_rank()
    if scenario.endswith("@2nodes"):  # the ranks as two machines' (one host store per half)
        scenario = scenario[:-len("@2nodes")]
        import layerstream._distributed as ls_dist
        ls_dist._node_id = lambda: f"node{rank * 2 // dist.get_world_size()}"
    try:
        run(scenario, out, rank, result)
        # Nothing left holds the group but torch's registry (offload() holds it weakly;
        # DDP died with run()'s frame; a cycle it is part of goes now): destroying it
        # joins gloo's threads here. A group that outlived this into the interpreter's
        # shutdown could abort it: a gloo thread releasing a finished collective takes
        # the GIL there.
        gc.collect()
    finally:
        if scenario != "crash" and dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
