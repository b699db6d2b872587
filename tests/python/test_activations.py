"""Activation offload (docs/design/activations.md): offload(activations="host" | size).

On the sim device the saved tensors cross to host memory and back by byte copies, so
gradients equal the run without offload bit for bit; the ordering checker (asserted by the
offload_sim fixture) sees every read of a restored activation ordered after its copy back."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import layerstream
from conftest import assert_grads_match, clone_input, tiny_llama


def _mlp(width=256, depth=4):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 8))


def _train(model, ref, x, steps=2, after_forward=None):
    for _ in range(steps):
        xr = clone_input(x)
        y, yr = model(x), ref(xr)
        if after_forward is not None:
            after_forward()
        assert torch.equal(y, yr)
        y.square().sum().backward()
        yr.square().sum().backward()
        if x.requires_grad:
            assert torch.equal(x.grad, xr.grad)
            x.grad = None
        assert_grads_match(model, ref, exact=True)
        model.zero_grad()
        ref.zero_grad()


def _after_forward(handle, seen):
    """_train(after_forward=...): every copy of the forward finished, then the stats."""
    def snapshot():
        handle.synchronize()
        seen.append(handle.stats())
    return snapshot


def test_mlp_gradients_are_bit_identical_and_activations_cross_both_ways(offload_sim):
    model = _mlp()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, activations="host")
    x = torch.randn(128, 256, requires_grad=True)  # 128 KiB activations
    # Every copy to the host has finished before backward (synchronize): a stash whose
    # copy is still running when backward wants it is handed back from the device, with
    # no copy back, so without this the count below depends on the machine's load.
    _train(model, ref, x, after_forward=handle.synchronize)
    s = handle.stats()
    assert s["activation_d2h_bytes"] > 0
    assert s["activation_h2d_bytes"] == s["activation_d2h_bytes"]  # each back once
    assert "saved activations: to pinned host memory" in handle.plan


class _Wrapped(nn.Module):
    """A module holding the model, as peft's wrappers hold a causal LM."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_a_call_below_the_root_offloads_its_activations(offload_sim):
    """A training call of a module inside the offloaded model (the causal LM inside
    peft's wrappers, model.model(...)) skipped the root's hooks: nothing it saved went
    to the host. The scope opens at such a call too (Note [Calls that enter the model
    below its root] in _calls.py), and only nests inside a call of the root."""
    model = _Wrapped(_Wrapped(_mlp()))
    ref = copy.deepcopy(model)
    handle = offload_sim(model, activations="host")
    x = torch.randn(128, 256, requires_grad=True)
    _train(model.inner, ref.inner, x, after_forward=handle.synchronize)
    below = handle.stats()["activation_d2h_bytes"]
    assert below > 0
    _train(model, ref, x, after_forward=handle.synchronize)
    assert handle.stats()["activation_d2h_bytes"] == 2 * below  # nested: the same saves, once each


def test_device_activation_bytes_drop(offload_sim):
    """The same step with every saved tensor kept on the device (a budget larger than
    all of them) and with activations="host": once the copies to the host have finished
    (synchronize), the saved activations left on the device are none of the 17 (each
    Linear's input, each GELU's). The peak counts copies in flight: with the copies
    waited for after each module (a forward hook), it is that of one module's saved
    tensors, not all 17 (without the wait it depends on how fast the sim device's copy
    thread runs beside the compute, which a loaded machine slows down)."""
    seen = {}
    for mode in ("1TiB", "host"):
        torch.manual_seed(0)
        model = _mlp(depth=8)
        handle = offload_sim(model, activations=mode, prefetch=1)
        for m in model:
            m.register_forward_hook(lambda *_: handle.synchronize())
        x = torch.randn(128, 256, requires_grad=True)
        loss = model(x).square().sum()
        handle.synchronize()
        after_forward = handle.stats()["activation_device_bytes"]
        loss.backward()
        s = handle.stats()
        seen[mode] = (after_forward, s["peak_activation_device_bytes"], s["activation_device_bytes"])
        assert (s["activation_d2h_bytes"] > 0) == (mode == "host")
        handle.detach()
    one = 128 * 256 * 4
    assert seen["1TiB"][0] == seen["1TiB"][1] == 17 * one, seen
    assert seen["host"][0] == 0, seen
    assert 0 < seen["host"][1] <= 2 * one, seen
    assert seen["host"][2] == seen["1TiB"][2] == 0, seen  # all released by the backward


