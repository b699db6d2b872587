"""Parity of a single streamed Linear / Conv1d/2d/3d against the unmodified layer.

Runs on the device LS_TEST_DEVICE names: "sim" (default; the simulated device
computes with CPU tensors), "cuda" or "cuda:N" (see conftest.py; bench/gpu/run.sh
runs this file with LS_TEST_DEVICE=cuda). Inputs live on the compute device; the
reference is an unmodified deep copy of the module, taken before offload() and
resident on that same device (offload() keeps non-streamed parts there too).
Streamed parameters live on the host, so their grads are on the CPU while the
reference's are on the compute device: comparisons are made on CPU copies.

Outputs and ALL gradients (input, weight, bias) are compared with the reference:

* fp32: torch.testing.assert_close(rtol=1e-5, atol=1e-6); Linear fp32 is
  additionally bit-exact (the streamed path calls the same ATen ops with the
  same operand layouts as the reference's forward and autograd backward: on
  CUDA, TF32 is switched off for this file and both run on the current
  stream, so cuBLAS gets identical calls).
* conv: tolerance only, on every device (cuDNN's backward algorithms may
  accumulate with atomics and are not bit-reproducible run to run).
* bf16 (bf16 weights and activations): bf16 tolerance.
* mixed (fp32 weights, bf16/fp16 activations): the documented dtype rule --
  weights are cast to the activation dtype on the device; weight gradients
  are computed in the activation dtype and cast to the parameter dtype. The
  reference computes with weights cast to the activation dtype and casts
  their grads back.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from conftest import CastCounter, clone_input, gguf_random_blocks, requested_torch_device, write_gguf

# bf16 on CUDA only (not yet checked bit for bit there): on the sim device every bf16
# result below is compared bit for bit (_bf16_exact), because the streamed path runs
# the same CPU ATen ops on the same values as the resident module (contiguous weights
# and inputs; measured bit-identical for every Linear/conv case here).
BF16_TOL = dict(rtol=1.6e-2, atol=1e-2)
FP16_TOL = dict(rtol=1e-3, atol=1e-3)
FP32_TOL = dict(rtol=1e-5, atol=1e-6)


def _fp16_matmul_supported(device: torch.device) -> bool:
    try:
        a = torch.ones(2, 2, dtype=torch.float16, device=device)
        torch.nn.functional.linear(a, a, a).sum().item()
        return True
    except RuntimeError:
        return False


# conftest.py's pytest_configure already rejected a bad or unusable LS_TEST_DEVICE.
_FP16_OK = _fp16_matmul_supported(requested_torch_device())
_FP16_SKIP = pytest.mark.skipif(not _FP16_OK, reason="fp16 linear not supported on this device")


@pytest.fixture(autouse=True)
def _true_fp32(compute_device):
    """On CUDA, fp32 means IEEE fp32: TF32 off for matmuls and cuDNN convs (cuDNN
    allows TF32 by default, which would miss the fp32 tolerances). Restored after."""
    if compute_device.type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---------------------------------------------------------------- helpers
def _randn(shape, dev, dtype=torch.float32):
    """Drawn on the CPU (the same values on every device), then moved."""
    return torch.randn(shape, dtype=torch.float32).to(device=dev, dtype=dtype)


def _equal(a, b) -> bool:
    return torch.equal(a.detach().cpu(), b.detach().cpu())


def _close(a, b, **kw):
    """assert_close on CPU copies (streamed param grads are on the host)."""
    torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), **kw)


def _run(module, x, g):
    y = module(x)
    y.backward(g)
    return y


def _grads(module):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in module.named_parameters()}


def _bf16_exact(dev) -> bool:
    """bf16 results are compared bit for bit on the sim device (the CPU)."""
    return dev.type == "cpu"


def _check_same_module(mod, ref, x_shape, act_dtype, tol, dev, offload, exact=False):
    """mod/ref already have identical parameters (and the same dtype); mod is
    streamed, ref becomes resident on the compute device `dev`."""
    ref.to(dev)
    x = _randn(x_shape, dev, act_dtype).requires_grad_()
    xr = clone_input(x)
    handle = offload(mod)
    assert handle.layers == [""] or len(handle.layers) == 1

    y = mod(x)
    yr = ref(xr)
    assert y.device == yr.device == dev
    assert y.dtype == yr.dtype == act_dtype
    assert y.shape == yr.shape
    g = _randn(y.shape, dev, act_dtype)
    y.backward(g)
    yr.backward(g)

    if exact:
        assert _equal(y, yr), "forward not bit-exact"
        assert _equal(x.grad, xr.grad), "input grad not bit-exact"
    _close(y, yr, **tol)
    _close(x.grad, xr.grad, **tol)
    for (n, p), (_, q) in zip(mod.named_parameters(), ref.named_parameters()):
        assert p.grad is not None, f"{n}.grad missing after backward"
        assert p.grad.dtype == p.dtype == q.grad.dtype
        if exact:
            assert _equal(p.grad, q.grad), f"{n}.grad not bit-exact"
        _close(p.grad, q.grad, **tol, msg=lambda m: f"{n}.grad: {m}")
    stats = handle.stats()
    assert stats["h2d_bytes"] > 0
    assert stats["d2h_bytes"] > 0
    return handle


def _check_mixed(mod, x_shape, act_dtype, functional, tol, dev, offload):
    """fp32 parameters, low-precision activations (documented dtype rule)."""
    ref_w = {n: p.detach().clone().to(device=dev, dtype=act_dtype).requires_grad_()
             for n, p in mod.named_parameters()}
    x = _randn(x_shape, dev, act_dtype).requires_grad_()
    xr = clone_input(x)
    offload(mod)
    y = mod(x)
    yr = functional(xr, ref_w["weight"], ref_w.get("bias"))
    assert y.device == dev
    assert y.dtype == act_dtype, f"output dtype {y.dtype}, expected the activation dtype {act_dtype}"
    g = _randn(y.shape, dev, act_dtype)
    y.backward(g)
    yr.backward(g)
    if _bf16_exact(dev):
        tol = dict(rtol=0, atol=0)  # the same casts and ops as the reference, on the CPU
    _close(y, yr, **tol)
    _close(x.grad, xr.grad, **tol)
    for n, p in mod.named_parameters():
        assert p.dtype == torch.float32
        assert p.grad is not None, f"{n}.grad missing"
        assert p.grad.dtype == torch.float32, f"{n}.grad has dtype {p.grad.dtype}, expected the parameter dtype"
        # grad computed in the activation dtype, then cast: must equal the cast reference
        _close(p.grad, ref_w[n].grad.float(), **tol, msg=lambda m: f"{n}.grad: {m}")


# ---------------------------------------------------------------- Linear
LINEAR_CASES = [
    pytest.param(8, 16, True, (4, 8), id="2d-bias"),
    pytest.param(8, 16, False, (4, 8), id="2d-nobias"),
    pytest.param(12, 5, True, (2, 3, 12), id="3d-bias"),
    pytest.param(12, 5, False, (2, 3, 12), id="3d-nobias"),
    pytest.param(6, 7, True, (2, 2, 3, 6), id="4d-bias"),
    pytest.param(16, 1, True, (5, 16), id="out1"),
    pytest.param(3, 33, True, (1, 3), id="batch1-odd"),
    pytest.param(8, 4, True, (8,), id="1d-input"),
]


@pytest.mark.parametrize("fin,fout,bias,x_shape", LINEAR_CASES)
def test_linear_fp32_bit_exact(offload_dev, compute_device, fin, fout, bias, x_shape):
    mod = nn.Linear(fin, fout, bias=bias)
    ref = copy.deepcopy(mod)
    _check_same_module(mod, ref, x_shape, torch.float32, FP32_TOL, compute_device, offload_dev, exact=True)


@pytest.mark.parametrize("fin,fout,bias,x_shape", LINEAR_CASES)
def test_linear_bf16(offload_dev, compute_device, fin, fout, bias, x_shape):
    mod = nn.Linear(fin, fout, bias=bias).to(torch.bfloat16)
    ref = copy.deepcopy(mod)
    _check_same_module(mod, ref, x_shape, torch.bfloat16, BF16_TOL, compute_device, offload_dev,
                       exact=_bf16_exact(compute_device))


@_FP16_SKIP
@pytest.mark.parametrize("fin,fout,bias,x_shape", LINEAR_CASES[:4])
def test_linear_fp16(offload_dev, compute_device, fin, fout, bias, x_shape):
    mod = nn.Linear(fin, fout, bias=bias).to(torch.float16)
    ref = copy.deepcopy(mod)
    _check_same_module(mod, ref, x_shape, torch.float16, FP16_TOL, compute_device, offload_dev)


@pytest.mark.parametrize("act_dtype", [
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16", marks=_FP16_SKIP),
])
@pytest.mark.parametrize("bias,x_shape", [
    pytest.param(True, (4, 8), id="2d-bias"),
    pytest.param(False, (2, 3, 8), id="3d-nobias"),
])
def test_linear_mixed_fp32_weights(offload_dev, compute_device, act_dtype, bias, x_shape):
    mod = nn.Linear(8, 16, bias=bias)
    tol = BF16_TOL if act_dtype == torch.bfloat16 else FP16_TOL
    _check_mixed(mod, x_shape, act_dtype, torch.nn.functional.linear, tol, compute_device, offload_dev)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_linear_bf16_weights_fp32_activations(offload_dev, compute_device, bias):
    """Weights cast up to the activation dtype; weight grads cast back to bf16."""
    dev = compute_device
    mod = nn.Linear(8, 16, bias=bias).to(torch.bfloat16)
    ref_w = {n: p.detach().to(device=dev, dtype=torch.float32).requires_grad_()
             for n, p in mod.named_parameters()}
    x = _randn((4, 8), dev).requires_grad_()
    xr = clone_input(x)
    offload_dev(mod)
    y = mod(x)
    yr = torch.nn.functional.linear(xr, ref_w["weight"], ref_w.get("bias"))
    assert y.device == dev
    assert y.dtype == torch.float32
    g = _randn(y.shape, dev)
    y.backward(g)
    yr.backward(g)
    _close(y, yr, **FP32_TOL)
    _close(x.grad, xr.grad, **FP32_TOL)
    for n, p in mod.named_parameters():
        assert p.grad.dtype == torch.bfloat16, f"{n}.grad dtype {p.grad.dtype}"
        # fp32 gradient rounded once to bf16, as the reference's: bit for bit on the CPU
        _close(p.grad, ref_w[n].grad.to(torch.bfloat16),
               **(dict(rtol=0, atol=0) if _bf16_exact(dev) else BF16_TOL))


def test_linear_no_input_grad(offload_dev, compute_device):
    """Input without requires_grad: weight/bias grads still complete (fp32: bit-exact)."""
    mod = nn.Linear(8, 4)
    ref = copy.deepcopy(mod).to(compute_device)
    offload_dev(mod)
    x = _randn((3, 8), compute_device)
    mod(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert _equal(mod.weight.grad, ref.weight.grad)
    assert _equal(mod.bias.grad, ref.bias.grad)


def test_linear_frozen_params_input_grad_only(offload_dev, compute_device):
    mod = nn.Linear(8, 4)
    mod.requires_grad_(False)
    ref = copy.deepcopy(mod).to(compute_device)
    offload_dev(mod)
    x = _randn((3, 8), compute_device).requires_grad_()
    xr = clone_input(x)
    mod(x).square().sum().backward()
    ref(xr).square().sum().backward()
    assert _equal(x.grad, xr.grad)
    assert mod.weight.grad is None and mod.bias.grad is None


def _same_or_close(exact: bool):
    """same(a, b, what): bit for bit when exact (the sim device), else within what an
    optimizer step on the host against one on the GPU allows."""
    def same(a, b, what):
        if exact:
            assert _equal(a, b), what
        else:
            _close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")
    return same


def _sgd_step_both(model, ref, opts, dev, same, label):
    """One SGD step of the streamed model and its resident reference on the same
    input: outputs, input gradients and every parameter's gradient compared."""
    x = _randn((5, 32), dev).requires_grad_()
    xr = clone_input(x)
    for opt in opts:
        opt.zero_grad()
    y, yr = model(x), ref(xr)
    same(y, yr, f"{label}: output")
    y.square().sum().backward()
    yr.square().sum().backward()
    same(x.grad, xr.grad, f"{label}: input grad")
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        same(p.grad, q.grad, f"{label}: {n}.grad")
    for opt in opts:
        opt.step()


