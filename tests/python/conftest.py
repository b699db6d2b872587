"""Shared fixtures for the layerstream acceptance tests (simulated device).

Every test that streams a model goes through ``offload_sim``: it calls
``layerstream.offload(model, device="sim", **kw)`` with the ordering checker
on, and at teardown asserts that the checker found no race on any handle the
test created. Handles detached during the test are checked right before
their detach (the checker can no longer be read afterwards).
"""
from __future__ import annotations

import copy

import pytest
import torch

import layerstream

torch.set_num_threads(1)


def _ordering_errors_or_none(handle):
    try:
        return handle.ordering_errors()
    except layerstream.LayerstreamError:  # already detached
        return None


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def offload_sim(request):
    """offload_sim(model, **kw) -> Handle, with the checker asserted clean at teardown."""
    handles = []
    seen_before_detach = []  # (handle, errors read right before detach)

    def _offload(model, **kw):
        kw.setdefault("checker", True)
        assert kw["checker"], "the ordering checker must stay on in the acceptance tests"
        handle = layerstream.offload(model, device="sim", **kw)
        original_detach = handle.detach

        def detach_checked():
            errs = _ordering_errors_or_none(handle)
            if errs is not None:
                seen_before_detach.append((handle, errs))
            return original_detach()

        handle.detach = detach_checked
        handles.append(handle)
        return handle

    yield _offload

    problems = []
    for handle, errs in seen_before_detach:
        if errs:
            problems.append((repr(handle), errs))
    live = []
    for handle in handles:
        errs = _ordering_errors_or_none(handle)
        if errs is not None:
            live.append(handle)
        if errs:
            problems.append((repr(handle), errs))
    # Detach what the test left attached, so every parameter is an ordinary
    # tensor again before the engines are destroyed. (A parameter that
    # outlives its engine currently crashes the interpreter -- see
    # test_training.py::test_parameter_outlives_engine -- and one test's
    # leftovers must not take the rest of the suite down.)
    for handle in live:
        handle.detach()
    assert problems == [], f"ordering checker reported races: {problems}"


def clone_input(x: torch.Tensor) -> torch.Tensor:
    """An independent leaf copy of x with the same requires_grad."""
    return x.detach().clone().requires_grad_(x.requires_grad)


def make_pair(model):
    """(model to stream, unmodified deep copy) -- copies taken before offload."""
    return model, copy.deepcopy(model)


def assert_grads_match(model, ref, *, exact=False, rtol=1e-5, atol=1e-6):
    """Every parameter of `model` has the same grad (or None) as in `ref`."""
    got = dict(model.named_parameters())
    want = dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():
        q = want[name]
        if q.grad is None:
            assert p.grad is None, f"{name}: grad should be None, got a tensor"
            continue
        assert p.grad is not None, f"{name}: grad missing (reference has one)"
        assert p.grad.dtype == q.grad.dtype, (name, p.grad.dtype, q.grad.dtype)
        assert p.grad.shape == q.grad.shape, (name, p.grad.shape, q.grad.shape)
        if exact:
            assert torch.equal(p.grad, q.grad), f"{name}: grad not bit-exact"
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def layer_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))


def streamable_modules(model: torch.nn.Module):
    """(name, module) of the layers offload() streams by default (MHA's out_proj excluded)."""
    kinds = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    skip = torch.nn.modules.linear.NonDynamicallyQuantizableLinear
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, kinds) and not isinstance(m, skip)
            and getattr(m, "padding_mode", "zeros") == "zeros"]


def largest_streamable_bytes(model: torch.nn.Module) -> int:
    return max(layer_bytes(m) for _, m in streamable_modules(model))


def slot_bytes(module: torch.nn.Module) -> int:
    """Bytes of one layer in a device slot: weight and bias each 256-byte aligned."""
    a = lambda n: (n + 255) // 256 * 256  # noqa: E731
    b = 0 if module.bias is None else module.bias.numel() * module.bias.element_size()
    return a(module.weight.numel() * module.weight.element_size()) + a(b)


def fixed_resident_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers of everything that is not a streamable layer
    (they always live on the device, and a budget covers them)."""
    layer_ids = {id(m) for _, m in streamable_modules(model)}
    total = 0
    for m in model.modules():
        if id(m) in layer_ids:
            continue
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None:
                total += t.numel() * t.element_size()
    return total
