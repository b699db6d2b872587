"""offload() in several processes (torch.distributed on gloo, the sim device): the
ranks' results equal one process on the concatenated batch, the host store is one
copy per node, a crashed rank leaves nothing behind, and ranks that disagree are told.
Each test starts its ranks as subprocesses (dist_worker.py) with a time limit."""
import copy
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from dist_models import (BATCH, LORA_LR, STEPS, batch_of, host_adafactor, host_adafactor_clipped, host_adamw,
                         host_adamw_clipped, lora_model, make_model, train_steps)

import layerstream

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="this torch has no torch.distributed with gloo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(scenario: str, world: int, tmp_path, expect_rc=None, timeout=120):
    """Runs `world` ranks of dist_worker.py, checks their exit codes (0, or `expect_rc`) and
    returns their results in rank order (None for a rank that wrote none)."""
    path = [os.path.join(HERE, "..", "..", "python")] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "dist_worker.py"), scenario, str(tmp_path)],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    outputs, codes = [], []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out.decode(errors="replace"))
            codes.append(p.returncode)
    finally:
        for p in procs:  # bounded: nothing outlives the test
            if p.poll() is None:
                p.kill()
                p.wait()
    wrong = [f"rank {r} exited with {code}, not {want}:\n{out[-4000:]}"
             for r, (code, out, want) in enumerate(zip(codes, outputs, expect_rc or [0] * world)) if code != want]
    assert not wrong, "\n".join(wrong)  # every failed rank's output: the first to fail is not always rank 0
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) if (tmp_path / f"rank{r}.pt").exists()
               else None for r in range(world)]
    return results


def _reference(model, world, lr=0.05, optimizer=None):
    """One process, no offload, the ranks' batches concatenated."""
    return train_steps(model, lambda step, micro: batch_of(step, micro)[:world * BATCH], lr=lr, optimizer=optimizer)


def _check_equal(results, model, ref_losses, world):
    ref = dict(model.named_parameters())
    for r, res in enumerate(results):
        assert set(res["params"]) == set(ref)
        for name, value in res["params"].items():
            torch.testing.assert_close(value, ref[name].detach(), rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"rank {r} of {world}, {name}: {m}")
    losses = torch.tensor([res["losses"] for res in results]).mean(0)  # each rank's loss is its rows' mean
    torch.testing.assert_close(losses, torch.tensor(ref_losses), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("world", [2, 3])
def test_full_fine_tuning_equals_one_process(world, tmp_path):
    results = _run("full", world, tmp_path)
    model = make_model()
    ref_losses = _reference(model, world)
    _check_equal(results, model, ref_losses, world)
    streamed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("norm"))
    for res in results:
        # Each step all-reduced every streamed gradient once: the first micro-batch ran under
        # no_sync() (no collective), the second averaged the accumulated .grad whole.
        assert res["stats"]["averaged_bytes"] == STEPS * streamed
        # Every streamed gradient went through the engine: tables, groups, Linear layers.
        assert res["stats"]["layers"] == 4 and res["stats"]["group_layers"] == 1
        # Every streamed tensor is trainable: one copy per process (each rank's optimizer steps its own).
        assert res["stats"]["shared_bytes"] == 0
        assert "9 trainable streamed tensor(s): one copy per process" in res["plan"]


@pytest.mark.parametrize("world", [2, 3])
def test_lora_with_ddp_shares_one_host_copy(world, tmp_path):
    results = _run("lora", world, tmp_path)
    model = lora_model(wide=True)
    ref_losses = _reference(model, world, LORA_LR)
    _check_equal(results, model, ref_losses, world)
    assert all(res["stats"]["averaged_bytes"] == 0 for res in results)  # frozen streamed weights: DDP's work
    shared = results[0]["stats"]["shared_bytes"]
    assert shared > 2 * 2**20 and all(res["stats"]["shared_bytes"] == shared for res in results)
    assert "shared by ranks " + ", ".join(map(str, range(world))) in results[0]["plan"]
    # Summed over the ranks, the store's resident pages count once (Pss splits a shared
    # page among its mappers): about 1x the store, not world x. Each tensor is page-aligned.
    pss = sum(res["pss"] for res in results)
    assert 0.95 * shared <= pss <= shared + 4096 * 16, (pss, shared)


