"""A tensor saved by several ops (docs/design/activations.md, Note [A tensor saved by
several ops] in engine_activations.cpp): the normed input of the q, k and v projections
crosses to the host once and back once, not once per save; gradients stay bit-identical
to the resident model's; a tensor written in place between saves is not shared (autograd's
error, as without offload); the engine holds no device copy once the graph is gone."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from conftest import assert_grads_match

D, BLOCKS, ROWS = 128, 3, 256  # h: 128 KiB, above activation_min_bytes


class Block(nn.Module):
    """Attention-like: q, k and v read one normed input (`apart`: a copy each)."""

    def __init__(self, apart=False):
        super().__init__()
        self.apart = apart
        self.norm = nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        hq, hk, hv = (h.clone(), h.clone(), h.clone()) if self.apart else (h, h, h)
        return x + self.o(self.q(hq) * self.k(hk) + self.v(hv))


def _model(apart=False):
    torch.manual_seed(0)
    return nn.Sequential(*(Block(apart) for _ in range(BLOCKS)))


def _step(model, x, handle=None, retain=False):
    y = model(x)
    if handle is not None:
        handle.synchronize()  # every copy to the host finished: none is handed back from the device
    y.square().sum().backward(retain_graph=retain)
    return y


def test_a_tensor_saved_by_three_projections_crosses_once_each_way(offload_sim):
    shared, ref = _model(), _model()
    handle = offload_sim(shared, activations="host")
    x = torch.randn(ROWS, D)
    for _ in range(2):
        assert torch.equal(_step(shared, x, handle), _step(ref, x))
        assert_grads_match(shared, ref, exact=True)
        shared.zero_grad()
        ref.zero_grad()
    s = handle.stats()
    assert s["activation_h2d_bytes"] == s["activation_d2h_bytes"]  # each back once
    assert s["activation_device_bytes"] == 0  # the shared copies back went with the graph

    apart = _model(apart=True)
    handle_apart = offload_sim(apart, activations="host")
    for _ in range(2):
        _step(apart, x, handle_apart)
    h_bytes = ROWS * D * 4
    # Apart, each of the 3 blocks' clones is its own tensor: two more copies of h each way.
    assert handle_apart.stats()["activation_d2h_bytes"] - s["activation_d2h_bytes"] == 2 * 2 * BLOCKS * h_bytes
    assert handle_apart.stats()["activation_h2d_bytes"] - s["activation_h2d_bytes"] == 2 * 2 * BLOCKS * h_bytes


def test_a_retained_graph_backward_twice_and_a_partial_backward(offload_sim):
    """retain_graph: the second backward copies the shared tensor back again and gives the
    same gradients; torch.autograd.grad of one block's output unpacks only some sharers."""
    shared, ref = _model(), _model()
    handle = offload_sim(shared, activations="host")
    x = torch.randn(ROWS, D)
    y, yr = shared(x), ref(x)
    handle.synchronize()
    kept = handle.stats()["activation_device_bytes"]  # the small saves (LayerNorm's mean and rstd)
    assert kept < 3 * BLOCKS * ROWS * 4
    for _ in range(2):
        y.square().sum().backward(retain_graph=True)
        yr.square().sum().backward(retain_graph=True)
        assert_grads_match(shared, ref, exact=True)
        assert handle.stats()["activation_device_bytes"] == kept  # the graph lives; its copies back went
    del y, yr
    assert handle.stats()["activation_device_bytes"] == 0

    first = shared[0]
    out = first(x)
    handle.synchronize()
    kept = handle.stats()["activation_device_bytes"]
    (g,) = torch.autograd.grad(out.sum(), [first.v.weight])  # q's and k's sharers stay unpacked
    (gr,) = torch.autograd.grad(ref[0](x).sum(), [ref[0].v.weight])
    assert torch.equal(g, gr)
    assert handle.stats()["activation_device_bytes"] == kept  # q's and k's share went at the end of grad()
    del out
    assert handle.stats()["activation_device_bytes"] == 0


def test_a_tensor_written_between_saves_is_not_shared(offload_sim):
    """q saves h, then h is written in place, then k saves it: the two saves hold other
    values, so they are not one entry. q's output kept aside (its graph lives, never
    backpropagated): k's gradient is the resident one, from the written h. Summed: q's
    backward raises autograd's in-place error, as it does without offload."""

    class Written(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(D, D), nn.Linear(D, D)
            self.kept = None

        def forward(self, x):
            h = x * 2
            a = self.q(h)
            h.add_(1)
            self.kept = a  # its graph (and q's save of h) lives on
            return self.k(h)

    torch.manual_seed(0)
    model = Written()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, activations="host")
    x = torch.randn(ROWS, D)
    y, yr = model(x), ref(x)
    handle.synchronize()
    y.square().sum().backward()
    yr.square().sum().backward()
    assert torch.equal(model.k.weight.grad, ref.k.weight.grad)
    for m in (ref, model):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (m(x) + m.kept).sum().backward()
    model.kept = ref.kept = None


def test_a_forward_without_backward_frees_every_entry(offload_sim):
    """The graph freed without a backward drops the sharers in any order: the host copies
    go back to the pool and nothing stays on the device."""
    shared = _model()
    handle = offload_sim(shared, activations="host")
    x = torch.randn(ROWS, D)
    for _ in range(3):
        y = shared(x)
        handle.synchronize()
        del y
    s = handle.stats()
    assert s["activation_device_bytes"] == 0
    # The host pool held one step's copies, reused by the next steps (not three steps' worth).
    once = _model()
    handle_once = offload_sim(once, activations="host")
    y = once(x)
    handle_once.synchronize()
    del y
    assert s["activation_host_bytes"] == handle_once.stats()["activation_host_bytes"]