def test_resident_and_streamed_layers_in_one_model(offload_dev, compute_device):
    """A budget that holds two slots and two layers: the planner keeps two of the six
    Linear layers resident (the user's own modules on the compute device) and streams the
    other four through the slots, in one model. Three SGD steps: outputs, the input
    gradient, every weight gradient and the updated weights equal the resident model's
    bit for bit on the sim device (fp32 Linear, as test_linear_fp32_bit_exact); on CUDA
    within the fp32 tolerance (the optimizer updates the streamed weights on the host
    and the reference's on the GPU, whose kernels may fuse the multiply-add)."""
    from conftest import slot_bytes

    torch.manual_seed(0)
    dev = compute_device
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(32, 32), nn.Tanh())])
    ref = copy.deepcopy(model).to(dev)
    layer = 32 * 32 * 4 + 32 * 4
    handle = offload_dev(model, budget=2 * slot_bytes(model[0]) + 2 * layer, prefetch=1)
    stats = handle.stats()
    assert stats["resident_layers"] == 2 and len(handle.layers) == 4, (handle.layers, stats)
    streamed = set(handle.layers)
    resident = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in streamed]
    assert len(resident) == 2
    for n in resident:
        assert model.get_submodule(n).weight.device == dev  # resident: the user's module, moved
    same = _same_or_close(dev.type == "cpu")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for step in range(3):
        _sgd_step_both(model, ref, opts, dev, same, f"step {step}")
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        same(p, q, n)
    assert handle.stats()["h2d_bytes"] >= 3 * 4 * layer  # the streamed four crossed every step