def test_a_device_budget_keeps_the_newest_saved_tensors(offload_sim):
    """13 saved tensors of 128 KiB (6 x Linear+GELU and the last Linear's input) and a
    device budget of 4 of them: 4 stay, the 9 others go to the host and only those come
    back, and the gradients do not change. (That the 4 are the newest: the next test.)"""
    model = _mlp(depth=6)
    ref = copy.deepcopy(model)
    one = 128 * 256 * 4
    handle = offload_sim(model, activations=4 * one)
    seen = []
    x = torch.randn(128, 256, requires_grad=True)
    _train(model, ref, x, steps=1, after_forward=_after_forward(handle, seen))
    s = handle.stats()
    assert seen[0]["activation_device_bytes"] == 4 * one, seen
    assert seen[0]["activation_d2h_bytes"] == 9 * one, seen
    assert s["activation_h2d_bytes"] == 9 * one, s
    assert "the newest 0.50 MiB kept on the device" in handle.plan


def test_the_window_is_the_newest_tensors_through_the_engine_api():
    handle = layerstream.offload(_mlp(), device="sim", activations="host")
    engine = handle._engine
    nbytes = 256 * 256 * 4
    engine.begin_activations(2 * nbytes)
    ts = [torch.randn(256, 256) for _ in range(5)]
    tokens = [engine.stash_activation(t) for t in ts]
    engine.synchronize()
    s = handle.stats()
    assert s["activation_d2h_bytes"] == 3 * nbytes and s["activation_device_bytes"] == 2 * nbytes, s
    for i in (4, 3):  # kept: handed back without a copy
        assert torch.equal(engine.restore_activation(tokens[i]), ts[i])
    assert handle.stats()["activation_h2d_bytes"] == 0
    for i in (2, 1, 0):
        assert torch.equal(engine.restore_activation(tokens[i]), ts[i])
    engine.synchronize()
    assert handle.stats()["activation_h2d_bytes"] == 3 * nbytes
    for t in tokens:
        engine.drop_activation(t)
    assert not handle.ordering_errors()
    handle.detach()


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_copies_back_start_ahead_of_the_backward(prefetch, passes):
    """Restoring a saved tensor also starts the copies back of the `prefetch` saved
    just before it (the backward unpacks them next), each once. A retained graph's
    second backward (passes=2) restores every one again: they were all handed out to
    the first, and the prefetch skipped handed-out entries without counting them, so
    each restore walked the whole map (quadratic) and started no copy back early."""
    handle = layerstream.offload(_mlp(), device="sim", activations="host", prefetch=prefetch)
    engine = handle._engine
    nbytes = 256 * 256 * 4
    engine.begin_activations(0)
    ts = [torch.randn(256, 256) for _ in range(5)]
    tokens = [engine.stash_activation(t) for t in ts]
    engine.synchronize()
    for _ in range(passes):
        start = handle.stats()["activation_h2d_bytes"]
        for n, i in enumerate(reversed(range(5))):
            assert torch.equal(engine.restore_activation(tokens[i]), ts[i])
            ahead = min(prefetch, i)  # the earlier ones copying back too
            assert handle.stats()["activation_h2d_bytes"] - start == (n + 1 + ahead) * nbytes, (i, handle.stats())
        engine.synchronize()
    for t in tokens:
        engine.drop_activation(t)
    assert not handle.ordering_errors()
    handle.detach()


@pytest.mark.parametrize("host_budget", [None, "24MiB"])
def test_the_host_pool_stays_bounded_when_shapes_change_every_step(host_budget):
    """Dynamic padding: another sequence length every step. The pool kept a buffer of every
    exact size ever seen (85 MiB after 60 steps of at most 2 MiB each); under a host
    budget it filled it by step 30, after which every saved tensor stayed on the device
    (on a GPU: out of memory some steps later). Now buffers of a size class are reused
    and the pool stays within twice the most in use at once; every step offloads all it
    saves, and the gradients equal the resident model's."""
    import random
    torch.manual_seed(0)
    model = _mlp(depth=2)
    ref = copy.deepcopy(model)
    kw = {} if host_budget is None else {"host_budget": host_budget}
    handle = layerstream.offload(model, device="sim", activations="host", **kw)
    rng = random.Random(0)
    peak_step = 0
    # Growing lengths first (no free buffer is large enough: each step allocates, the
    # smaller ones go free), then random ones.
    for tokens in [int(64 * 1.09 ** k) for k in range(25)] + [rng.randint(64, 512) for _ in range(15)]:
        x = torch.randn(tokens, 256)
        before = handle.stats()["activation_d2h_bytes"]
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
        s = handle.stats()
        saved = s["activation_d2h_bytes"] - before
        peak_step = max(peak_step, saved)
        assert saved >= 3 * tokens * 256 * 4, (tokens, s)  # the three Linear inputs (and more) went to the host
        assert s["activation_host_bytes"] <= 2.5 * peak_step, (s, peak_step)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n
    handle.detach()