def test_sharded_host_step_into_one_shared_copy(tmp_path):
    world = 2
    results = _run("sharded", world, tmp_path)
    model = make_model()
    ref_losses = _reference(model, world, optimizer=host_adamw)
    _check_equal(results, model, ref_losses, world)
    streamed = [p for n, p in model.named_parameters() if not n.startswith("norm")]
    numel = sum(p.numel() for p in streamed)
    nbytes = sum(p.numel() * p.element_size() for p in streamed)
    for res in results:
        # Every streamed tensor, trainable ones included, in the shared store; the host
        # optimizer's states cover this rank's half of their elements only.
        assert res["stats"]["shared_bytes"] == nbytes
        assert numel // 2 - len(streamed) <= res["state_numel"] <= numel // 2 + len(streamed)
        assert "9 trainable tensor(s) stepped in 2 shards" in res["plan"]
        assert "written by something other than layerstream.optim's sharded step" in res["torch_optim"]
    pss = sum(res["pss"] for res in results)
    assert 0.95 * nbytes <= pss <= nbytes + 4096 * 16, (pss, nbytes)


@pytest.mark.parametrize("clip", [False, True])
def test_sharded_step_overlapped_with_the_backward(clip, tmp_path):
    """layerstream.optim.AdamW's overlap() on a shared host copy: each rank steps its shard
    of a streamed layer during the backward; the results equal one process (with a clip
    that triggers at every step: the norm summed over the ranks' shards; without it, the
    Linear weights lossless-coded on the bus, re-coded by each rank after every shard's write)."""
    world = 2
    results = _run("sharded_overlap_clip" if clip else "sharded_overlap", world, tmp_path)
    model = make_model()
    ref_losses = _reference(model, world, optimizer=host_adamw_clipped if clip else host_adamw)
    _check_equal(results, model, ref_losses, world)
    for res in results:  # the Linear layers' weights and biases, every step
        assert min(res["early"]) >= 4, res["early"]
        assert "not available for sharded parameters" in res["keep_grads_error"]
        assert (res["stats"]["coded_layers"] == 0) if clip else (res["stats"]["recoded_bytes"] > 0)


@pytest.mark.parametrize("clip", [False, True])
def test_sharded_adafactor_overlapped_with_the_backward(clip, tmp_path):
    """layerstream.optim.Adafactor's overlap() on a shared host copy: each rank steps the
    streamed tensors it owns during the backward and drops the others' gradients; the
    results equal one process (with a clip that triggers at every step: each rank takes
    the norms of its tensors, the sum over the ranks is the whole norm)."""
    world = 2
    results = _run("sharded_adafactor_overlap_clip" if clip else "sharded_adafactor_overlap", world, tmp_path)
    model = make_model()
    ref_losses = _reference(model, world, optimizer=host_adafactor_clipped if clip else host_adafactor)
    _check_equal(results, model, ref_losses, world)
    # Each rank stepped (or took the norms of) its own tensors early, every step.
    assert all(min(res["early"]) >= 1 for res in results), [res["early"] for res in results]


def test_sharded_overlap_under_a_grad_scaler_equals_the_step_after_backward(tmp_path):
    """fp16 autocast with torch.amp.GradScaler on a shared host copy (each rank stepping its
    shards): overlapped steps (opt.overlap(handle, grad_scaler=)) give the same weights and
    the same scales as the step after the backward, on both ranks, over steps that
    overflow (skipped by every rank) and steps that do not."""
    results = _run("sharded_overlap_scaled", 2, tmp_path)
    plain, overlap = results[0]["plain"], results[0]["overlap"]
    steps = list(zip([2.0 ** 18] + plain["scales"], plain["scales"]))
    assert any(b < a for a, b in steps) and any(b > a for a, b in steps), plain["scales"]  # skipped, and stepped
    for res in results:
        for mode in ("plain", "overlap"):
            assert res[mode]["scales"] == plain["scales"]
            for n, p in res[mode]["params"].items():
                assert torch.equal(p, plain["params"][n]), (mode, n)
    model = make_model()
    assert any(not torch.equal(p, overlap["params"][n]) for n, p in model.named_parameters())