class _OutOfOrder(nn.Module):
    """Linear layers called in another order than they are registered (so the
    fetch order is not the index order a first step guesses), and a BatchNorm
    (parameters and buffers that stay on the compute device)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(32, 32) for _ in range(4))
        self.norm = nn.BatchNorm1d(32)

    def forward(self, x):
        h = torch.tanh(self.c(x))
        h = self.norm(torch.tanh(self.a(h)))
        return self.b(torch.tanh(self.d(h)))


def test_parity_suspend_frees_the_device_and_resume_continues_exactly(offload_dev, compute_device):
    """handle.suspend() (on CUDA: model.to("cpu")) between training steps frees the
    streaming slots and moves
    what lives on the compute device (the layer the budget kept resident, the
    BatchNorm's parameters and running statistics, their gradients and a
    layerstream optimizer's states) to host memory; calls are refused until handle.resume() (model.to(<compute device>)),
    which puts everything back.
    The steps after it equal the resident model's (bit for bit on the sim device)
    and the first one prefetches by the fetch order learnt before (as many hits
    as the step before suspend())."""
    import layerstream.optim
    from conftest import slot_bytes
    from layerstream import LayerstreamError

    torch.manual_seed(0)
    dev = compute_device
    model = _OutOfOrder()
    ref = copy.deepcopy(model).to(dev)
    layer = 32 * 32 * 4 + 32 * 4
    norm = 4 * 32 * 4 + 8  # weight, bias, running mean and variance, the batch count
    handle = offload_dev(model, budget=2 * slot_bytes(model.a) + layer + norm, prefetch=1)
    assert handle.stats()["resident_layers"] == 1 and len(handle.layers) == 3, handle.stats()
    [resident] = [n for n in "abcd" if n not in handle.layers]
    same = _same_or_close(dev.type == "cpu")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]

    def step(i):
        hits = handle.stats()["hits"]
        _sgd_step_both(model, ref, opts, dev, same, f"step {i}")
        return handle.stats()["hits"] - hits

    hits = [step(0), step(1)]
    # A layerstream optimizer's states follow their parameter (lr 0: the parity stands).
    follower = layerstream.optim.AdamW([model.norm.weight], lr=0.0, weight_decay=0.0)
    with pytest.warns(RuntimeWarning, match="beyond the budget"):  # offload() had no train=
        follower.step()
    exp_avg = lambda: follower.state[model.norm.weight]["exp_avg"]  # noqa: E731
    tensors = lambda: {**dict(model.named_parameters()), **dict(model.named_buffers())}  # noqa: E731
    on_device = {n for n, t in tensors().items() if t.device == dev}
    assert {f"{resident}.weight", "norm.weight", "norm.running_mean"} <= on_device
    slots = handle.stats()["device_bytes"]
    assert slots >= 2 * layer
    allocated = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0

    if dev.type == "cuda":  # as accelerate's and diffusers' CPU offload hooks do
        assert model.to("cpu") is model
    else:  # the sim device computes on the host: to("cpu") is no move there
        handle.suspend()
    assert handle.suspended and handle.stats()["device_bytes"] == 0
    for n, t in tensors().items():
        assert t.device.type == "cpu", n
    assert model.norm.weight.grad.device.type == "cpu" and exp_avg().device.type == "cpu"
    if dev.type == "cuda":  # torch's allocator: the resident layer (with its gradient) and the norm left
        assert allocated - torch.cuda.memory_allocated(dev) >= 2 * layer  # (the slots are the engine's own)
    x = _randn((5, 32), dev)
    with pytest.raises(LayerstreamError, match=r"suspended.*handle\.resume\(\)"):
        model(x)
    with pytest.raises(LayerstreamError, match=r"suspended.*handle\.resume\(\)"):
        getattr(model, handle.layers[0])(x)  # a streamed layer called alone
    handle.suspend()  # already suspended: nothing to do

    if dev.type == "cuda":
        assert model.to(dev) is model
    else:
        handle.resume()
    assert not handle.suspended and handle.stats()["device_bytes"] == slots
    assert {n for n, t in tensors().items() if t.device == dev} == on_device
    assert model.norm.weight.grad.device == dev and exp_avg().device == dev
    follower.step()
    hits.append(step(2))
    step(3)
    assert hits[2] == hits[1], hits  # the first step after resume() prefetched as before
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        same(p, q, n)
    for (n, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        same(b, c, n)


# ---------------------------------------------------------------- Conv
def _conv_param(dims, cin, cout, k, x_hw, ident, **kw):
    return pytest.param(dims, cin, cout, k, x_hw, kw, id=ident)


CONV_CASES = [
    # Conv1d
    _conv_param(1, 3, 4, 3, (9,), "1d-basic"),
    _conv_param(1, 3, 4, 3, (9,), "1d-nobias", bias=False),
    _conv_param(1, 4, 6, 3, (11,), "1d-stride2-pad1", stride=2, padding=1),
    _conv_param(1, 3, 4, 4, (10,), "1d-same-evenk", padding="same"),
    _conv_param(1, 3, 4, 3, (10,), "1d-same-dil2", padding="same", dilation=2),
    _conv_param(1, 3, 4, 3, (10,), "1d-valid", padding="valid"),
    _conv_param(1, 4, 8, 3, (10,), "1d-groups2", groups=2, padding=1),
    _conv_param(1, 4, 4, 3, (10,), "1d-depthwise", groups=4, bias=False),
    # Conv2d
    _conv_param(2, 3, 4, 3, (7, 8), "2d-basic"),
    _conv_param(2, 3, 4, 3, (7, 8), "2d-nobias", bias=False),
    _conv_param(2, 3, 5, 3, (9, 9), "2d-stride2-pad1", stride=2, padding=1),
    _conv_param(2, 3, 4, (3, 2), (7, 8), "2d-rectk-stride12-pad10", stride=(1, 2), padding=(1, 0)),
    _conv_param(2, 3, 4, 3, (8, 8), "2d-same", padding="same"),
    _conv_param(2, 3, 4, (2, 4), (8, 7), "2d-same-evenk", padding="same"),
    _conv_param(2, 3, 4, 3, (8, 8), "2d-same-dil2-nobias", padding="same", dilation=2, bias=False),
    _conv_param(2, 3, 4, 3, (8, 8), "2d-valid", padding="valid"),
    _conv_param(2, 3, 4, 3, (10, 10), "2d-dil2-pad2", dilation=2, padding=2),
    _conv_param(2, 4, 6, 3, (7, 7), "2d-groups2", groups=2, padding=1),
    _conv_param(2, 6, 6, 3, (7, 7), "2d-depthwise-stride2", groups=6, stride=2, padding=1),
    _conv_param(2, 4, 8, 1, (5, 5), "2d-1x1"),
    # Conv3d
    _conv_param(3, 2, 3, 3, (5, 5, 5), "3d-basic"),
    _conv_param(3, 2, 3, 3, (5, 5, 5), "3d-nobias", bias=False),
    _conv_param(3, 2, 4, 3, (6, 5, 5), "3d-stride2-pad1", stride=2, padding=1),
    _conv_param(3, 2, 3, 3, (5, 6, 5), "3d-same", padding="same"),
    _conv_param(3, 2, 3, 2, (5, 5, 5), "3d-valid-dil2", padding="valid", dilation=2),
    _conv_param(3, 4, 4, 3, (5, 5, 5), "3d-groups2", groups=2, padding=(1, 0, 1)),
]

_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONV_F = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}


def _make_conv(dims, cin, cout, k, kw):
    return _CONV[dims](cin, cout, k, **kw)


@pytest.mark.parametrize("dims,cin,cout,k,x_hw,kw", CONV_CASES)
def test_conv_fp32(offload_dev, compute_device, dims, cin, cout, k, x_hw, kw):
    mod = _make_conv(dims, cin, cout, k, kw)
    ref = copy.deepcopy(mod)
    _check_same_module(mod, ref, (2, cin, *x_hw), torch.float32, dict(rtol=1e-5, atol=1e-6),
                       compute_device, offload_dev)


@pytest.mark.parametrize("dims,cin,cout,k,x_hw,kw", CONV_CASES)
def test_conv_bf16(offload_dev, compute_device, dims, cin, cout, k, x_hw, kw):
    mod = _make_conv(dims, cin, cout, k, kw).to(torch.bfloat16)
    ref = copy.deepcopy(mod)
    _check_same_module(mod, ref, (2, cin, *x_hw), torch.bfloat16, BF16_TOL, compute_device, offload_dev,
                       exact=_bf16_exact(compute_device))


@pytest.mark.parametrize("dims,cin,cout,k,x_hw,kw", [
    c for c in CONV_CASES if c.id in ("1d-stride2-pad1", "2d-same", "2d-groups2", "2d-nobias", "3d-basic")
])
def test_conv_mixed_fp32_weights_bf16_activations(offload_dev, compute_device, dims, cin, cout, k, x_hw, kw):
    mod = _make_conv(dims, cin, cout, k, kw)
    args = dict(stride=mod.stride, padding=mod.padding, dilation=mod.dilation, groups=mod.groups)
    functional = lambda x, w, b: _CONV_F[dims](x, w, b, **args)  # noqa: E731
    _check_mixed(mod, (2, cin, *x_hw), torch.bfloat16, functional, BF16_TOL, compute_device, offload_dev)


def test_conv_unbatched_input(offload_dev, compute_device):
    """nn.Conv2d accepts (C, H, W) inputs; the streamed layer must too."""
    mod = nn.Conv2d(3, 4, 3, padding=1)
    ref = copy.deepcopy(mod)
    _check_same_module(mod, ref, (3, 6, 6), torch.float32, FP32_TOL, compute_device, offload_dev)


@pytest.mark.parametrize("make,x_shape", [
    (lambda: nn.Conv2d(8, 16, 3, padding=1, padding_mode="reflect"), (2, 8, 13, 11)),
    (lambda: nn.Conv2d(8, 16, 3, padding=(2, 1), stride=2, padding_mode="replicate"), (2, 8, 13, 11)),
    (lambda: nn.Conv2d(8, 16, 3, padding=1, padding_mode="circular"), (2, 8, 13, 11)),
    (lambda: nn.Conv2d(8, 16, (3, 5), padding="same", padding_mode="reflect"), (2, 8, 13, 11)),
    (lambda: nn.Conv1d(8, 4, 3, padding=1, padding_mode="reflect"), (2, 8, 17)),
    (lambda: nn.Conv3d(4, 6, 3, padding=(0, 1, 1), padding_mode="replicate"), (1, 4, 5, 6, 7)),
    (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (3, 6, 6)),  # unbatched
], ids=["reflect", "replicate-uneven-stride2", "circular", "reflect-same-3x5", "1d-reflect", "3d-replicate",
        "unbatched-reflect"])
def test_conv_padding_modes_stream_padding_the_input_as_torch_does(make, x_shape, offload_dev, compute_device):
    """A padding_mode other than 'zeros' streams: the input is padded (F.pad, the
    module's own pads) and the streamed convolution has no padding, as torch's
    _conv_forward computes it (such layers used to stay resident)."""
    torch.manual_seed(0)
    mod = make()
    ref = copy.deepcopy(mod)
    _check_same_module(mod, ref, x_shape, torch.float32, FP32_TOL, compute_device, offload_dev,
                       exact=compute_device.type == "cpu")


# ---------------------------------------------------------------- repeated use
def test_same_layer_called_twice_per_step(offload_dev, compute_device):
    """A streamed layer used twice in one forward (weight sharing) accumulates both grads."""
    lin = nn.Linear(6, 6)
    ref = copy.deepcopy(lin).to(compute_device)
    offload_dev(lin)
    x = _randn((4, 6), compute_device).requires_grad_()
    xr = clone_input(x)
    lin(torch.tanh(lin(x))).sum().backward()
    ref(torch.tanh(ref(xr))).sum().backward()
    _close(x.grad, xr.grad, **FP32_TOL)
    _close(lin.weight.grad, ref.weight.grad, **FP32_TOL)
    _close(lin.bias.grad, ref.bias.grad, **FP32_TOL)


def test_repeated_steps_accumulate_into_existing_grad(offload_dev, compute_device):
    """Without zero_grad, grads of 3 steps add up into param.grad (like the reference)."""
    mod = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 3))
    ref = copy.deepcopy(mod).to(compute_device)
    offload_dev(mod)
    for _ in range(3):
        x = _randn((4, 5), compute_device)
        mod(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
    for (n, p), (_, q) in zip(mod.named_parameters(), ref.named_parameters()):
        _close(p.grad, q.grad, **FP32_TOL, msg=lambda m: f"{n}: {m}")


def test_model_to_compute_device_after_offload_is_a_no_op_for_streamed_layers(offload_dev, compute_device):
    """model.to(device) / .cuda() after offload() (HF Trainer, accelerate's prepare() and
    pipelines do it): streamed weights stay in host memory, the rest is converted as
    usual, results unchanged. Before, it moved the streamed weights and the next call
    failed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    ref = copy.deepcopy(model).to(compute_device)
    handle = offload_dev(model)
    host = [p.data_ptr() for n, p in model.named_parameters() if not n.startswith("1.")]
    model.to(compute_device)
    model.to(torch.float32)
    if compute_device.type == "cuda":
        model.cuda(compute_device)
    assert [p.data_ptr() for n, p in model.named_parameters() if not n.startswith("1.")] == host
    assert model[1].weight.device == compute_device
    x = _randn((4, 6), compute_device)
    _close(model(x), ref(x), **FP32_TOL)
    assert handle.layers == ["0", "2"]


class _TiedLM(nn.Module):
    """Embedding whose weight is also the output projection's (as in GPT-2, Gemma)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 12)
        self.fc = nn.Linear(12, 12)
        self.head = nn.Linear(12, 40, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.fc(self.emb(ids))))


class _ScaledEmbedding(nn.Embedding):
    """Like transformers' *ScaledWordEmbedding (Gemma): a lookup through super().forward."""

    def forward(self, ids):
        return super().forward(ids) * 2.5


@pytest.mark.parametrize("resident_table,scaled", [(False, False), (False, True), (True, False)],
                         ids=["streamed", "streamed-scaled", "table-resident"])
def test_tied_weights(offload_dev, compute_device, resident_table, scaled):
    """A weight shared by a table and a Linear (an lm_head tied to the embedding)
    streams for both from one host copy, its gradient summed over both uses through
    autograd. When the table stays resident (exclude=), the head stays resident too,
    with a warning naming both (streaming it would move the table's weight to the
    host). Outputs and grads match the reference, accumulated over 3 backwards."""
    torch.manual_seed(0)
    model = _TiedLM()
    if scaled:  # the table is a subclass that looks up through super().forward
        model.emb = _ScaledEmbedding(40, 12)
        model.head.weight = model.emb.weight
    ref = copy.deepcopy(model).to(compute_device)
    if resident_table:
        with pytest.warns(RuntimeWarning, match=r"'head' \(weight shared with 'emb.weight'\)"):
            handle = offload_dev(model, exclude=["emb"])
        assert handle.layers == ["fc"]
        assert model.emb.weight.device == compute_device
    else:
        handle = offload_dev(model)
        assert handle.layers == ["emb", "fc", "head"]
        assert model.emb.weight.device.type == "cpu"
        assert handle.stats()["pinned_bytes"] == (40 * 12 + 12 * 12 + 12) * 4  # the table once
    assert model.head.weight is model.emb.weight
    ids = torch.randint(0, 40, (3, 5), device=compute_device)
    for _ in range(3):  # no zero_grad: the grads accumulate
        out, want = model(ids), ref(ids)
        _close(out, want, **FP32_TOL)
        out.square().mean().backward()
        want.square().mean().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        _close(p.grad.to(compute_device), q.grad, **FP32_TOL, msg=lambda m: f"{n}: {m}")
    handle.detach()
    # detach() puts the weights back where they were before offload(): the host for the
    # streamed table (the model was built there), the compute device for the table that
    # offload() kept resident. Still one tensor, with the values it started with.
    home = compute_device if resident_table else torch.device("cpu")
    assert model.head.weight is model.emb.weight and model.emb.weight.device == home
    assert torch.equal(model.emb.weight.detach().cpu(), ref.emb.weight.detach().cpu())


class _StridedWeights(nn.Module):
    """A channels_last conv stack (as diffusion UNets are often run) and a Linear whose
    weight is a transposed view: weights whose memory layout is not the contiguous one."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 5)
        self.fc.weight = nn.Parameter(torch.randn(4 * 6 * 6, 5).t())

    def forward(self, x):
        return self.fc(torch.flatten(self.c2(torch.relu(self.c1(x))), 1))


def _strided_model(compute_device):
    torch.manual_seed(0)
    return _StridedWeights().to(memory_format=torch.channels_last)


def test_weight_memory_layout_is_kept(offload_dev, compute_device):
    """Streamed weights keep their memory layout (channels_last conv weights, a transposed
    Linear weight) in the host store, the slot and on the device. Before, they were made
    contiguous: the convs then ran another algorithm than the resident model (1e-6 off in
    the output, 3e-5 in the grads on the sim device), .grad came back contiguous, and
    detach() returned contiguous weights. Now the numbers are those of the resident model
    (bit for bit on the sim device), .grad has the parameter's layout, as autograd lays it
    out, and detach() restores the original strides."""
    model = _strided_model(compute_device)
    ref = copy.deepcopy(model).to(compute_device)
    strides = {n: p.stride() for n, p in model.named_parameters()}
    assert strides["c1.weight"] != model.c1.weight.contiguous().stride()
    assert strides["fc.weight"] == (1, 5)
    handle = offload_dev(model)
    assert handle.layers == ["c1", "c2", "fc"]
    assert {n: p.stride() for n, p in model.named_parameters()} == strides
    exact = compute_device.type == "cpu"
    for _ in range(2):
        x = _randn((2, 3, 6, 6), compute_device).to(memory_format=torch.channels_last)
        y, yr = model(x), ref(x)
        y.square().sum().backward()
        yr.square().sum().backward()
        if exact:
            assert _equal(y, yr)
        _close(y, yr, **FP32_TOL)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad.stride() == q.grad.stride() == strides[n], n
        if exact:
            assert _equal(p.grad, q.grad), n
        _close(p.grad, q.grad, **FP32_TOL, msg=lambda m: f"{n}: {m}")
    handle.detach()
    assert {n: p.stride() for n, p in model.named_parameters()} == strides


def test_a_channels_last_1x1_conv_keeps_its_strides(offload_dev, compute_device):
    """A channels_last 1x1 conv weight [o, i, 1, 1] has strides (i, 1, i, i): contiguous
    as far as is_contiguous() goes (size-1 dims do not count), but the conv picks its
    memory format from those strides (its output is channels_last). The host store used
    to make them (i, 1, 1, 1): the streamed conv computed in the contiguous format, to
    other numbers than the resident model's (2e-7 off in a diffusers UNet's proj_out) and
    in another output layout. The strides now stay: in the store, the slot, and after
    detach(), also of a weight offload() quantized."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 1), nn.ReLU(), nn.Conv2d(16, 4, 1)).to(memory_format=torch.channels_last)
    quantized = copy.deepcopy(model)
    ref = copy.deepcopy(model).to(compute_device)
    strides = [p.stride() for p in model.parameters()]
    assert strides[0] == (8, 1, 8, 8)
    handle = offload_dev(model)
    assert [p.stride() for p in model.parameters()] == strides
    exact = compute_device.type == "cpu"
    x = _randn((2, 8, 5, 5), compute_device)  # contiguous: the weights decide the format
    y, yr = model(x), ref(x)
    assert y.stride() == yr.stride() != y.contiguous().stride()
    y.square().sum().backward()
    yr.square().sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if exact:
            assert _equal(p.grad, q.grad), n
        _close(p.grad, q.grad, **FP32_TOL, msg=lambda m: f"{n}: {m}")
    if exact:
        assert _equal(y, yr)
    handle.detach()
    assert [p.stride() for p in model.parameters()] == strides
    offload_dev(quantized.requires_grad_(False), quantize="int8").detach()
    assert [p.stride() for p in quantized.parameters()] == strides


def test_lossless_conv_weights_keep_their_layout(offload_dev, compute_device):
    """quantize="lossless" codes a weight in its own memory order and decodes it into the
    slot with its strides: a channels_last conv net computes as the resident model (bit
    for bit on the sim device). The row-major coding made the convs compute in the
    contiguous format (a bf16 diffusers UNet: 4e-6 off at its first coded conv).
    detach() gives the weights back bit for bit, in their strides."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 4, 1))
    model = model.to(memory_format=torch.channels_last).requires_grad_(False)
    ref = copy.deepcopy(model).to(compute_device)
    strides = [p.stride() for p in model.parameters()]
    handle = offload_dev(model, quantize="lossless")
    assert handle.stats()["quantized_layers"] == 2
    x = _randn((2, 8, 6, 6), compute_device)
    y, yr = model(x), ref(x)
    assert y.stride() == yr.stride() != y.contiguous().stride()
    if compute_device.type == "cpu":
        assert _equal(y, yr)
    _close(y, yr, **FP32_TOL)
    handle.detach()
    assert [p.stride() for p in model.parameters()] == strides
    for p, q in zip(model.parameters(), ref.parameters()):
        assert _equal(p, q.cpu())


@pytest.mark.parametrize("case", ["channels-last-input", "channels-last-weight", "lora-conv"])
def test_a_conv_whose_input_and_weight_layouts_differ_trains_exactly(offload_dev, compute_device, case):
    """A conv whose input needs no gradient, its weight one, and whose input and weight
    are laid out differently (a channels_last input into a contiguous weight, the reverse;
    peft's lora_A conv added to a channels_last model): ATen's backward makes the weight
    contiguous in the input's memory format, a read of the weight although only its
    gradient is computed. It used to read the parked (null) storage: a segmentation
    fault. Gradients equal the resident model's (bit for bit on the sim device)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3))
    x = _randn((2, 8, 10, 10), compute_device)
    if case == "channels-last-weight":
        model = model.to(memory_format=torch.channels_last)
    else:
        x = x.to(memory_format=torch.channels_last)
    if case == "lora-conv":
        peft = pytest.importorskip("peft")
        model = model.to(memory_format=torch.channels_last)
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["0", "2"],
                                                           init_lora_weights="gaussian"))
    ref = copy.deepcopy(model).to(compute_device)
    handle = offload_dev(model)
    assert any("lora_A" in n for n in handle.layers) == (case == "lora-conv")
    exact = compute_device.type == "cpu"
    for _ in range(2):
        y, yr = model(x), ref(x)
        y.square().sum().backward()
        yr.square().sum().backward()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained
    for n in trained:
        g, gr = dict(model.named_parameters())[n].grad, dict(ref.named_parameters())[n].grad
        if exact:
            assert _equal(g, gr), n
        _close(g, gr, **FP32_TOL, msg=lambda m: f"{n}: {m}")