def test_a_restore_before_the_copy_to_the_host_finished_copies_back_after_it():
    """On a GPU the allocator takes a saved tensor when its copy to the host is issued,
    so a restore before that copy finished copies back, ordered after it. The sim still
    holds the tensor then but copies back as well, so that the checker sees that order:
    here a restore during a 200 ms copy, with the saved values."""
    handle = layerstream.offload(_mlp(), device="sim", activations="host", sim_latency_us=200_000)
    engine = handle._engine
    engine.begin_activations(0)
    t = torch.randn(256, 256)
    token = engine.stash_activation(t)
    restored = engine.restore_activation(token)
    s = handle.stats()
    assert s["activation_d2h_bytes"] == s["activation_h2d_bytes"] == t.numel() * 4, s
    engine.synchronize()
    assert torch.equal(restored, t)
    assert not handle.ordering_errors(), handle.ordering_errors()
    engine.drop_activation(token)
    handle.detach()


@pytest.mark.parametrize("ordered", [True, False])
def test_a_host_buffer_reused_before_its_copy_back_ends_is_an_ordering_error(ordered):
    """The checker's view of the pool: a host buffer handed to a new stash must be
    ordered after the copy back that reads it. The restore does not order the compute
    stream (order_compute=False: a read error of its own, on the restored tensor), so
    only the pool's event orders the reuse; drop_activation(order_reuse=False) leaves
    it out and the checker reports the host buffer."""
    handle = layerstream.offload(_mlp(), device="sim", activations="host")
    engine = handle._engine
    engine.begin_activations(0)
    t = torch.randn(256, 256)
    token = engine.stash_activation(t)
    engine.synchronize()
    restored = engine.restore_activation(token, order_compute=False)
    engine.drop_activation(token, order_reuse=ordered)
    t2 = torch.randn(256, 256)
    token2 = engine.stash_activation(t2)  # into the pooled buffer the copy back reads
    errors = handle.ordering_errors()
    assert any("on buffer 'restored activation'" in e for e in errors), errors  # the planted read
    reuse = [e for e in errors if "on buffer 'saved activation'" in e]
    if ordered:
        assert not reuse, reuse
    else:
        assert reuse and "stream 'activations' writes it" in reuse[0], errors
    engine.synchronize()
    if ordered:  # unordered, the copy back may really have read t2's bytes: the race is real
        assert torch.equal(restored, t) and torch.equal(engine.restore_activation(token2), t2)
    engine.drop_activation(token2)
    handle.detach()


def _budget_step(offload_sim, warning, budget):
    """One training step of _mlp() (9 saved tensors of 128 KiB) offloaded with
    activations="host" and `budget(weights, one)` as offload() keywords, which must
    warn `warning`: (handle, the stats after the forward, one buffer's bytes). The
    store takes the weights (aligned), the gradients' staging buffers as many bytes again."""
    model = _mlp()
    ref = copy.deepcopy(model)
    one = 128 * 256 * 4
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    seen = []
    with pytest.warns(RuntimeWarning, match=warning):
        handle = offload_sim(model, activations="host", **budget(weights, one))
        x = torch.randn(128, 256, requires_grad=True)
        _train(model, ref, x, after_forward=_after_forward(handle, seen))
    return handle, seen[0], one