@pytest.mark.parametrize("world,suffix", [(2, ""), (4, "@2nodes")], ids=["1-node", "2-nodes"])
def test_sharded_overlap_skips_on_every_rank_when_one_ranks_shard_has_nan(tmp_path, world, suffix):
    """The same, with one step's NaN only in elements of rank 0's shards (fc1's weight row
    0 and bias[0]): rank 1, whose shards are finite, skips that step too (the inf check
    is summed over the ranks), in both modes; the scale backs off once, there. Also as
    two machines of 2 ranks (the NaN in each machine's first rank's shards)."""
    results = _run("sharded_overlap_scaled_one_shard" + suffix, world, tmp_path)
    plain = results[0]["plain"]
    scales = [2.0 ** 8] + plain["scales"]
    assert [b < a for a, b in zip(scales, scales[1:])] == [i == 3 for i in range(8)], plain["scales"]
    for res in results:
        for mode in ("plain", "overlap"):
            assert res[mode]["scales"] == plain["scales"]
            for n, p in res[mode]["params"].items():
                assert torch.isfinite(p).all(), (mode, n)
                assert torch.equal(p, plain["params"][n]), (mode, n)


@pytest.mark.parametrize("world,suffix", [(2, ""), (4, "@2nodes")], ids=["1-node", "2-nodes"])
def test_a_sharded_optimizer_resumes_from_each_ranks_checkpoint_and_refuses_another_ranks(tmp_path, world, suffix):
    """share_host_store="all": each rank's optimizer state dict holds its shard (AdamW) or
    the tensors it owns (Adafactor). Resumed from each rank's own (weights loaded before
    offload()), 3 + 3 steps equal 6 straight, bit for bit; rank 0's state dict loaded on
    rank 1 (a pattern of replicated optimizers: save on rank 0, load everywhere) is refused
    with what to do, not stepped with rank 0's moments. A whole state dict
    (opt.consolidate_state_dict(), then rank 0's state_dict()) loads into every rank (each
    takes its shard: the same 6 steps) and into one process; 8-bit states are refused. Also
    as two machines of 2 ranks (each its own host store): rank 2, the second machine's
    first, loads rank 0's state dict (the same shard). After handle.detach() the state dict
    still says whose shards it holds, and a step is refused (the parameters are whole)."""
    results = _run("sharded_checkpoint" + suffix, world, tmp_path)
    model = make_model()
    for name in ("adamw", "adafactor"):
        for rank, res in enumerate(results):
            r = res[name]
            for n, t in r["straight"].items():
                assert torch.equal(r["resumed"][n], t), (name, rank, n)
                assert torch.equal(r["from_whole"][n], t), (name, rank, n)
        for rank, res in enumerate(results):
            error = res[name]["wrong_rank_error"]
            if rank % 2 == 0:  # rank 0's own shard (rank 2: the same, on its machine)
                assert error is None, (name, rank, error)
            else:
                assert error is not None and "rank 0 of 2" in error and "rank 1 of 2" in error, (name, rank, error)
        # consolidate_state_dict(): whole tensors' states, every trainable tensor's, as
        # one process keeps them (and one process loads them back unchanged).
        whole = results[0][name]["whole"]
        assert "layerstream_shard" not in whole
        params = [p for p in model.parameters() if p.requires_grad]
        assert sorted(whole["state"]) == list(range(len(params))), name
        key = "exp_avg" if name == "adamw" else "exp_avg_sq_row"
        for i, p in enumerate(params):
            st = whole["state"][i]
            assert st["step"] == 3 or float(st["step"]) == 3.0, (name, i)
            if name == "adamw":
                assert st[key].shape == p.shape, (name, i)
        single = results[0][name]["single_state"]["state"]
        for i in whole["state"]:
            for k, t in whole["state"][i].items():
                if isinstance(t, torch.Tensor) and k != "step":
                    assert torch.equal(single[i][k], t), (name, i, k)
    for rank, res in enumerate(results):
        assert "8-bit states" in res.get("eightbit_error", ""), res.get("eightbit_error")
        for name in ("adamw", "adafactor"):  # after handle.detach(): still this rank's shards
            detached = res[name + "_detached"]
            assert detached["shard"] == {"rank": rank % 2, "ranks": 2}, (name, rank, detached)
            assert "model was detached" in (detached["error"] or ""), (name, rank, detached["error"])

@pytest.fixture(scope="module")
def stopped_sharded_steps(tmp_path_factory):
    """The ranks of the "sharded_interrupted" scenario, run once: sharded steps that a
    Ctrl-C or an exception stopped on one rank."""
    return _run("sharded_interrupted", 2, tmp_path_factory.mktemp("sharded_interrupted"), timeout=90)