def test_adapters_added_after_offload_follow_to_the_compute_device(offload_dev, compute_device):
    """peft's get_peft_model() after offload() creates each adapter beside its base weight,
    in host memory for a streamed layer; the next call moves them to the compute device (no
    model.to() needed; under inference_mode too, as tensors a later step can train), and a
    step trains them as on the resident model."""
    peft = pytest.importorskip("peft")
    dev = compute_device
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8), nn.LayerNorm(8)).to(dev)
    ref = copy.deepcopy(model)
    offload_dev(model)
    config = peft.LoraConfig(r=2, target_modules=["0", "2"], init_lora_weights="gaussian")
    torch.manual_seed(1)
    model = peft.get_peft_model(model, config)
    torch.manual_seed(1)
    ref = peft.get_peft_model(ref, copy.deepcopy(config))
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert adapters and all(p.device.type == "cpu" for p in adapters.values())  # where peft made them
    x = _randn((4, 16), dev)
    with torch.inference_mode():  # the first call moves them: not as inference tensors
        model(x)
    assert all(p.device == dev and not p.is_inference() for p in adapters.values())
    y, yr = model(x), ref(x)
    y.square().sum().backward()
    yr.square().sum().backward()
    same = _equal if dev.type == "cpu" else (lambda u, v: _close(u, v, **FP32_TOL) or True)
    assert same(y, yr)
    for n, p in adapters.items():
        assert p.grad is not None and p.grad.device == dev and same(p.grad, dict(ref.named_parameters())[n].grad), n


@pytest.mark.parametrize("act_dtype", [
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16", marks=_FP16_SKIP),
])
def test_weight_memory_layout_is_kept_by_the_compute_dtype_cast(offload_dev, compute_device, act_dtype):
    """compute_dtype casts a strided weight element by element into its slot, so the cast
    copy keeps the layout: the same numbers as the cast at use, bit for bit."""
    a = _strided_model(compute_device)
    b = copy.deepcopy(a)
    offload_dev(a)
    offload_dev(b, compute_dtype=act_dtype)
    x = _randn((2, 3, 6, 6), compute_device, act_dtype).to(memory_format=torch.channels_last)
    ya, yb = a(x), b(x)
    assert ya.dtype == yb.dtype == act_dtype
    assert _equal(ya, yb)
    ya.float().square().sum().backward()
    yb.float().square().sum().backward()
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert _equal(p.grad, q.grad), n


# ---------------------------------------------------------------- compute_dtype
# offload(compute_dtype=...) casts a streamed weight (and bias) of another
# dtype into its slot right after the copy, instead of at every use. The
# numbers must be those of the cast at use, bit for bit, on every device.
def _mixed_pair(make, act_dtype, dev, offload, **kw):
    """Two identical fp32 modules streamed without / with compute_dtype=act_dtype."""
    torch.manual_seed(0)
    a = make()
    b = copy.deepcopy(a)
    ha = offload(a, **kw)
    hb = offload(b, compute_dtype=act_dtype, **kw)
    return a, b, ha, hb


@pytest.mark.parametrize("act_dtype", [
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16", marks=_FP16_SKIP),
])
@pytest.mark.parametrize("kind", ["linear-bias", "linear-nobias", "conv2d"])
def test_compute_dtype_same_numbers_as_cast_at_use(offload_dev, compute_device, act_dtype, kind):
    dev = compute_device
    if kind == "conv2d":
        make = lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, 4, 3))  # noqa: E731
        x_shape = (2, 3, 9, 9)
    else:
        bias = kind == "linear-bias"
        make = lambda: nn.Sequential(nn.Linear(24, 40, bias=bias), nn.GELU(), nn.Linear(40, 8, bias=bias))  # noqa: E731
        x_shape = (5, 24)
    a, b, ha, hb = _mixed_pair(make, act_dtype, dev, offload_dev)
    x = _randn(x_shape, dev, act_dtype).requires_grad_()
    xb = clone_input(x)
    shapes = [p.shape for p in a.parameters()]
    with CastCounter(shapes) as ca:
        y = a(x)
    with CastCounter(shapes) as cb:
        yb = b(xb)
    assert ca.casts >= len(shapes), "without compute_dtype every weight and bias is cast at use"
    assert cb.casts == 0, "with compute_dtype nothing is cast at use"
    g = _randn(y.shape, dev, act_dtype)
    y.backward(g)
    yb.backward(g)
    assert y.dtype == yb.dtype == act_dtype
    # Bit for bit, except cuDNN convs (tolerance only, as in the conv tests above).
    tol = BF16_TOL if act_dtype == torch.bfloat16 else FP16_TOL
    same = _equal if kind != "conv2d" or dev.type != "cuda" else (
        lambda u, v: _close(u, v, **tol) or True)
    assert same(y, yb), "forward differs from the cast at use"
    assert same(x.grad, xb.grad), "input grad differs from the cast at use"
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert p.dtype == q.dtype == torch.float32
        assert q.grad.dtype == torch.float32
        assert same(p.grad, q.grad), f"{n}.grad differs"
    # The slot holds the copied fp32 weight and bias and their cast copies.
    elem = torch.finfo(act_dtype).bits // 8

    def slot(m):
        w = _align(m.weight.numel() * 4) + (0 if m.bias is None else _align(m.bias.numel() * 4))
        cast = _align(m.weight.numel() * elem) + (0 if m.bias is None else m.bias.numel() * elem)
        return w, w + _align(cast)
    big = max((slot(m) for m in a if hasattr(m, "weight")), key=lambda t: t[1])
    assert ha.stats()["slot_bytes"] == max(slot(m)[0] for m in a if hasattr(m, "weight"))
    assert hb.stats()["slot_bytes"] == big[1]


