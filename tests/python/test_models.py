"""Whole models on the sim device, against an unmodified deep copy.

Forward + backward parity (fp32), run in the same mode with the RNG reseeded
before each forward (stochastic depth / dropout draw the same masks):

* no budget: every Linear/Conv is streamed;
* with an explicit budget (it covers every weight on the device: the
  non-layer parameters/buffers, layers the planner keeps resident and the
  streaming slots): budget = fixed resident bytes + k x the largest layer's
  slot, small enough that layers must stream; peak_device_bytes <= budget.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torchvision

from conftest import clone_input, fixed_resident_bytes, slot_bytes, streamable_modules

TOL = dict(rtol=1e-5, atol=1e-5)


def _resnet18():
    return torchvision.models.resnet18(weights=None, num_classes=10), (2, 3, 32, 32)


def _small_vit():
    return torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=10), (2, 3, 32, 32)


def _convnext_tiny():
    return torchvision.models.convnext_tiny(weights=None), (1, 3, 64, 64)


MODELS = [
    # (builder, k): budget = fixed + k * largest slot. The small ViT's layers are
    # tiny next to its patch conv, so it gets the minimum (2 slots).
    pytest.param(_resnet18, 3.0, id="resnet18"),
    pytest.param(_small_vit, 2.0, id="vit-small"),
    pytest.param(_convnext_tiny, 3.0, id="convnext_tiny"),
]


def _budget(model, k):
    largest_slot = max(slot_bytes(m) for _, m in streamable_modules(model))
    return fixed_resident_bytes(model) + int(k * largest_slot)


def _run_parity(model, ref, x_shape, mode):
    x = torch.randn(x_shape, requires_grad=True)
    xr = clone_input(x)
    torch.manual_seed(1)
    y = model(x)
    torch.manual_seed(1)
    yr = ref(xr)
    torch.testing.assert_close(y, yr, **TOL)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, **TOL)
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for n, q in want.items():
        p = got[n]
        assert p.grad is not None, f"{n}: grad missing"
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"{n}: {m}")
    if mode == "train":  # BatchNorm running stats updated the same way
        for (n, b), (_, br) in zip(model.named_buffers(), ref.named_buffers()):
            torch.testing.assert_close(b, br, **TOL, msg=lambda m: f"buffer {n}: {m}")


@pytest.mark.parametrize("build,k", MODELS)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_model_parity_all_streamed(offload_sim, build, k, mode):
    model, x_shape = build()
    getattr(model, mode)()
    ref = copy.deepcopy(model)
    expected_layers = [n for n, _ in streamable_modules(model)]

    handle = offload_sim(model)
    assert handle.layers == expected_layers  # every Linear/Conv streamed
    _run_parity(model, ref, x_shape, mode)

    stats = handle.stats()
    assert stats["layers"] == len(expected_layers)
    assert stats["h2d_bytes"] > 0 and stats["d2h_bytes"] > 0
    assert 0 < stats["peak_device_bytes"] <= stats["slots"] * stats["slot_bytes"]


@pytest.mark.parametrize("build,k", MODELS)
def test_model_parity_with_budget(offload_sim, build, k):
    model, x_shape = build()
    model.train()
    ref = copy.deepcopy(model)
    all_layers = [n for n, _ in streamable_modules(model)]
    budget = _budget(model, k)
    total = fixed_resident_bytes(model) + sum(slot_bytes(m) for _, m in streamable_modules(model))
    assert budget < total  # the model does not fit: layers must stream

    handle = offload_sim(model, budget=budget)
    streamed = handle.layers
    assert streamed, "nothing streamed although the model does not fit the budget"
    stats = handle.stats()
    assert stats["budget_bytes"] == budget
    assert stats["layers"] == len(streamed)
    assert set(streamed) <= set(all_layers)
    assert stats.get("resident_layers", 0) == len(all_layers) - len(streamed)

    _run_parity(model, ref, x_shape, "train")
    stats = handle.stats()
    assert 0 < stats["peak_device_bytes"] <= budget, (stats["peak_device_bytes"], budget)
    assert stats["h2d_bytes"] > 0 and stats["d2h_bytes"] > 0
    streamed_mods = [m for n, m in streamable_modules(model) if n in set(streamed)]
    assert max(slot_bytes(m) for m in streamed_mods) <= stats["slot_bytes"]
    assert stats["peak_device_bytes"] == stats["streamed_device_bytes"] + stats["resident_bytes"]


def test_vit_two_steps_with_sgd(offload_sim):
    """Second step sees the updated host weights (prefetch across the step boundary)."""
    model, x_shape = _small_vit()
    ref = copy.deepcopy(model)
    budget = _budget(model, 2.0)
    handle = offload_sim(model, budget=budget, prefetch=1)
    assert handle.layers  # something streams
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        x = torch.randn(x_shape)
        t = torch.randint(0, 10, (x_shape[0],))
        loss = nn.functional.cross_entropy(model(x), t)
        loss_r = nn.functional.cross_entropy(ref(x), t)
        torch.testing.assert_close(loss, loss_r, **TOL, msg=lambda m: f"step {step}: {m}")
        opt.zero_grad(), opt_r.zero_grad()
        loss.backward(), loss_r.backward()
        opt.step(), opt_r.step()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{n}: {m}")
    assert handle.stats()["peak_device_bytes"] <= budget


@pytest.mark.parametrize("slots,prefetch", [(2, 0), (2, 1), (3, 2), (6, 4)])
def test_slot_and_prefetch_settings_do_not_change_results(offload_sim, slots, prefetch):
    """Tight slot counts (evictions, re-fetch in backward) give identical results."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)])
    ref = copy.deepcopy(model)
    handle = offload_sim(model, slots=slots, prefetch=prefetch)
    x = torch.randn(3, 16, requires_grad=True)
    xr = clone_input(x)
    y, yr = model(x), ref(xr)
    assert torch.equal(y, yr)
    y.sum().backward()
    yr.sum().backward()
    assert torch.equal(x.grad, xr.grad)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    stats = handle.stats()
    assert stats["slots"] == slots
    assert stats["peak_device_bytes"] <= slots * stats["slot_bytes"]