def test_a_ctrl_c_in_a_sharded_step_leaves_it_done_once_on_every_rank(stopped_sharded_steps):
    """A Ctrl-C that landed in a sharded step (rank 0's, as the opening barrier's wait or
    the kernel returned) left its closing barrier and version records undone: the next
    forward refused the step's own writes ("written by something other than
    layerstream.optim's sharded step") and rank 1 waited in that barrier; a re-run
    stepped nothing and skipped them too, or (stopped past the opening barrier) passed it
    again, paired with rank 1's closing one. Now the Ctrl-C lands once the step is done:
    re-run or not, both ranks train as without it (equal weights, equal step counts)."""
    results = stopped_sharded_steps
    for name in ("adamw", "adafactor"):
        want, want_counts = results[0][name][None]
        assert sum(want_counts) > 0
        for r, res in enumerate(results):
            for case, (got, counts) in res[name].items():
                assert counts == res[name][None][1], (name, r, case)
                for n, value in got.items():
                    assert torch.equal(value, want[n]), (name, r, case, n)


def test_an_error_on_one_rank_in_a_sharded_step_is_raised_on_every_rank(stopped_sharded_steps):
    """An exception on one rank inside a sharded step (rank 1's, injected there alone: a
    refusal before the step's first collective, its C++ step between the barriers; after
    an overlapped backward, an lr set on rank 1 alone or the refusal) left rank 0 waiting in the next
    barrier or collective, or, once rank 1 ran step() again, paired rank 1's opening
    barrier with rank 0's closing one (rank 0's step returned before rank 1's shard was
    written, and the later collectives mismatched). Now every rank raises at the step's
    next collective: rank 1 its own error, rank 0 one naming rank 1 and its error; both
    say what the step wrote. A re-run of step() on every rank then finishes the step (the
    run equals the one without the error); after an overlapped backward, every rank took
    its speculated steps back (the weights are the initial ones)."""
    results = stopped_sharded_steps
    initial = dict(make_model().named_parameters())
    for name, point, written in (("adamw", "refusal", "not updated"), ("adamw", "kernel", "partly updated"),
                                 ("adafactor", "kernel", "partly updated"),
                                 ("adamw_clipped", "overlap_lr", "not updated"),
                                 ("adamw_clipped", "overlap_refusal", "not updated")):
        overlapped = point.startswith("overlap")
        own = {"refusal": ("ValueError", "injected: rank 1's gradient is refused"),
               "overlap_refusal": ("ValueError", "injected: rank 1's gradient is refused"),
               "kernel": ("RuntimeError", "injected: out of memory in rank 1's kernel"),
               "overlap_lr": ("RuntimeError", "param group 0's lr from")}[point]
        for r, res in enumerate(results):
            errors, weights, counts, stopped = res[name, point]
            at = 0 if overlapped else 1  # the step rank 1 failed in
            assert [i for i, e in enumerate(errors) if e is not None] == [at], (name, point, r, errors)
            kind, text, notes = errors[at]
            if r == 1:
                assert kind == own[0] and own[1] in text, (name, point, text)
                text = "\n".join(notes)
            else:
                assert kind == "LayerstreamError" and "failed on rank 1" in text and own[1] in text, (name, point, text)
            assert written in text, (name, point, r, text)
            if overlapped:
                for n, value in stopped.items():
                    assert torch.equal(value, initial[n].detach()), (name, point, r, n)
            else:  # re-run: as without the error
                want, want_counts = res[name, None][1:3]
                assert counts == want_counts and sum(counts) > 0, (name, point, r)
                for n, value in weights.items():
                    assert torch.equal(value, want[n]), (name, point, r, n)