def _align(n):
    return (n + 255) // 256 * 256


def test_compute_dtype_other_activation_dtype_uses_the_weight_as_is(offload_dev, compute_device):
    """compute_dtype=bf16, fp32 activations: the fp32 weight in the slot is used,
    bit-exact with the resident fp32 layer (never the bf16-rounded copy)."""
    dev = compute_device
    torch.manual_seed(0)
    mod = nn.Linear(16, 12)
    ref = copy.deepcopy(mod).to(dev)
    offload_dev(mod, compute_dtype=torch.bfloat16)
    x = _randn((4, 16), dev).requires_grad_()
    xr = clone_input(x)
    y, yr = mod(x), ref(xr)
    assert y.dtype == torch.float32
    assert _equal(y, yr)
    y.sum().backward()
    yr.sum().backward()
    assert _equal(x.grad, xr.grad)
    assert _equal(mod.weight.grad, ref.weight.grad) and _equal(mod.bias.grad, ref.bias.grad)


@pytest.mark.parametrize("cache", [False, True], ids=["per-step", "cache_across_steps"])
def test_compute_dtype_recasts_after_optimizer_steps(offload_dev, compute_device, cache):
    """Trainable fp32 weights, bf16 activations, SGD in place between steps: every
    step uses the cast of the updated weights (no stale cast copy), with the same
    numbers as the cast at use."""
    dev = compute_device
    make = lambda: nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))  # noqa: E731
    a, b, _, _ = _mixed_pair(make, torch.bfloat16, dev, offload_dev, cache_across_steps=cache)
    oa = torch.optim.SGD(a.parameters(), lr=0.5)
    ob = torch.optim.SGD(b.parameters(), lr=0.5)
    outs = []
    for step in range(3):
        x = _randn((6, 16), dev, torch.bfloat16)
        ya, yb = a(x), b(x)
        assert _equal(ya, yb), f"step {step}: outputs differ"
        outs.append(ya.detach().cpu())
        ya.float().square().sum().backward()
        yb.float().square().sum().backward()
        oa.step()
        ob.step()
        oa.zero_grad()
        ob.zero_grad()
    assert not torch.equal(outs[0], outs[2]), "the weights really changed"
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert _equal(p, q), f"{n} diverged"


def _layerwise_cast_net(dev, hooked=True):
    """A conv and two Linears stored in float8 by diffusers' layerwise casting (compute
    bf16, frozen, as under LoRA training), then a trainable bf16 Linear it skips.
    hooked=False: the numbers the hooks compute, without them (bf16 weights rounded
    through float8): the reference, whose backward runs on every CPU (the hooked model's
    conv backward reads the float8 weight the hook put back, which torch's CPU
    convolution refuses on some CPUs: "expected scalar type BFloat16 but found
    Float8_e4m3fn")."""
    from diffusers.hooks import apply_layerwise_casting
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 64),
                        nn.GELU(), nn.Linear(64, 32), nn.Linear(32, 8)).to(dev, torch.bfloat16)
    net[:6].requires_grad_(False)
    if not hooked:
        with torch.no_grad():
            for i in (0, 3, 5):
                for p in net[i].parameters():
                    p.copy_(p.to(torch.float8_e4m3fn).to(torch.bfloat16))
        return net
    apply_layerwise_casting(net, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16,
                            skip_modules_pattern=("^6$",))
    return net


def test_diffusers_layerwise_casting_streams_the_storage_dtype_with_the_hooks_numbers(offload_dev, compute_device):
    """diffusers' layerwise casting keeps weights in float8 and casts them to bf16 around
    each call, in a hook that replaces the layer's forward. offload() streams those layers
    as the hook computes (float8 bytes on the bus; compute_dtype taken from the hook, so the
    cast is in the slot, with no warning), gradients of what trains beside them included,
    and detach() gives each layer its hook back."""
    import warnings
    dev = compute_device
    model, ref = _layerwise_cast_net(dev), _layerwise_cast_net(dev, hooked=False)
    hooked = [model[i].__dict__["forward"] for i in (0, 3, 5)]
    x = _randn((2, 3, 6, 6), dev, torch.bfloat16).requires_grad_()
    xr = clone_input(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = offload_dev(model)
        with torch.no_grad():
            model(x)
        moved = handle.stats()["h2d_bytes"]
        y = model(x)
    assert [str(w.message) for w in caught if "layerstream" in str(w.message)] == []
    assert handle.layers == ["0", "3", "5", "6"]
    assert model[0].weight.dtype == torch.float8_e4m3fn
    # A forward moves each layer's weight and bias in its stored dtype: float8, bf16 for the last.
    assert moved == sum(p.numel() * p.element_size() for p in model.parameters())
    yr = ref(xr)
    g = _randn(y.shape, dev, torch.bfloat16)
    y.backward(g)
    yr.backward(g)
    same = _equal if _bf16_exact(dev) else (lambda u, v: _close(u, v, **BF16_TOL) or True)
    with torch.no_grad():
        assert same(_layerwise_cast_net(dev)(x), ref(x)), "the reference is not what the hooks compute"
    assert same(y, yr), "forward differs from the hooked resident model"
    assert same(x.grad, xr.grad), "input grad differs"
    for n in ("weight", "bias"):
        assert same(getattr(model[6], n).grad, getattr(ref[6], n).grad), f"6.{n}.grad differs"
    handle.detach()
    assert [model[i].__dict__["forward"] for i in (0, 3, 5)] == hooked
    with torch.no_grad():
        assert same(model(x), ref(xr)), "after detach() the hooks compute again"


def test_float8_weights_under_autocast_stream_their_float8_bytes(offload_dev, compute_device):
    """kohya's fp8_base: frozen Linear weights stored in float8, run under bf16 autocast
    (which casts them up at each call), a trainable head after them. Streamed, they move
    their float8 bytes and compute as autocast does."""
    dev = compute_device
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256),
                          nn.Linear(256, 8)).to(dev)
    model[:5].requires_grad_(False).to(torch.float8_e4m3fn)
    ref = copy.deepcopy(model)
    handle = offload_dev(model, budget=150000)  # 2 slots of a float8 layer, not 3 float8 layers
    assert handle.layers == ["0", "2", "4"]
    x = _randn((4, 256), dev).requires_grad_()
    xr = clone_input(x)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        with torch.no_grad():
            model(x)
        assert handle.stats()["h2d_bytes"] == 3 * (256 * 256 + 256), "a forward moves 3 float8 layers"
        y, yr = model(x), ref(xr)
    y.float().square().sum().backward()
    yr.float().square().sum().backward()
    same = _equal if _bf16_exact(dev) else (lambda u, v: _close(u, v, **BF16_TOL) or True)
    assert y.dtype == yr.dtype == torch.bfloat16 and same(y, yr)
    assert same(x.grad, xr.grad) and same(model[5].weight.grad, ref[5].weight.grad)


