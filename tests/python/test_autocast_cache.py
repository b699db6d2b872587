"""torch.autocast's cast cache and streamed layers. With the cache on (the default),
autocast casts an fp32 leaf that requires grad (a parameter, an input leaf) once per
autocast region and sums its uses' gradients in the autocast dtype; anything else is cast
at each use, its gradients summed in fp32. Within one call a tensor group's recompute
follows that rule; across calls streamed layers cast per call, as the resident model does
with cache_enabled=False (docs/design/torch-glue.md, "Autocast"). Sim device, CPU autocast,
bit for bit."""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode


class _GLU(nn.Module):
    """A Llama/Mistral MLP: uses its input twice (gate and up projections)."""

    def __init__(self, d=16):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cache", [True, False], ids=["cache-on", "cache-off"])
@pytest.mark.parametrize("given", ["activation", "leaf"])
def test_a_group_using_its_input_twice_trains_under_autocast_exactly(offload_sim, given, cache, dtype):
    """A group whose forward uses its fp32 input twice (a GLU MLP), given an activation or
    an input leaf that requires grad, under autocast with the cast cache on or off:
    outputs, the input's and every weight's gradient equal the resident module's bit for
    bit. Before, the backward's recompute ran on a leaf copy of the input with the cache
    on whatever the forward had: an activation (cast at each use by the resident module,
    gradients summed in fp32) was cast once and its gradients summed in bf16, and a leaf
    under cache_enabled=False likewise; the input's gradient was off by ~3e-6."""
    torch.manual_seed(0)
    model = nn.Sequential(_GLU())
    ref = copy.deepcopy(model)
    offload_sim(model, groups=["0"])
    x0 = torch.randn(8, 16)
    got = []
    for m in (model, ref):
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype, cache_enabled=cache):
            y = m(x * 1.5 if given == "activation" else x)
        y.float().square().mean().backward()
        got.append((y, x.grad, _grads(m)))
    (y, gx, g), (yr, gxr, gr) = got
    assert torch.equal(y, yr)
    assert torch.equal(gx, gxr), f"input gradient off by {(gx - gxr).abs().max().item():.3g}"
    for n in gr:
        assert torch.equal(g[n], gr[n]), n


class _Casts(TorchDispatchMode):
    """Weak references to the dtype casts (aten._to_copy) of tensors of `shape` run while
    the mode is on; `live()`: how many of those casts are still held (by autocast's cache,
    which keeps a cast's Python object with it)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.refs = tuple(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == self.shape:
            self.refs.append(weakref.ref(out))
        return out

    def live(self):
        gc.collect()
        return sum(r() is not None for r in self.refs)


def test_a_group_trained_under_autocast_holds_no_cast_of_its_weights_for_the_region(offload_sim):
    """Inside an autocast region, after a group's training forward, no bf16 copy of its
    weights is left: autocast's cache holds the casts of leaves until the outermost region
    exits, and the forward without a graph cast the fetched weights (leaves that require
    grad) with the cache on, so every streamed group's weights stayed on the device in bf16
    until the region's end (a model's worth for a whole forward). The resident module
    holds its cast there (how the check finds one)."""
    torch.manual_seed(0)
    model = nn.Sequential(_GLU(24), _GLU(24))
    ref = copy.deepcopy(model)
    offload_sim(model, groups=["0", "1"])
    x = torch.randn(4, 24)
    for m, resident in ((ref, True), (model, False)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with _Casts(m[0].gate.weight.shape) as casts:  # gate's and up's weights
                y = m(x)
            y.float().sum().backward()
            del y  # no graph holds a cast now: only the cache can
            assert len(casts.refs) >= 4
            # The resident module's casts stay cached (how the check finds one).
            assert casts.live() == (4 if resident else 0), "resident" if resident else "streamed"
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


class _Twice(nn.Module):
    """Calls one layer twice (shared weights, a looped block)."""

    def __init__(self, layer):
        super().__init__()
        self.inp, self.shared = nn.Linear(16, 16), layer

    def forward(self, x):
        return self.shared(torch.tanh(self.shared(self.inp(x))))


class _TwoHeads(nn.Module):
    """Feeds its input to two layers (q and k projections of an input leaf)."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.q(x) * self.k(x)


@pytest.mark.parametrize("case", ["layer-called-twice", "group-called-twice", "input-leaf-to-two-layers"])
def test_casts_the_cache_shares_across_calls_train_as_the_resident_model_without_the_cache(offload_sim, case):
    """The documented exception (docs/design/torch-glue.md, "Dtype rule"): where torch's
    autocast cache would cast a leaf once for several streamed calls (a streamed layer or
    group called twice in one region, an input leaf fed to two streamed layers), the
    streamed layers cast at each call: their gradients are the resident model's under
    torch.autocast(cache_enabled=False), and with the cache off on both they are equal;
    outputs are equal either way."""
    torch.manual_seed(0)
    if case == "input-leaf-to-two-layers":
        model, groups = _TwoHeads(), None
    else:
        model = _Twice(nn.Linear(16, 16) if case == "layer-called-twice" else _GLU())
        groups = ["shared"] if case == "group-called-twice" else None
    ref = copy.deepcopy(model)
    offload_sim(model, groups=groups)
    x0 = torch.randn(8, 16)

    def run(m, cache):
        m.zero_grad()
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            y = m(x)
        y.float().square().mean().backward()
        return y, x.grad, _grads(m)

    for cache in (True, False):  # the streamed model's setting; the resident model's is off
        (y, gx, g), (yr, gxr, gr) = run(model, cache), run(ref, False)
        assert torch.equal(y, yr)
        assert torch.equal(gx, gxr), f"cache_enabled={cache}: input gradient"
        for n in gr:
            assert torch.equal(g[n], gr[n]), f"cache_enabled={cache}: {n}"