@pytest.mark.parametrize("point", ["forward", "after_backward"])
def test_an_error_in_one_ranks_step_closure_is_raised_on_every_rank_saying_nothing_was_stepped(point, tmp_path):
    """step(closure) of a sharded optimizer whose closure raises on rank 1 alone (before its
    forward, or after its backward): rank 1 raised its error without a word on the step,
    and rank 0 raised the process group's timeout (in its backward's all-reduce, or at the
    step's opening barrier), saying nothing of what the step left. The failure cannot be
    sent (rank 0 may be in a collective of its own closure, which the flag's all-reduce
    would pair with), so rank 0 still raises at the group's timeout (5 s here), but both
    errors now say that the weights and optimizer states were not updated; they were not."""
    results = _run("sharded_closure_fails_" + point, 2, tmp_path, timeout=90)
    for r, res in enumerate(results):
        kind, text, notes = res["error"]
        note = "\n".join(notes)
        if r == 1:
            assert kind == "ValueError" and "injected: rank 1" in text, (point, text)
            assert res["seconds"] < 5, res["seconds"]  # at once
        else:
            assert "Timed out" in text or "timeout" in text.lower(), (point, text)
            assert res["seconds"] < 30, res["seconds"]  # the group's timeout, not a hang
        inside = r == 1 or point == "forward"  # raised in its own closure, else at the opening barrier
        want = (r"raised in step\(\)'s closure.*no rank has updated weights or optimizer states" if inside else
                r"a collective of the sharded step.*this rank the weights and optimizer states were not updated")
        assert re.search(want + ".*from the last checkpoint on every rank", note, re.S), (point, r, note)
        assert res["unchanged"] and res["states"] == 0, (point, r)


def test_an_optimizer_state_loaded_before_a_sharded_offload_resumes_as_one_loaded_after_it(tmp_path):
    """A whole optimizer state loaded before offload(share_host_store="all") (a resume that
    builds the model on meta, fills it with load_safetensors() and loads the optimizer
    next): the states of the parameters load_safetensors() gave values (the embedding,
    the attention) were adopted whole, and the first sharded step refused AdamW's ("the
    states of parameter 0 do not match it"), while each rank kept and saved Adafactor's of
    the tensors another rank steps (a consolidated checkpoint took them). Now the first
    step takes this rank's shard of them, as of the states waiting for the meta
    parameters (the Linear layers'): the same weights and state dicts as the state loaded
    after offload() (also with that step overlapped), and one process's run without
    offload() to the tolerance of the other sharded tests. A rank's own state dict (its
    shards) loaded before offload() is refused saying to load it after."""
    results = _run("sharded_meta_state", 2, tmp_path)
    for name in ("adamw", "adafactor"):
        for r, res in enumerate(results):
            runs = res[name]
            assert runs["meta_at_load"] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
            assert "load it after offload()" in runs["shards_before_offload"], runs["shards_before_offload"]
            want, want_state = runs["after"], runs["after_state"]
            for way in ("before", "before_overlap"):
                for n, value in want.items():
                    assert torch.equal(runs[way][n], value), (name, r, way, n)
                    torch.testing.assert_close(runs[way][n], runs["one_process"][n], rtol=1e-6, atol=1e-7,
                                               msg=lambda m: f"{name}, rank {r}, {way}, {n}: {m}")
                got_state = runs[way + "_state"]
                assert got_state["layerstream_shard"] == want_state["layerstream_shard"] == {"rank": r, "ranks": 2}
                assert got_state["state"].keys() == want_state["state"].keys()
                for i, st in want_state["state"].items():
                    assert got_state["state"][i].keys() == st.keys(), (name, r, way, i)
                    for k, v in st.items():
                        got = torch.as_tensor(got_state["state"][i][k])
                        assert torch.equal(got, torch.as_tensor(v)), (name, r, way, i, k)


def test_sharded_adafactor_steps_whole_tensors_one_rank_each(tmp_path):
    """layerstream.optim.Adafactor on a shared host copy: each trainable streamed tensor
    is stepped whole by one rank (largest first to the least-loaded rank), the results
    equal one process with the same optimizer, and the Linear weights, lossless-coded on
    the bus, are re-coded by every rank after their owner's write."""
    world = 2
    results = _run("sharded_adafactor", world, tmp_path)
    model = make_model()
    ref_losses = _reference(model, world, optimizer=host_adafactor)
    _check_equal(results, model, ref_losses, world)
    sharded = results[0]["sharded"]
    owned = [set(res["owned"]) for res in results]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(sharded)
    total = sum(res["owned_numel"] for res in results)
    largest = max(p.numel() for n, p in model.named_parameters() if n in sharded)
    assert max(res["owned_numel"] for res in results) <= max(total / 2 + largest / 2, largest)
    for res in results:
        s = res["stats"]
        assert s["coded_layers"] >= 1 and s["recoded_bytes"] > 0  # every rank re-codes its own copy