def test_trainable_layers_and_tables_under_layerwise_casting_stay_resident(offload_dev, compute_device):
    """A trainable layer under the hook (diffusers gives its float8 weight a bf16 gradient)
    stays resident and says why; so does a table (the hook's lookup gives compute-dtype rows,
    a streamed one the table's dtype), computing as before."""
    import warnings
    from diffusers.hooks import apply_layerwise_casting
    dev = compute_device
    model = _layerwise_cast_net(dev)
    model[3].requires_grad_(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = offload_dev(model)
    said = [str(w.message) for w in caught if "layerwise casting" in str(w.message)]
    assert len(said) == 1 and "'3'" in said[0] and "frozen ones stream" in said[0], said
    assert "3" not in handle.layers and "0" in handle.layers
    assert model[3].__dict__["forward"] is not None and model[3].weight.dtype == torch.float8_e4m3fn
    torch.manual_seed(0)
    lm = nn.Sequential(nn.Embedding(16, 256), nn.Linear(256, 256)).to(dev, torch.bfloat16).requires_grad_(False)
    apply_layerwise_casting(lm, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16,
                            skip_modules_pattern=())
    ids = torch.tensor([[1, 5, 9]], device=dev)
    expected = lm(ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = offload_dev(lm)
    assert any("replaced on the instance" in str(w.message) and "'0'" in str(w.message) for w in caught)
    assert handle.layers == ["1"]
    out = lm(ids)
    assert out.dtype == torch.bfloat16
    if _bf16_exact(dev):
        assert _equal(out, expected)
    _close(out, expected, **BF16_TOL)


# ---------------------------------------------------------------- embeddings
class _Embedded(nn.Module):
    """A frozen token table feeding a trainable Linear (a LoRA-style language model's
    input side): the table is streamed by lookup, the Linear by slot."""

    def __init__(self, table: torch.Tensor, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding.from_pretrained(table, freeze=True, padding_idx=padding_idx)
        self.fc = nn.Linear(table.shape[1], 8)

    def forward(self, ids):
        return self.fc(self.emb(ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "pageable"])
def test_embedding_lookup_is_exact(offload_dev, compute_device, dtype, ids_dtype, pin):
    """A frozen nn.Embedding streams by lookup: only the rows the ids name are read from
    host memory (on CUDA by a kernel reading the pinned table through its device mapping;
    from a pageable table by a gather on the host and a copy). Outputs, the downstream
    Linear's grads and the table after detach() are bit-identical to the reference, and
    the bytes read are exactly ids x row bytes."""
    torch.manual_seed(0)
    dev = compute_device
    model = _Embedded(torch.randn(1000, 24).to(dtype), padding_idx=0).to(dtype)
    ref = copy.deepcopy(model).to(dev)
    table = model.emb.weight.detach().clone()
    handle = offload_dev(model, pin_memory=pin)
    assert sorted(handle.layers) == ["emb", "fc"]
    assert model.emb.weight.device.type == "cpu", "the table stays in host memory"
    ids = torch.tensor([[0, 999, 5, 5, 17], [3, 0, 998, 1, 5]], dtype=ids_dtype, device=dev)
    for step in range(2):
        out, want = model(ids), ref(ids)
        assert out.dtype == want.dtype == dtype and out.device == dev
        assert _equal(out, want), f"step {step}: outputs differ"
        assert _equal(model.emb(ids), ref.emb(ids))
        out.float().square().sum().backward()
        want.float().square().sum().backward()
        assert model.emb.weight.grad is None
        assert _equal(model.fc.weight.grad, ref.fc.weight.grad)
    with torch.no_grad():
        assert _equal(model(ids), ref(ids))
    with torch.inference_mode():
        assert _equal(model.emb(ids), ref.emb(ids))
    stats = handle.stats()
    assert stats["embedding_layers"] == 1
    assert stats["gathered_bytes"] == 6 * ids.numel() * 24 * table.element_size()
    assert stats["pinned_bytes" if pin else "pageable_bytes"] >= table.numel() * table.element_size()
    handle.detach()
    assert model.emb.weight.device.type == "cpu" and torch.equal(model.emb.weight, table)


def test_embedding_table_layout_is_kept(offload_dev, compute_device):
    """A table whose memory layout is not the contiguous one (a transposed view) is
    looked up with its own strides."""
    torch.manual_seed(0)
    model = _Embedded(torch.randn(16, 300).t())
    assert not model.emb.weight.is_contiguous()
    ref = copy.deepcopy(model).to(compute_device)
    offload_dev(model)
    assert model.emb.weight.stride() == ref.emb.weight.stride()
    ids = torch.randint(0, 300, (4, 9), device=compute_device)
    assert _equal(model(ids), ref(ids))


@pytest.mark.parametrize("opts", [
    dict(),
    dict(padding_idx=0),
    dict(scale_grad_by_freq=True),
    dict(sparse=True),
], ids=["plain", "padding_idx", "scale_grad_by_freq", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_trainable_embedding_trains_like_the_resident_table(offload_dev, compute_device, opts, dtype):
    """A trainable table streams too: its gradient is computed on the host by torch's
    embedding backward (padding row, frequency scaling and sparse gradients as the
    module asks) from the output gradient's rows, and accumulated into .grad by autograd.
    Three SGD steps, the last two accumulating, match the resident table: bit for bit on
    sim (the same CPU op), within the dtype's tolerance on CUDA (the reference sums the
    repeated ids' rows on the device, in another order)."""
    torch.manual_seed(0)
    dev = compute_device
    model = _Embedded(torch.randn(300, 16).to(dtype)).to(dtype)
    model.emb = nn.Embedding(300, 16, dtype=dtype, **opts)
    ref = copy.deepcopy(model).to(dev)
    handle = offload_dev(model)
    assert "emb" in handle.layers and model.emb.weight.requires_grad
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.5)
    tol = dict(rtol=0, atol=0) if dev.type == "cpu" else (BF16_TOL if dtype == torch.bfloat16 else FP32_TOL)
    ids = torch.tensor([[0, 7, 7, 299, 0, 3], [7, 1, 0, 2, 2, 2]], device=dev)
    for step in range(3):
        if step < 2:
            opt.zero_grad()
            opt_r.zero_grad()
        out, want = model(ids), ref(ids)
        _close(out, want, **tol)
        out.float().square().sum().backward()
        want.float().square().sum().backward()
        g, gr = model.emb.weight.grad, ref.emb.weight.grad
        assert g.device.type == "cpu" and g.is_sparse == gr.is_sparse == bool(opts.get("sparse"))
        _close(g.to_dense() if g.is_sparse else g, gr.to_dense() if gr.is_sparse else gr, **tol)
        if step < 2:  # sparse grads accumulate as sparse tensors: compare once, before stepping
            opt.step()
            opt_r.step()
    _close(model.emb.weight, ref.emb.weight, **tol)
    assert handle.stats()["d2h_bytes"] >= 3 * ids.numel() * 16 * model.emb.weight.element_size()


def _tiny_qwen3_moe(hidden: int, experts_inter: int, experts: int = 4, impl: str = "eager"):
    """A 2-layer transformers Qwen3-MoE (`experts` experts, 2 per token), seeded, on the CPU."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=64, moe_intermediate_size=experts_inter,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
        num_experts=experts, num_experts_per_tok=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg)


def _lm_step_close(model, ref, ids, tol, grad_tol, what):
    """One language-model loss and backward on each (gradients accumulate): the losses
    within `tol`, every gradient within `grad_tol`."""
    loss, want = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    _close(loss, want, **tol)
    loss.backward()
    want.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        _close(p.grad, q.grad, **grad_tol, msg=lambda m: f"{what}, {n}: {m}")


def test_moe_experts_stream_as_a_group(offload_dev, compute_device):
    """A mixture-of-experts model (transformers' Qwen3-MoE, experts as 3-D parameters):
    each experts module streams as one tensor group, its own forward (transformers' default
    experts implementation on this device) running on the fetched slot and again in
    backward. Outputs, losses and every gradient (the experts' on the host) match the
    resident model over two accumulating backwards."""
    model = _tiny_qwen3_moe(hidden=32, experts_inter=16)
    ref = copy.deepcopy(model).to(compute_device)
    handle = offload_dev(model)
    assert handle.stats()["group_layers"] == 2
    ids = torch.randint(0, 64, (2, 9), device=compute_device)
    with torch.no_grad():
        _close(model(input_ids=ids).logits, ref(input_ids=ids).logits, **FP32_TOL)
    for step in range(2):
        _lm_step_close(model, ref, ids, FP32_TOL, dict(rtol=1e-4, atol=1e-5), f"backward {step}")


@pytest.mark.parametrize("when", ["before", "after"])
def test_lora_on_moe_expert_parameters(offload_dev, compute_device, when):
    """peft's LoRA on the experts' 3-D tensors (LoraConfig(target_parameters=...)) added
    before offload() or after it (then moved to the device with the model): peft would
    register a parametrization computed from the host copy (on CUDA a device mismatch);
    the streamed group applies the adapter to the fetched tensor on the device instead
    (Note [Adapters on a streamed group's tensors]). Routed one-token decoding and a
    training step (the adapters' gradients from the backward's recompute) match the
    resident peft model."""
    peft = pytest.importorskip("peft")

    def lora(m):
        torch.manual_seed(1)
        return peft.get_peft_model(m, peft.LoraConfig(
            r=2, target_modules=[], init_lora_weights=False,
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))

    base = _tiny_qwen3_moe(hidden=32, experts_inter=16, experts=16)
    ref = lora(copy.deepcopy(base)).to(compute_device)
    if when == "before":
        model = lora(base)
        handle = offload_dev(model)
    else:
        handle = offload_dev(base)
        model = lora(base).to(compute_device)
    tol = _exact_on_cpu(compute_device)
    with torch.no_grad():
        for step in range(3):
            token = torch.tensor([[5 + step]], device=compute_device)
            _close(model(input_ids=token).logits, ref(input_ids=token).logits, **tol)
    assert handle.stats()["routed_fetches"] >= 4
    ids = torch.randint(0, 64, (2, 9), device=compute_device)
    loss, want = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    _close(loss, want, **tol)
    loss.backward()
    want.backward()
    trained = [(n, p, q) for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
               if p.requires_grad]
    assert len(trained) == 2 * 2 * 2  # layers x tensors x (A, B)
    for n, p, q in trained:
        _close(p.grad, q.grad, **(tol if compute_device.type == "cpu" else dict(rtol=1e-4, atol=1e-5)),
               msg=lambda m: f"{n}: {m}")


def test_trainable_lossless_moe_experts(offload_dev, compute_device):
    """Full fine-tuning with quantize="lossless" on the experts: they stay dense on the
    host (the optimizer steps them there) and cross coded, a piece per expert, re-coded
    after each step (Note [Trainable coded weights]); the CUDA kernel of pieces decodes
    them whole, then routed (one token). Losses, gradients and the logits after two SGD
    steps match the resident model (bit for bit on the sim device)."""
    model = _tiny_qwen3_moe(hidden=64, experts_inter=64, experts=16)
    ref = copy.deepcopy(model).to(compute_device)
    handle = offload_dev(model, quantize={"*experts": "lossless"})
    assert handle.stats()["coded_layers"] == 2
    exact = compute_device.type == "cpu"
    tol = _exact_on_cpu(compute_device)
    grad_tol = tol if exact else dict(rtol=1e-4, atol=1e-5)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0)).to(compute_device)
    for step in range(2):
        _lm_step_close(model, ref, ids, tol, grad_tol, f"step {step}")
        for o in opts:
            o.step()
            o.zero_grad()
    assert handle.stats()["recoded_bytes"] > 0
    with torch.no_grad():
        for token in (5, 6, 7):
            one = torch.tensor([[token]], device=compute_device)
            _close(model(input_ids=one).logits, ref(input_ids=one).logits, **grad_tol)
    assert handle.stats()["routed_fetches"] >= 2


def _exact_on_cpu(dev):
    """Bit for bit on the sim device (the CPU runs the same ops on the same values); on
    CUDA the fp32 tolerance (other kernels for the reference's ops)."""
    return dict(rtol=0, atol=0) if dev.type == "cpu" else FP32_TOL


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_quantized_moe_experts_compute_their_dequantized_values(offload_dev, compute_device, fmt):
    """Packed experts (quantize=) are dequantized into their slot on the device. Checked
    against an independent reference (quant_ref.py, the format's spec in torch): the
    streamed model computes what the model computes resident with each packed tensor
    replaced by its reference dequantization, and detach() restores exactly those values
    (within the format's bound of the original weights). Frozen model, inference and
    input gradients."""
    from quant_ref import assert_reference_values, packed_names, with_reference_values

    model = _tiny_qwen3_moe(hidden=64, experts_inter=64).requires_grad_(False)  # packable shapes
    original = copy.deepcopy(model)
    handle = offload_dev(model, quantize={"*experts": fmt})
    assert handle.stats()["group_layers"] == 2 and model.model.layers[0].mlp.experts.gate_up_proj.is_meta
    packed = packed_names(model)
    assert len(packed) == 4 and all(".mlp.experts." in n for n in packed)
    ref = with_reference_values(original, fmt, packed).to(compute_device)
    ids = torch.randint(0, 64, (2, 9), device=compute_device)
    emb = model.model.embed_tokens(ids).detach().requires_grad_()
    out = model(inputs_embeds=emb).logits
    out.square().mean().backward()
    emb2 = emb.detach().clone().requires_grad_()
    want = ref(inputs_embeds=emb2).logits
    want.square().mean().backward()
    tol = _exact_on_cpu(compute_device)
    _close(out, want, **tol)
    _close(emb.grad, emb2.grad, **tol)
    handle.detach()
    restored, before = dict(model.named_parameters()), dict(original.named_parameters())
    for n in packed:
        assert_reference_values(fmt, before[n], restored[n], n)


@pytest.mark.parametrize("impl", ["eager", "batched_mm"])
@pytest.mark.parametrize("fmt", [None, "nf4", "lossless"])
def test_routed_moe_experts_copy_only_the_chosen_ones(offload_dev, compute_device, impl, fmt):
    """Decoding one token reads 2 of 16 experts per layer: only their slices cross the bus
    (packed ones dequantized row range by row range on the device, lossless-coded ones
    decoded piece by piece, a piece per expert). The logits match those of the same model
    fetching every expert (experts="all") and the resident model's (packed: resident with
    the experts' reference dequantization, quant_ref.py; lossless: the model itself); bit
    for bit on the sim device; fewer bytes cross."""
    from quant_ref import packed_names, with_reference_values

    model = _tiny_qwen3_moe(hidden=64, experts_inter=64, experts=16, impl=impl).requires_grad_(False)
    whole = copy.deepcopy(model)
    ref = copy.deepcopy(model)
    quantize = {"*experts": fmt} if fmt else None
    handle = offload_dev(model, quantize=quantize)
    h_all = offload_dev(whole, quantize=quantize, experts="all")
    if fmt:
        packed = packed_names(model)
        assert len(packed) == 4
    if fmt and fmt != "lossless":  # resident with the experts' reference dequantization (quant_ref.py)
        ref = with_reference_values(ref, fmt, packed)
    _decode_routed_and_all(model, handle, whole, h_all, ref.to(compute_device), compute_device)


def _decode_routed_and_all(model, handle, whole, h_all, ref, compute_device):
    """Decodes three single tokens with `model` (routed experts) and `whole` (every
    expert; and `ref`, resident, unless None): equal logits; the routed model's last
    step moved under 0.8x the bytes, through routed fetches (>= 4: 2 layers x 2 steps)."""
    tol = _exact_on_cpu(compute_device)
    with torch.no_grad():
        for step in range(3):
            before, before_all = handle.stats()["h2d_bytes"], h_all.stats()["h2d_bytes"]
            token = torch.tensor([[5 + step]], device=compute_device)
            out = model(input_ids=token).logits
            _close(out, whole(input_ids=token).logits, **tol)
            if ref is not None:
                _close(out, ref(input_ids=token).logits, **tol)
    assert handle.stats()["h2d_bytes"] - before < (h_all.stats()["h2d_bytes"] - before_all) * 0.8
    assert handle.stats()["routed_fetches"] >= 4 and h_all.stats()["routed_fetches"] == 0


@pytest.mark.parametrize("fmt", [None, "nf4"])
def test_multihead_attention_streams_as_a_group(offload_dev, compute_device, fmt):
    """nn.MultiheadAttention (its forward reads the projection weights directly) streams as
    one tensor group with its out_proj: outputs and input gradients match the resident
    module (dense), or the module resident with the packed tensors' reference
    dequantization (nf4, quant_ref.py; detach() must restore exactly those values);
    weight gradients too (dense)."""
    from quant_ref import assert_reference_values, packed_names, with_reference_values

    torch.manual_seed(0)
    m = nn.MultiheadAttention(64, 4, batch_first=True)
    if fmt:
        m.requires_grad_(False)
    original = copy.deepcopy(m)
    ref = copy.deepcopy(m)
    handle = offload_dev(m, quantize=fmt)
    assert handle.layers == [""]
    if fmt:  # resident with the packed tensors' reference dequantization (quant_ref.py)
        packed = packed_names(m)
        assert sorted(packed) == ["in_proj_weight", "out_proj.weight"]
        ref = with_reference_values(ref, fmt, packed)
    ref = ref.to(compute_device)
    x = torch.randn(2, 7, 64, device=compute_device, requires_grad=True)
    out = m(x, x, x, need_weights=False)[0]
    out.square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    want = ref(x2, x2, x2, need_weights=False)[0]
    want.square().sum().backward()
    # fp32 tolerance even on the sim device: with query is key is value, the streamed
    # group and the resident module do not compute bit for bit alike (also dense).
    _close(out, want, **FP32_TOL)
    _close(x.grad, x2.grad, **FP32_TOL)
    if fmt:
        handle.detach()
        restored, before = dict(m.named_parameters()), dict(original.named_parameters())
        for n in packed:
            assert_reference_values(fmt, before[n], restored[n], n)
    else:
        for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
            _close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda s: f"{n}: {s}")


@pytest.mark.parametrize("nested", [False, True])
def test_transformer_encoder_inference_streams(offload_dev, compute_device, nested):
    """nn.TransformerEncoder in eval under no_grad: its layers' fused path, which reads
    the weights itself, is turned off where they stream, so the streamed weights are used
    on the device (not the host copies); matches the resident model's fused path to
    rounding, also for a padded batch the encoder turns into nested tensors."""
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0), 2,
                                enable_nested_tensor=nested).eval()
    ref = copy.deepcopy(enc).to(compute_device)
    handle = offload_dev(enc)
    x = torch.randn(2, 7, 64, device=compute_device)
    pad = torch.zeros(2, 7, dtype=torch.bool, device=compute_device)
    pad[1, -3:] = True
    with torch.no_grad():
        before = handle.stats()["acquires"]
        got = enc(x, src_key_padding_mask=pad)
        assert handle.stats()["acquires"] - before == 6
        _close(got, ref(x, src_key_padding_mask=pad), **FP32_TOL)


def test_named_module_streams_whole_as_a_group(offload_dev, compute_device):
    """offload(groups=...): a custom module that reads its weight directly streams whole,
    its child Linear with it; outputs and every gradient match the resident module."""

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(32, 32) / 32 ** 0.5)
            self.inner = nn.Linear(32, 32)

        def forward(self, x):
            return self.inner(torch.tanh(x @ self.w.t()))

    torch.manual_seed(0)
    model = nn.Sequential(Custom(), nn.Linear(32, 8))
    ref = copy.deepcopy(model).to(compute_device)
    handle = offload_dev(model, groups="0")
    assert handle.layers == ["0", "1"]
    x = torch.randn(4, 32, device=compute_device)
    out, want = model(x), ref(x)
    _close(out, want, **FP32_TOL)
    out.square().sum().backward()
    want.square().sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        _close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda s: f"{n}: {s}")


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_1", "Q3_K", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gguf_linear_streams_its_file_bytes(tmp_path, offload_dev, compute_device, type_name, dtype):
    """load_gguf() keeps a Linear weight as the file's blocks; on the device they are
    dequantized (CUDA: the GGUF kernels) to the same values as the CPU reference
    (itself bit-identical to gguf-py, test_gguf.py): fp32 outputs and input
    gradients bit-exact against a resident Linear holding those values."""
    import layerstream
    rows, cols = 96, 512
    raw = gguf_random_blocks(type_name, rows, cols, seed=3)
    bias = torch.randn(rows)
    path = write_gguf(tmp_path / "l.gguf", [("0.weight", (rows, cols), type_name, raw),
                                            ("0.bias", (rows,), "F32", bias.view(torch.uint8))])
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(cols, rows)).to(dtype)
    assert layerstream.load_gguf(model, str(path)).packed == ["0.weight"]
    ref = nn.Linear(cols, rows).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(model[0].weight.dequantized())
        ref.bias.copy_(bias)
    ref = ref.to(compute_device).requires_grad_(False)
    handle = offload_dev(model)
    x = torch.randn(7, cols, dtype=dtype, device=compute_device, requires_grad=True)
    x_ref = clone_input(x)
    y, y_ref = model(x), ref(x_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    if dtype == torch.float32:
        assert torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad)
    else:
        _close(y, y_ref, **BF16_TOL)
        _close(x.grad, x_ref.grad, **BF16_TOL)
    assert handle.stats()["quantized_layers"] == 1
    handle.detach()
    assert torch.equal(model[0].weight.cpu(), ref.weight.cpu())



@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_1"])
def test_gguf_moe_experts_stream_their_file_bytes(tmp_path, offload_dev, compute_device, type_name):
    """Expert tensors of a GGUF file (load_gguf keeps a mixture-of-experts module's 3-D
    weights packed) stream as the file's blocks; decoding one token copies only the
    routed experts' blocks and dequantizes them on the device (CUDA: the GGUF row-range
    kernels). The logits match the resident model holding the dequantized values, and
    those of the same file fetching every expert, with fewer bytes on the bus."""
    import layerstream
    model = _tiny_qwen3_moe(hidden=64, experts_inter=64, experts=16).requires_grad_(False)
    tensors = []
    for i, layer in enumerate(model.model.layers):
        for n in ("gate_up_proj", "down_proj"):
            shape = tuple(getattr(layer.mlp.experts, n).shape)
            raw = gguf_random_blocks(type_name, shape[0] * shape[1], shape[2], seed=10 * i + len(n))
            tensors.append((f"model.layers.{i}.mlp.experts.{n}", shape, type_name, raw))
    path = write_gguf(tmp_path / "experts.gguf", tensors)
    whole = copy.deepcopy(model)
    for m in (model, whole):
        assert len(layerstream.load_gguf(m, str(path), strict=False).packed) == 4
    ref = copy.deepcopy(model)
    for layer in ref.model.layers:
        for n in ("gate_up_proj", "down_proj"):
            setattr(layer.mlp.experts, n, nn.Parameter(getattr(layer.mlp.experts, n).dequantized(),
                                                       requires_grad=False))
    ref = ref.to(compute_device)
    handle = offload_dev(model)
    h_all = offload_dev(whole, experts="all")
    _decode_routed_and_all(model, handle, whole, h_all, ref, compute_device)
    assert handle.stats()["quantized_layers"] == 2  # both experts modules cross as GGUF blocks
    handle.detach()
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj.cpu(),
                       ref.model.layers[1].mlp.experts.down_proj.cpu())


def _int_bits(t):
    """A float tensor's bits (on the CPU), to compare NaN payloads and -0 too."""
    return t.detach().cpu().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_lossless_weights_decode_on_the_device_bit_for_bit(offload_dev, compute_device, dtype):
    """quantize="lossless": each frozen weight crosses the bus entropy-coded and is decoded
    into its slot on the device (CUDA: kernels/cuda/lossless.cu; sim: the CPU reference).
    Outputs and input gradients are bit-identical to the same model streamed uncompressed,
    special values (NaN, ±Inf, subnormal, -0) included, over steps that reuse the slots."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 130), nn.GELU(), nn.Linear(130, 257), nn.GELU(), nn.Linear(257, 64))
    model = model.to(dtype).requires_grad_(False)
    with torch.no_grad():
        for m in model[::2]:
            m.weight.normal_(0, 0.02)
        model[2].weight[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -0.0])
    plain = copy.deepcopy(model)
    handle = offload_dev(model, quantize="lossless")
    plain_handle = offload_dev(plain)

    for step in range(3):
        x = torch.randn(5, 300, dtype=dtype, device=compute_device, requires_grad=True)
        x2 = clone_input(x)
        y, y2 = model(x), plain(x2)
        g = torch.randn_like(y)
        y.backward(g)
        y2.backward(g)
        assert torch.equal(_int_bits(y), _int_bits(y2)), step
        assert torch.equal(_int_bits(x.grad), _int_bits(x2.grad)), step
    s = handle.stats()
    assert s["quantized_layers"] == 3 and s["h2d_bytes"] < plain_handle.stats()["h2d_bytes"]
    handle.detach()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(_int_bits(a), _int_bits(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_trainable_lossless_weights_step_like_plain_ones(offload_dev, compute_device, dtype):
    """quantize="lossless" on trainable weights (full fine-tuning): dense parameters on
    the host, coded on the bus and re-coded after each optimizer step (CUDA: decoded by
    the lossless kernel with the new code). Outputs, input gradients and the parameters
    after each SGD step are bit-identical to the same model streamed uncompressed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 192), nn.GELU(), nn.Linear(192, 64)).to(dtype)
    with torch.no_grad():
        for m in model[::2]:
            m.weight.normal_(0, 0.02)
    plain = copy.deepcopy(model)
    handle = offload_dev(model, quantize="lossless")
    offload_dev(plain)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, plain)]

    for step in range(3):
        x = torch.randn(6, 256, dtype=dtype, device=compute_device, requires_grad=True)
        x2 = clone_input(x)
        y, y2 = model(x), plain(x2)
        y.float().square().mean().backward()
        y2.float().square().mean().backward()
        assert torch.equal(_int_bits(y), _int_bits(y2)) and torch.equal(_int_bits(x.grad), _int_bits(x2.grad)), step
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for a, b in zip(model.parameters(), plain.parameters()):
            assert torch.equal(_int_bits(a), _int_bits(b)), step
    s = handle.stats()
    assert s["coded_layers"] == 2 and s["recoded_bytes"] > 0