def test_the_host_budget_bounds_the_host_copies(offload_sim):
    """host_budget= covers the saved activations' host buffers: what the store and the
    gradients' staging buffers leave (3 buffers of 128 KiB here) is all they get; the
    rest stay on the device, with a warning, and the numbers do not change."""
    handle, after, one = _budget_step(offload_sim, "saved activations: the host budget leaves .* for their host copies",
                                      lambda w, one: dict(host_budget=2 * w + 3 * one + one // 2))
    assert handle.host_plan["spare_host_bytes"] // one == 3
    assert after["activation_d2h_bytes"] == 3 * one, after
    assert after["activation_device_bytes"] == 6 * one, after  # 9 saved, 3 on the host
    assert handle.stats()["activation_host_bytes"] == 3 * one
    assert f"the host budget leaves {handle.host_plan['spare_host_bytes'] / 2**20:.2f} MiB for their host copies" \
        in handle.plan


def test_the_pinned_budget_bounds_the_pinned_host_copies(offload_sim):
    """pinned_budget= leaves 2 buffers' worth of pinned memory for the saved
    activations: the others still go to the host, in pageable buffers, with a warning;
    the numbers do not change."""
    handle, after, one = _budget_step(offload_sim, "saved activations: the pinned budget leaves .* use pageable memory",
                                      lambda w, one: dict(pinned_budget=2 * w + 2 * one + one // 2))
    spare = handle.host_plan["spare_pinned_bytes"]
    assert spare // one == 2
    assert after["activation_d2h_bytes"] == 9 * one and after["activation_device_bytes"] == 0, after
    assert handle.stats()["activation_host_bytes"] == 9 * one
    assert (f"saved activations: to pinned host memory up to {spare / 2**20:.2f} MiB (what the pinned budget "
            f"leaves), the rest pageable") in handle.plan


def test_the_plan_says_pageable_when_saved_activations_get_no_pinned_memory(offload_sim):
    """handle.plan names the host memory the engine uses for the saved activations'
    copies: pageable with pin_memory=False, or when the pinned budget leaves them
    nothing (the engine's warning at the first copy says the same); it said "pinned"."""
    handle, _, one = _budget_step(offload_sim, "saved activations: the pinned budget leaves 0 B",
                                  lambda w, one: dict(pinned_budget=one))
    assert handle.host_plan["spare_pinned_bytes"] == 0
    assert "saved activations: to pageable host memory (the pinned budget leaves none for them)" in handle.plan
    handle.detach()
    handle = offload_sim(_mlp(), activations="host", pin_memory=False)
    assert "saved activations: to pageable host memory (pin_memory=False)" in handle.plan
    assert "pinned" not in [line for line in handle.plan.splitlines() if "saved activations" in line][0]


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_blocks_inputs_are_offloaded(offload_sim, reentrant):
    """Gradient checkpointing saves only each block's input (both forms keep it through
    the saved-tensor hooks: the reentrant form's save_for_backward, the non-reentrant
    form's saved inputs); those go to the host and come back for the recomputation."""
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)

        def forward(self, x):
            return x + self.b(torch.tanh(self.a(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(4))

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=reentrant)
            return x

    model = Net()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, activations="host")
    seen = []
    x = torch.randn(128, 256, requires_grad=True)
    _train(model, ref, x, after_forward=_after_forward(handle, seen))
    one = 128 * 256 * 4
    assert seen[0]["activation_d2h_bytes"] == 4 * one, seen  # the 4 blocks' inputs
    assert seen[0]["activation_device_bytes"] == 0, seen
    assert handle.stats()["activation_h2d_bytes"] == 2 * 4 * one  # each back once per step


@pytest.mark.parametrize("mode", ["host", "1GiB"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpoint_around_the_whole_model_keeps_checkpointing(offload_sim, reentrant, mode):
    """torch.utils.checkpoint around the offloaded model itself (Note [Other saved-tensor
    hooks around the model]): the checkpoint still recomputes the model in backward, and
    nothing is offloaded or kept on the device by the engine. Non-reentrant, the call runs
    under the checkpoint's hooks: left to them, with one warning (ours on top took every
    save: the checkpoint recomputed nothing, and with a device budget all stayed on the
    device). Reentrant, the recomputation runs inside backward: its saves are that
    backward's (offloaded, they went to the host and straight back)."""
    from torch.utils.checkpoint import checkpoint

    model = _mlp()
    ref = copy.deepcopy(model)
    calls = []
    model[0].register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    handle = offload_sim(model, activations=mode)
    x = torch.randn(128, 256, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            xr = clone_input(x)
            y = checkpoint(model, x, use_reentrant=reentrant)
            yr = checkpoint(ref, xr, use_reentrant=reentrant)
            handle.synchronize()
            after_forward = handle.stats()
            assert torch.equal(y, yr)
            y.square().sum().backward()
            yr.square().sum().backward()
            assert torch.equal(x.grad, xr.grad)
            assert_grads_match(model, ref, exact=True)
            x.grad = None
            model.zero_grad()
            ref.zero_grad()
            assert after_forward["activation_device_bytes"] == 0, after_forward
    s = handle.stats()
    assert s["activation_d2h_bytes"] == s["activation_h2d_bytes"] == 0, s
    assert s["peak_activation_device_bytes"] == 0, s
    assert len(calls) == 4  # each step's forward and its recomputation
    ours = [w for w in caught if "other saved-tensor hooks" in str(w.message)]
    assert len(ours) == (0 if reentrant else 1), [str(w.message) for w in caught]
    if ours:
        assert "gradient_checkpointing_enable()" in str(ours[0].message)


def test_saved_tensor_hooks_of_the_caller_stay_in_charge(offload_sim):
    """save_on_cpu() around the model's call: its hooks take what the call saves (ours are
    not entered over them), with the warning; the next call without them is offloaded."""
    model = _mlp()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, activations="host")
    x = torch.randn(128, 256, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="other saved-tensor hooks"):
        with torch.autograd.graph.save_on_cpu():
            y = model(x)
    y.square().sum().backward()
    ref(clone_input(x)).square().sum().backward()
    assert_grads_match(model, ref, exact=True)
    assert handle.stats()["activation_d2h_bytes"] == 0
    model.zero_grad()
    ref.zero_grad()
    x.grad = None
    _train(model, ref, x, steps=1, after_forward=handle.synchronize)
    assert handle.stats()["activation_d2h_bytes"] > 0


def test_an_offloaded_model_called_inside_another_offloads_its_own_saves(offload_sim):
    """Another offloaded model's scope on top is layerstream's, not a caller's hooks to
    leave in charge: the inner model's call opens its own scope over the outer's, and what
    it saves goes to its own engine, without a warning."""
    inner = _mlp(depth=2)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(256, 256), nn.Linear(8, 8)
            self.inner = [inner]  # not a submodule: offloaded on its own

        def forward(self, x):
            return self.b(self.inner[0](torch.tanh(self.a(x))))

    outer = Outer()
    ref = copy.deepcopy(outer)
    ref.inner = [copy.deepcopy(inner)]
    inner_handle = offload_sim(inner, activations="host")
    outer_handle = offload_sim(outer, activations="host")
    x = torch.randn(128, 256, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(outer, ref, x, steps=1, after_forward=lambda: (inner_handle.synchronize(), outer_handle.synchronize()))
    for p, q in zip(inner.parameters(), ref.inner[0].parameters()):
        assert torch.equal(p.grad, q.grad)
    one = 128 * 256 * 4
    assert inner_handle.stats()["activation_d2h_bytes"] == 5 * one  # its 3 Linears' and 2 GELUs' inputs
    assert outer_handle.stats()["activation_d2h_bytes"] == 2 * one  # a's input and output (tanh's)


@pytest.mark.parametrize("ckpt", [None, "reentrant", "non-reentrant"])
def test_llama_training_with_and_without_gradient_checkpointing(offload_sim, ckpt):
    def build():
        m = tiny_llama(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4)
        if ckpt is not None:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=ckpt == "reentrant"))
        return m.train()

    model, ref = build(), build()
    ref.load_state_dict(model.state_dict())
    handle = offload_sim(model, activations="host")
    ids = torch.randint(0, 64, (4, 64))
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss_ref = ref(input_ids=ids, labels=ids, use_cache=False).loss
        assert torch.equal(loss, loss_ref)
        loss.backward()
        loss_ref.backward()
        assert_grads_match(model, ref, exact=True)
        model.zero_grad()
        ref.zero_grad()
    assert handle.stats()["activation_d2h_bytes"] > 0


def test_conv_net_channels_last(offload_sim):
    model = nn.Sequential(nn.Conv2d(8, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(32, 4, 1)).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(model)
    handle = offload_sim(model, activations="host")
    x = torch.randn(4, 8, 32, 32).to(memory_format=torch.channels_last).requires_grad_()
    _train(model, ref, x)
    assert handle.stats()["activation_d2h_bytes"] > 0


def test_autocast_and_lora(offload_sim):
    from peft import LoraConfig, get_peft_model

    def build():
        torch.manual_seed(0)
        return get_peft_model(_mlp(), LoraConfig(r=8, target_modules=["0", "2", "4"]))

    model, ref = build(), build()
    ref.load_state_dict(model.state_dict())
    handle = offload_sim(model, activations="host")
    x = torch.randn(128, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, yr = model(x), ref(x)
    assert torch.equal(y, yr)
    y.float().square().sum().backward()
    yr.float().square().sum().backward()
    assert_grads_match(model, ref, exact=True)
    assert handle.stats()["activation_d2h_bytes"] > 0


def test_backward_twice_with_retain_graph_and_a_graph_freed_without_backward(offload_sim):
    model = _mlp()
    ref = copy.deepcopy(model)
    offload_sim(model, activations="host")
    x = torch.randn(128, 256)
    loss, loss_ref = model(x).square().sum(), ref(x).square().sum()
    for _ in range(2):
        loss.backward(retain_graph=True)
        loss_ref.backward(retain_graph=True)
    assert_grads_match(model, ref, exact=True)
    del loss  # its saved activations go back to the pool
    model(x).square().sum().backward()  # reuses the host buffers
    ref(x).square().sum().backward()
    assert_grads_match(model, ref, exact=True)


def test_retain_graph_backwards_count_each_copy_back_only_while_autograd_holds_it(offload_sim):
    """Each backward of a retained graph copies the offloaded activations back, and autograd
    lets go of each copy once its node ran: activation_device_bytes counted every copy until
    the graph was freed (4, 8, 12 x 128 KiB after three backwards, the peak too). Now it is 0
    after each backward, and the peak does not grow with the backwards."""
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    handle = offload_sim(model, activations="host")
    loss = model(torch.randn(128, 256)).square().sum()
    handle.synchronize()
    peaks = []
    for _ in range(3):
        loss.backward(retain_graph=True)
        s = handle.stats()
        assert s["activation_h2d_bytes"] > 0
        assert s["activation_device_bytes"] == 0, s
        peaks.append(s["peak_activation_device_bytes"])
    assert peaks[0] == peaks[1] == peaks[2] > 0, peaks
    del loss
    assert handle.stats()["activation_device_bytes"] == 0


@pytest.mark.parametrize("prefetch", [1, 3])
def test_a_backward_frees_the_copies_back_it_did_not_hand_out(offload_sim, prefetch):
    """Note [Copies back that no backward reads]: a backward's prefetch copies back the
    tensors saved before the one it unpacks. Those of a graph kept without a backward (a
    validation loss kept with its graph), or of the part of a graph torch.autograd.grad does
    not reach, stayed on the device until their graph was freed (activation_device_bytes
    256 KiB after each step, here). They are freed at the end of the backward; the gradients
    are the same, and the kept graph's own backward still is."""
    model = _mlp()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, activations="host", prefetch=prefetch)
    x = torch.randn(128, 256)
    kept, kept_ref = model(x).square().sum(), ref(x).square().sum()
    handle.synchronize()
    _train(model, ref, torch.randn(128, 256))
    handle.synchronize()
    assert handle.stats()["activation_device_bytes"] == 0, handle.stats()
    kept.backward()
    kept_ref.backward()
    assert_grads_match(model, ref, exact=True)
    assert handle.stats()["activation_device_bytes"] == 0
    # Part of a graph: the gradient of an inner output; the first layers' saved
    # tensors are not unpacked, while the graph lives on.
    mids = {}
    for m, key in ((model, "model"), (ref, "ref")):
        m[3].register_forward_hook(lambda mod, args, out, key=key: mids.__setitem__(key, out))
    x = torch.randn(128, 256)
    loss, loss_ref = model(x).square().sum(), ref(x).square().sum()
    (g,) = torch.autograd.grad(loss, mids["model"])
    (g_ref,) = torch.autograd.grad(loss_ref, mids["ref"])
    assert torch.equal(g, g_ref)
    handle.synchronize()
    assert handle.stats()["activation_device_bytes"] == 0, handle.stats()
    del loss, loss_ref, mids
    assert handle.stats()["activation_device_bytes"] == 0
    assert handle.ordering_errors() == []


def test_a_read_before_the_copy_back_lands_is_an_ordering_error():
    """The checker's view of the protocol: a restore that does not order the compute
    stream after its copy back (order_compute=False) is reported."""
    model = _mlp()
    handle = layerstream.offload(model, device="sim", activations="host", sim_link_gbps=0.5)
    engine = handle._engine
    t = torch.randn(256, 256)
    token = engine.stash_activation(t)
    assert token >= 0
    del t
    engine.synchronize()  # the copy to the host is done: the device tensor is gone
    restored = engine.restore_activation(token, order_compute=False)
    errors = handle.ordering_errors()
    assert any("saved activation" in e for e in errors), errors
    engine.synchronize()  # the copy back lands in `restored`: keep it until then
    del restored
    engine.drop_activation(token)
    handle.detach()


def test_a_resident_layers_weight_is_not_copied(offload_sim):
    """A resident Linear's backward needs its weight (torch saves the transposed view,
    not the parameter): held by the model anyway, it stays put. Saved and moved: x,
    the GELU's input and the streamed layer's input, 128 KiB each; not the 256 KiB
    weight."""
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    ref = copy.deepcopy(model)
    handle = offload_sim(model, activations="host", exclude=["0"])
    assert handle.layers == ["2"]
    seen = []
    x = torch.randn(128, 256, requires_grad=True)
    _train(model, ref, x, steps=1, after_forward=_after_forward(handle, seen))
    assert seen[0]["activation_d2h_bytes"] == 3 * 128 * 256 * 4, seen


def test_bad_activations_values_say_what_is_accepted():
    with pytest.raises(ValueError, match="use None \\(off\\), 'host', or a device budget"):
        layerstream.offload(_mlp(), device="sim", activations="disk")


def test_a_forward_without_backward_releases_what_it_saved(offload_sim):
    """tanh saves its output: held with its history, the engine's entry would keep the
    node that holds the entry's token alive. Freed with the graph instead."""
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh())
    handle = offload_sim(model, activations="1TiB")  # every saved tensor kept (accounted)
    for _ in range(3):
        model(torch.randn(128, 256)).sum()  # graph freed at once, no backward
    stats = handle.stats()
    # Released as each graph went, not at the next forward or detach(): nothing held now.
    assert stats["activation_device_bytes"] == 0 and stats["activation_host_bytes"] == 0, stats
    peak = stats["peak_activation_device_bytes"]
    one_forward = 4 * 128 * 256 * 4  # two Linear inputs, two tanh outputs
    assert 0 < peak <= one_forward, (peak, one_forward)  # each forward's saved tensors were released


def test_under_torch_compile_the_compiled_regions_saved_tensors_are_offloaded(offload_sim):
    """The hooks are entered around the compiled model (Dynamo runs them outside its
    graph: a break at the model's start and end); what the compiled region saves for
    backward goes through them."""
    model = _mlp()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, activations="host")
    x = torch.randn(128, 256, requires_grad=True)
    xr = clone_input(x)
    y = torch.compile(model, backend="aot_eager")(x)
    yr = ref(xr)
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    yr.square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    assert_grads_match(model, ref, rtol=1e-5, atol=1e-5)
    assert handle.stats()["activation_d2h_bytes"] > 0
    torch._dynamo.reset()


def test_fullgraph_compile_with_activation_offload_says_why_and_what_to_do(offload_sim):
    """fullgraph=True cannot hold the hooks' scope: Dynamo's error gives the reason
    layerstream attached (compile the blocks, or drop fullgraph), not a failure deep in the
    hooks ("Attempted to call function marked as skipped: _thread.get_ident"). Compiling
    each block with fullgraph=True works, with the blocks' saved tensors offloaded."""
    model = _mlp()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, activations="host")
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported,
                       match=r"saved-tensor hooks scope.*compile the model's blocks instead"):
        torch.compile(model, fullgraph=True, backend="aot_eager")(torch.randn(128, 256))
    torch._dynamo.reset()
    for i, block in enumerate(model):  # the model's own call (its hooks), each block compiled whole
        model[i] = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = torch.randn(128, 256, requires_grad=True)
    xr = clone_input(x)
    y = model(x)
    yr = ref(xr)
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    yr.square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    assert handle.stats()["activation_d2h_bytes"] > 0
    torch._dynamo.reset()


def test_the_trace_shows_activation_copies_on_their_own_lanes(offload_sim, tmp_path):
    model = _mlp()
    handle = offload_sim(model, activations="host", trace=True)
    model(torch.randn(128, 256)).square().sum().backward()
    path = tmp_path / "trace.json"
    handle.export_trace(str(path))
    text = path.read_text()
    assert "act d2h" in text and "act h2d" in text


class _Interrupt(nn.Module):
    """Raises KeyboardInterrupt (Ctrl-C) once when armed: torch skips always-called
    forward hooks for anything that is not an Exception."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return x


def test_a_forward_interrupted_by_ctrl_c_does_not_leave_its_scope_open(offload_sim):
    """Note [An interrupted forward's scope]: after a forward interrupted by
    KeyboardInterrupt, the next call closes the left-over scope (training goes on bit for
    bit, and a computation outside the model saves its tensors in place again), and so
    does detach() (autograd outside the model works after it)."""
    stop = _Interrupt()
    model = nn.Sequential(*_mlp()[:4], stop, *_mlp()[4:])
    ref = copy.deepcopy(model)
    handle = offload_sim(model, activations="host")
    x = torch.randn(128, 256)
    stop.armed = True
    with pytest.raises(KeyboardInterrupt):
        model(x)
    _train(model, ref, x, after_forward=handle.synchronize)
    other = nn.Linear(256, 256)
    crossed = handle.stats()["activation_d2h_bytes"]
    other(torch.randn(128, 256, requires_grad=True)).tanh().sum().backward()
    assert handle.stats()["activation_d2h_bytes"] == crossed
    stop.armed = True
    with pytest.raises(KeyboardInterrupt):
        model(x)
    handle.detach()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # closed by detach() itself
    other(torch.randn(128, 256, requires_grad=True)).tanh().sum().backward()  # no engine involved
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


class _ConjNeg(nn.Module):
    """Saves a conjugate view (z * z.conj() saves the lazy conj) and a negative view."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x):
        h = self.lin(x)
        z = torch.complex(h, h.flip(1))
        r = z * z.conj()
        return self.out(r.real + r.imag + h * torch._neg_view(h * 2))


@pytest.mark.parametrize("activations", ["host", "1KiB"])
def test_conjugate_and_negative_views_are_saved_with_their_bit(offload_sim, activations):
    """A conj/neg view's bit is not in its bytes: it crossed as bytes and came back plain
    (gradients off by hundreds, no ordering error). Such views stay on the device."""
    torch.manual_seed(0)
    model = _ConjNeg()
    ref = copy.deepcopy(model)
    offload_sim(model, slots=2, activations=activations)
    _train(model, ref, torch.randn(256, 256), steps=2)


@pytest.mark.parametrize("activations", ["host", "1MiB"])
def test_a_write_in_place_between_forward_and_backward_is_still_caught(offload_sim, activations):
    """torch skips its saved-tensor version check under saved-tensor hooks: with activation
    offload an in-place write after the forward (an optimizer step before backward, an
    edit of a saved output) went unnoticed and backward used the new values. The engine
    and the kept tensors check as autograd does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    offload_sim(model, slots=2, activations=activations)
    x = torch.randn(256, 256, requires_grad=True)
    loss = model(x).square().sum()
    with torch.no_grad():
        model[2].weight.mul_(2)  # a streamed weight its backward needs
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: a saved tensor of shape "
                                           r"\[256, 256\] is at version \d+; expected version \d+"):
        loss.backward()

    class SavesItsOutput(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(256, 256)

        def forward(self, x):
            return self.lin(x).exp()  # exp saves its output

    torch.manual_seed(0)
    model = SavesItsOutput()
    offload_sim(model, slots=2, activations=activations)
    y = model(torch.randn(256, 256))
    with torch.no_grad():
        y.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_sparse_and_wrapper_saved_tensors_stay_as_they_are(offload_sim):
    """A sparse matrix saved by torch.sparse.mm (a graph network's adjacency) crashed the
    pack hook (it read the storage of every saved tensor); it stays where it is."""

    class Gcn(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(1)
            idx = torch.randint(0, 256, (2, 4000), generator=g)
            self.adj = torch.sparse_coo_tensor(idx, torch.rand(4000, generator=g), (256, 256)).coalesce()
            self.l1, self.l2 = nn.Linear(256, 256), nn.Linear(256, 256)

        def forward(self, x):
            return self.l2(torch.sparse.mm(self.adj, self.l1(x)).relu())

    torch.manual_seed(0)
    model = Gcn()
    ref = copy.deepcopy(model)
    offload_sim(model, slots=2, activations="host")
    _train(model, ref, torch.randn(256, 256), steps=2)


def test_a_forward_without_backward_frees_its_graph_when_a_saved_output_is_kept_as_it_is():
    """A saved tensor the engine does not take (here sparse: torch.sparse.softmax saves
    its result) was kept with its autograd history: an output holding its own node, a
    cycle through the graph that not even gc freed, so every forward without backward
    (a validation pass with grad on) kept its graph and activations. The gradients stay
    those of the resident model."""
    import gc
    import weakref

    class Sparse(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            z = torch.sparse.softmax(self.lin(x).to_sparse().coalesce(), 0)
            self.seen = weakref.ref(z)
            return z.to_dense()

    torch.manual_seed(0)
    model = Sparse()
    ref = copy.deepcopy(model)
    handle = layerstream.offload(model, device="sim", activations="host")
    x = torch.randn(4, 16)
    gc.disable()
    try:
        out = model(x)
        seen = model.seen
        del out
        assert seen() is None
    finally:
        gc.enable()
    model(x).sum().backward()
    ref(x).sum().backward()
    assert_grads_match(model, ref)
    handle.detach()
