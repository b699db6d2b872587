"""Activation offload (docs/design/activations.md): offload(activations="host" | size).

On the sim device the saved tensors cross to host memory and back by byte copies, so
gradients equal the run without offload bit for bit; the ordering checker (asserted by the
offload_sim fixture) sees every read of a restored activation ordered after its copy back."""
from __future__ import annotations

import copy

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


def test_device_activation_bytes_drop(offload_sim):
    """The same step with every saved tensor kept on the device (a budget larger than
    all of them) and with activations="host": once the copies to the host have finished
    (synchronize), the saved activations left on the device are none of the 17 (each
    Linear's input, each GELU's); the peak, which counts copies in flight, is lower too
    (how much depends on how fast the sim device's copy thread runs beside the compute)."""
    seen = {}
    for mode in ("1TiB", "host"):
        torch.manual_seed(0)
        model = _mlp(depth=8)
        handle = offload_sim(model, activations=mode, prefetch=1)
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
    assert seen["1TiB"][0] == 17 * one, seen
    assert seen["host"][0] == 0, seen
    assert seen["host"][1] < seen["1TiB"][1], seen
    assert seen["host"][2] == seen["1TiB"][2] == 0, seen  # all released by the backward


def test_a_device_budget_keeps_the_first_saved_tensors(offload_sim):
    model = _mlp(depth=6)
    ref = copy.deepcopy(model)
    handle = offload_sim(model, activations=512 << 10)
    x = torch.randn(128, 256, requires_grad=True)
    _train(model, ref, x, steps=1)
    s = handle.stats()
    assert 0 < s["activation_d2h_bytes"]
    assert s["peak_activation_device_bytes"] >= 512 << 10
    assert "the first 0.50 MiB of each forward kept on the device" in handle.plan


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
    engine = handle._engine
    assert engine.restore_activation  # the engine lives
    peak = handle.stats()["peak_activation_device_bytes"]
    one_forward = 4 * 128 * 256 * 4
    assert peak <= one_forward, (peak, one_forward)  # each forward's saved tensors were released


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


def test_the_trace_shows_activation_copies_on_their_own_lanes(offload_sim, tmp_path):
    model = _mlp()
    handle = offload_sim(model, activations="host", trace=True)
    model(torch.randn(128, 256)).square().sum().backward()
    path = tmp_path / "trace.json"
    handle.export_trace(str(path))
    text = path.read_text()
    assert "act d2h" in text and "act h2d" in text