# ---------------------------------------------------------------- optimizers
@pytest.mark.parametrize("kind", ["adamw", "adafactor"])
def test_parity_optimizers_step_parameters_on_the_compute_device(compute_device, kind):
    """layerstream.optim on parameters that live on the compute device (the resident
    layers of an offloaded model): on CUDA they are stepped there by torch's arithmetic
    (AdamW: torch.optim.AdamW's single-tensor path; Adafactor: transformers'), on sim
    (CPU tensors) by the host kernels; either way equal to the reference class, with a
    clip that triggers on even steps only (gradient norm ~40 against 1.0, then ~0.4)."""
    import layerstream.optim

    torch.manual_seed(0)
    shapes = [(48, 32), (32,), (2, 5, 8)]
    ours = [nn.Parameter(torch.randn(s).to(compute_device)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    if kind == "adamw":
        opt = layerstream.optim.AdamW(ours, lr=1e-2, weight_decay=0.05, max_grad_norm=1.0)
        ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.05, foreach=False)
    else:
        from transformers.optimization import Adafactor as Reference
        kw = {"lr": 1e-2, "relative_step": False, "beta1": 0.9, "weight_decay": 0.01}
        opt, ref = layerstream.optim.Adafactor(ours, max_grad_norm=1.0, **kw), Reference(theirs, **kw)
    gen = torch.Generator().manual_seed(5)
    for step in range(6):
        grads = [torch.randn(s, generator=gen).mul_(0.01 if step % 2 else 1.0).to(compute_device) for s in shapes]
        for a, b, g in zip(ours, theirs, grads):
            a.grad, b.grad = g.clone(), g.clone()
        torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        assert a.device == compute_device
        torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activations", ["host", "window"])
def test_offloaded_activations_give_the_same_gradients_and_leave_the_device(offload_dev, compute_device,
                                                                            activations):
    """offload(activations="host" or a device budget of 3 of the 8 saved tensors): two
    training steps of 4 x (Linear(64) + GELU), batch 512 (128 KiB per saved tensor).
    Outputs and every gradient equal the same model streamed without activation offload
    (bit for bit on sim; fp32 tolerance on CUDA), and the tensors sent to the host leave
    the device when their copy is enqueued, not when the host sees it finished: on CUDA
    the forward runs ahead of the GPU, so a host-side check would find no copy done and
    keep every tensor on the device until backward (the H200 run of 2026-12-04 measured
    that: host mode's peak equal to keeping them all). On CUDA torch's allocator orders
    their reuse after the copy; on sim the engine lets go of them once their copy has
    finished (here: after synchronize)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.GELU())])
    plain = copy.deepcopy(model)
    one = 512 * 64 * 4
    budget = "host" if activations == "host" else 3 * one
    handle = offload_dev(model, activations=budget)
    offload_dev(plain)
    exact = compute_device.type == "cpu"
    for step in range(2):
        x = _randn((512, 64), compute_device).requires_grad_()
        x2 = clone_input(x)
        y, y2 = model(x), plain(x2)
        if compute_device.type != "cuda":
            handle.synchronize()  # sim: the copies finished, then the engine lets go
        kept = handle.stats()["activation_device_bytes"]
        assert kept == (0 if activations == "host" else 3 * one), (step, kept)
        y.square().sum().backward()
        y2.square().sum().backward()
        pairs = [(y, y2), (x.grad, x2.grad)] + [(p.grad, q.grad) for p, q in zip(model.parameters(),
                                                                                 plain.parameters())]
        for i, (a, b) in enumerate(pairs):
            if exact:
                assert _equal(a, b), (step, i)
            else:
                _close(a, b, **FP32_TOL)
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    s = handle.stats()
    assert s["activation_d2h_bytes"] == 2 * (8 if activations == "host" else 5) * one, s
    assert s["activation_device_bytes"] == 0, s


def test_copies_to_the_host_in_flight_are_bounded(offload_dev, compute_device):
    """activations="host" against keeping every saved tensor ("1TiB"), on a forward whose
    copies to the host are slower than its compute: depth x (Linear + GELU), 2 x depth
    saved tensors of one size. Without a bound the forward runs ahead of the copies and
    every tensor waits on the device for its own (the H200 run of 2026-12-04: host mode's
    peak equal to keeping them all). With it (Note [Copies in flight]: at most
    prefetch + 1 of them in flight) the device holds a few. On CUDA: torch's peak reserved memory during
    the forward (its allocator holds a tensor until its copy ran), host at most half of
    kept; on sim: the engine's peak, at most prefetch + 2 tensors (one more: a finished
    copy's tensor goes at the next stash; without the bound it is all 16)."""
    cuda = compute_device.type == "cuda"
    # sim: weights of 16 KiB, saved tensors of 2 MiB on a link of 50 MB/s (40 ms a copy),
    # so the forward's compute and weights outrun the copies, as a GPU's forward does.
    width, batch, depth = (1024, 2048, 16) if cuda else (64, 8192, 8)
    one = batch * width * 4
    kw = {} if cuda else {"sim_link_gbps": 0.05}
    peaks = {}
    for mode in ("1TiB", "host"):
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())])
        handle = offload_dev(model, activations=mode, prefetch=2, **kw)
        x = _randn((batch, width), compute_device).requires_grad_()
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_reserved()
            torch.cuda.reset_peak_memory_stats()
        y = model(x)
        if cuda:
            torch.cuda.synchronize()
            peaks[mode] = torch.cuda.max_memory_reserved() - base
        else:
            peaks[mode] = handle.stats()["peak_activation_device_bytes"]
        y.square().sum().backward()
        assert all(p.grad is not None for p in model.parameters())
        del x, y
        handle.detach()
    if cuda:
        assert peaks["1TiB"] >= 2 * depth * one, peaks
        assert peaks["host"] <= 0.5 * peaks["1TiB"], peaks
    else:
        assert peaks["1TiB"] == 2 * depth * one, peaks
        assert 0 < peaks["host"] <= 4 * one, peaks