def test_a_crashed_rank_leaves_no_segment(tmp_path):
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    results = _run("crash", 2, tmp_path, expect_rc=[0, -9])
    assert results[0]["shared_bytes"] > 0 and results[1] is None
    # The survivor still reads the store: its output after the peer's death is the resident
    # model's, bit for bit (the same fp32 ops on the same weights, one thread in both).
    with torch.no_grad():
        want = lora_model(wide=True)(batch_of(0, 0)[:BATCH][0]).sum().item()
    assert results[0]["out"] == want
    # A weight frozen at offload() (so in the shared store) and unfrozen later is refused.
    assert "frozen at offload() and sits in the host store this node's ranks share" in results[0]["unfrozen"]
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert after <= before  # no named segment to clean up: the store was an anonymous memory file
    # No process maps this test's store any more: the kernel freed it with its last
    # mapper. (Found by its device and inode: other layerstream processes on the
    # machine may map memory files of the same name.)
    files = set(results[0]["store_files"])
    assert files
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                if any("memfd:layerstream-store" in line and tuple(line.split()[3:5]) in files for line in f):
                    holders.append(pid)
        except OSError:
            pass
    assert holders == []


def test_destroying_the_group_is_not_held_up_by_offload(tmp_path):
    """offload() holds its process group weakly (C++ and Python): with the model, its
    handle and its optimizer still alive, destroy_process_group() joins gloo's threads at
    once (a group kept alive into the interpreter's shutdown could abort it there); a use
    of the group after that is an error that says so."""
    results = _run("group_destroyed", 2, tmp_path)
    for res in results:
        gloo = res["threads_at_init"] - res["threads_at_start"]  # what init_process_group started
        assert gloo >= 2 and res["threads_joined"] == gloo
        for key in ("backward_error", "step_error"):
            assert "was destroyed (torch.distributed.destroy_process_group())" in res[key]


def test_ranks_that_disagree_are_told(tmp_path):
    results = _run("mismatch", 2, tmp_path)
    for res in results:
        assert "ranks' models or offload() options differ" in res["error"]
        assert "fc1.weight" in res["error"]
        assert "'option budget=None' against 'option budget='1MiB''" in res["budget_error"]
        # Streamed weights initialised differently: their values (sampled) differ.
        assert re.search(r"'values fc1\.weight \w+' against 'values fc1\.weight \w+'.*same streamed weights",
                         res["values_error"]), res["values_error"]


def test_single_process_needs_no_group():
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="share_host_store must be"):
        layerstream.offload(model, device="sim", share_host_store="yes")
    # Nothing to share with: one copy, as without the option (a script for 1..N ranks runs as is).
    handle = layerstream.offload(model, device="sim", share_host_store="all")
    assert handle.stats()["shared_bytes"] == 0 and handle.plan is None
    # DDP leaves the streamed parameters to layerstream even in a one-process job
    # (a one-GPU torchrun would otherwise refuse host and device parameters together).
    # Also as torch.compile's wrapper names them (DDP(torch.compile(model)) reads this list).
    assert model._ddp_params_and_buffers_to_ignore == ["0.weight", "0.bias", "_orig_mod.0.weight", "_orig_mod.0.bias"]
    with handle.no_sync():  # nothing to suspend: a no-op
        model(torch.randn(2, 8)).sum().backward()
    assert model[0].weight.grad is not None
    handle.detach()
    assert model._ddp_params_and_buffers_to_ignore == []


def test_averaging_overlaps_the_backward(tmp_path):
    """Rank 0's backward computes every streamed layer before rank 1 starts its own:
    the all-reduces do not hold the backward (dist_worker.py, "overlap"); both ranks
    end with the same averaged gradients."""
    results = _run("overlap", 2, tmp_path)
    assert results[1]["saw_marker"], "rank 0's backward waited for rank 1 inside an all-reduce"
    for g0, g1 in zip(results[0]["grads"], results[1]["grads"]):
        torch.testing.assert_close(g0, g1, rtol=0, atol=0)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    for r in range(2):  # the reference: each rank's gradients, averaged
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(r))
        (model(x).square().mean() / 2).backward()
    for p, g in zip(model.parameters(), results[0]["grads"]):
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-7)
    assert results[0]["stats"]["averaged_bytes"] == sum(p.numel() * 4 for p in model.parameters())