@pytest.mark.parametrize("quantize", [None, "lossless"], ids=["dense", "lossless"])
def test_a_budget_too_small_is_an_error_and_fewer_slots_are_tried_first(offload_dev, compute_device, quantize):
    """offload()'s planner tries prefetch + 1 slots, and on a budget too small for them
    fewer (without an exception: planner.cpp, Note [No exceptions for the retry]); with
    none that fits, the error reaches Python as a LayerstreamError naming the budget
    needed. Four trainable bf16 Linear(256, 256) layers, train="adamw", prefetch=2, as bench/bench_full_ft.py's
    lossless peer (whose offload() died with SIGSEGV on the H200 run of 2026-12-04 in
    this planner call, where the first try's error was then thrown and caught)."""
    import re

    from layerstream import LayerstreamError

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(4)]).to(torch.bfloat16)

    with pytest.raises(LayerstreamError, match="too small") as err:
        offload_dev(model(), budget=1000, prefetch=2, quantize=quantize, train="adamw")
    need = int(re.search(r"\((\d+) bytes\) is needed", str(err.value)).group(1))
    m = model()
    handle = offload_dev(m, budget=need, prefetch=2, quantize=quantize, train="adamw")  # 3 slots: no; 2: yes
    x = _randn((8, 256), compute_device, torch.bfloat16)
    m(x).float().square().sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    assert handle.stats()["slots"] == 2 and len(handle.layers) == 4, handle.stats()


_THROWS = r"""
import sys
import torch
import layerstream
from layerstream import _C, LayerstreamError
dev = sys.argv[1]
if dev != "sim":
    torch.zeros(1, device=dev)  # the device's runtime loaded, as in a run
kinds = []
try:  # a C++ error that reaches Python through the module's translator
    _C.plan_slots_first(10, [("a", 100, 0, 100, 0.0, False, True, 0)], 0, prefetch=1)
except LayerstreamError as e:
    kinds.append("translated" if "too small" in str(e) else str(e))
try:  # caught in C++ and raised again as Python's ValueError
    _C.parse_budget("lots")
except ValueError:
    kinds.append("value error")
# thrown and caught inside C++, which goes on and returns the message
kinds.append("caught" if "group size" in _C.quant_check("int4", 3, 5) else "not caught")
# the planner's retry (3 slots do not fit, 2 do)
plan = _C.plan_slots_first(250, [("a", 100, 0, 100, 0.0, False, True, 0)] * 3, 0, prefetch=2)
kinds.append(f"retried: {plan['num_slots']} slots")
print("|".join(kinds))
"""


def test_cpp_exceptions_reach_python_in_a_process_like_a_run(compute_device):
    """C++ exceptions in a process whose device runtime is loaded, in a child process so
    that a crash is a failure with its traceback here, not the end of the test run: one
    translated to LayerstreamError, one turned into ValueError in C++, one thrown and
    caught inside C++; then the planner's retry. (The H200 run of 2026-12-04: a benchmark
    peer died with SIGSEGV in the planner call, whose retry then threw and caught an
    error; GCC 13 built the module there, GCC 12 here, where nothing faults.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "python"), os.environ.get("PYTHONPATH", "")])}
    dev = "sim" if compute_device.type == "cpu" else str(compute_device)
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _THROWS, dev], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, f"exit {p.returncode}: {p.stderr[-3000:]}"
    assert p.stdout.strip().splitlines()[-1] == "translated|value error|caught|retried: 2 slots", p.stdout