def test_ddp_around_a_parent_of_the_offloaded_module_is_refused_naming_the_fix():
    """DDP reads the ignore list of the module it wraps; offload() sets it on the module it
    was given. DDP around a parent would reduce the streamed gradients itself, and they
    arrived as zeros: the first forward under it is refused, naming the fix, and the fix
    (the names on the parent's list) trains as the resident model does. One process (a
    store in memory)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.LayerNorm(8))
        ref = copy.deepcopy(model)
        layerstream.offload(model[0], device="sim")
        x = torch.randn(2, 8)
        ddp = nn.parallel.DistributedDataParallel(model)
        with pytest.raises(layerstream.LayerstreamError, match=r"reduces 4 streamed parameter\(s\) itself .*"
                                                               r"_set_params_and_buffers_to_ignore_for_model"):
            ddp(x)
        del ddp
        names = [f"0.{n}" for n in model[0]._layerstream_ddp_ignored]
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp(x).square().sum().backward()
        ref(x).square().sum().backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=n)
        del ddp
    finally:
        dist.destroy_process_group()


def test_the_ranks_first_difference_names_a_layer_only_one_rank_streams():
    """Fingerprint rows are compared as sets: a layer one rank excludes is named as
    missing on that rank, not paired with whatever row follows it on the other."""
    from layerstream._distributed import _first_difference
    a = ["stream fc1 linear None", "stream fc3 linear None", "option activations=None"]
    b = ["stream fc1 linear None", "option activations=None"]
    assert _first_difference(a, b) == "'stream fc3 linear None' against nothing"
    assert _first_difference(b, a) == "nothing against 'stream fc3 linear None'"
    assert _first_difference(["option budget=None"], ["option budget='1MiB'"]) == \
        "'option budget=None' against 'option budget='1MiB''"


def test_ddp_join_is_refused_while_streamed_weights_train_and_allowed_when_they_are_frozen():
    """Under DDP's join() (uneven inputs) a rank that ran out of batches shadows DDP's
    collectives, not the engine's all-reduces of streamed gradients: gloo aborted a rank
    ("collective mismatch"). Refused at the first forward, naming the fix; frozen
    streamed weights (LoRA with the adapters resident) average nothing and train under
    join() as without it. One process (a store in memory), its group given explicitly
    so that the engine averages over it."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8))
        ref = copy.deepcopy(model)
        handle = layerstream.offload(model, device="sim", process_group=dist.group.WORLD)
        x = torch.randn(2, 8)
        ddp = nn.parallel.DistributedDataParallel(model)
        with pytest.raises(layerstream.LayerstreamError, match=r"join\(\) \(uneven inputs\) is not supported.*"
                                                               r"drop_last=True"):
            with ddp.join():
                ddp(x)
        with torch.no_grad(), ddp.join():  # no backward, no collective: allowed
            torch.testing.assert_close(ddp(x), ref(x))
        for m in (model, ref):  # the streamed weights frozen
            for i in (0, 2):
                m[i].requires_grad_(False)
        with ddp.join():
            ddp(x).square().sum().backward()
        ref(x).square().sum().backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), n
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=n)
        assert handle.stats()["averaged_bytes"] == 0
        del ddp
    finally:
        dist.destroy_process_group()


def test_training_outside_join_after_a_join_block_ended_equals_the_resident_model():
    """torch's Join never resets the config it sets on DDP (enable stays True after the
    block): every training forward after any join() block, an evaluation under no_grad
    included, was refused as if still inside join(). A join() now counts until its end
    (DDP's join post-hook): training after it equals the resident model, and a new join()
    is refused again. One process (a store in memory), its group given explicitly."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
        ref = copy.deepcopy(model)
        handle = layerstream.offload(model, device="sim", process_group=dist.group.WORLD)
        x = torch.randn(2, 8)
        ddp = nn.parallel.DistributedDataParallel(model)
        for _ in range(2):  # an evaluation under join(), then a training step outside it
            with torch.no_grad(), ddp.join():
                assert torch.equal(ddp(x), ref(x))
            ddp(x).square().sum().backward()
            ref(x).square().sum().backward()
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad), n
        assert handle.stats()["averaged_bytes"] > 0
        with pytest.raises(layerstream.LayerstreamError, match=r"join\(\) \(uneven inputs\) is not supported"):
            with ddp.join():
                ddp(x)
        del ddp
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_what_ddp_leaves_to_layerstream_is_checked_at_its_first_training_forward(tmp_path, compiled):
    """DDP's ignore list keeps the streamed weights out of its broadcast and its gradient
    reduction. A checkpoint loaded on rank 0 alone after offload() reached rank 0 alone,
    and offload(process_group=False) under a DDP of 2 ranks averaged no streamed gradient:
    both trained on, the ranks' weights apart, silently. Now both are refused at the
    first training forward on every rank, naming the fix, as is DDP around a parent of the
    offloaded model; loaded on every rank, the ranks train as one process on the
    concatenated batch. Also under torch.compile(DDP(model)), whose traced hooks skipped
    every check (the ranks trained apart, the parent's streamed gradients were zeros)."""
    results = _run("ddp_first_forward" + ("_compiled" if compiled else ""), 2, tmp_path)
    for res in results:
        assert re.search(r"streamed weights differ \(rank 0 and rank 1: 'values \S+ \w+' against "
                         r"'values \S+ \w+'\).*load it on every rank", res["rank0_only"]), res["rank0_only"]
        assert re.search(r"averages them over no group.*process_group=None", res["no_group"]), res["no_group"]
        assert re.search(r"reduces 9 streamed parameter\(s\) itself \(e\.g\. 'inner\.emb\.weight'\)",
                         res["parent"]), res["parent"]
    model = make_model()
    _check_equal([res["every_rank"] for res in results], model, _reference(model, 2), 2)


def test_ddp_of_a_compiled_model_equals_one_process(tmp_path):
    """DistributedDataParallel(torch.compile(model)) reads the model's ignore list through
    the compiled wrapper, which names the parameters '_orig_mod.<name>': with the plain
    names alone DDP reduced the streamed gradients itself, and those arrived as zeros,
    silently. offload() lists both names: the ranks train as one process on the
    concatenated batch, with DDP's no_sync() for the first micro-batch of each step."""
    results = _run("full_ddp_of_compiled", 2, tmp_path)
    model = make_model()
    _check_equal(results, model, _reference(model, 2), 2)
    assert all(res["stats"]["averaged_bytes"] > 0 for res in results)


def test_a_write_to_a_frozen_weight_the_ranks_share_is_refused_on_every_rank(tmp_path):
    """The frozen streamed weights of a node's ranks are one host copy (the default): peft's
    merge_adapter() on rank 0 alone (an evaluation, LoRA under DDP) merged the adapter into
    rank 1's weights too, silently. Now a write after offload(), through .data (the
    merge) or through the parameter (load_state_dict), is refused at the next call of the
    model on every rank of the node (rank 0 eager, rank 1 compiled), naming
    share_host_store=False, and so is a quantized weight's copy_() (a re-quantization into
    the shared store), at once; with share_host_store=False, rank 0 merges and loads and
    rank 1's outputs stay its own."""
    results = _run("shared_frozen_write", 2, tmp_path)
    weight = r"frozen streamed weight base_model\.model\.\S+ "
    dotdata = weight + r"changed after offload\(\) without a write through the parameter on this rank .*"
    shared = r"it sits in the host store this node's ranks share .*share_host_store=False"
    for rank, res in enumerate(results):
        assert re.search(dotdata + shared, res["merge_None"]), (rank, res["merge_None"])
        loaded = weight + r"was written in place after offload\(\) \(copy_" if rank == 0 else dotdata
        assert re.search(loaded + ".*" + shared, res["load_None"]), (rank, res["load_None"])
        # A quantized weight's copy_() (a re-quantization into the shared store): refused at the write,
        # by the engine (Engine::requantize_refusal); a load_state_dict() before it writes any key.
        requantize = r" cannot be re-quantized after offload\(\) \(copy_, load_state_dict\(\)\): " + shared
        assert re.search(r"load_state_dict\(\) refused before writing anything: 'attn\.in_proj_weight' .*: "
                         r"tensor #\d+ of streamed group 'attn'" + requantize,
                         res["requantize_load_None"]), res["requantize_load_None"]
        assert re.search(r"the quantized weight of streamed layer 'fc1'" + requantize,
                         res["requantize_copy_None"]), res["requantize_copy_None"]
        assert res["requantize_load_False"] is None and res["requantize_copy_False"] is None
    assert 0 < results[0]["merge_False"] < 1e-5  # merged: the same function, rounded otherwise
    assert results[0]["load_False"] > 0.1
    assert results[1]["merge_False"] == results[1]["load_False"] == 0  # rank 1's weights are its own
