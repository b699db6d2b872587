"""A streamed layer issues the resident module's BLAS calls, on every layout.

Bit-exactness with the resident model holds on every CPU only if the streamed path
calls the same BLAS routines on operands of the same shapes, strides and
requires_grad: BLAS libraries round the variants (one GEMM on a folded input or a
batched GEMM on a broadcast weight; goᵀ·x or xᵀ·go for a weight gradient) differently
on some CPUs only, so comparing values on one machine is not enough. These tests
record the calls themselves -- oneMKL's verbose log (every GEMM with its transposes,
sizes and leading dimensions) and oneDNN's (every convolution and reorder with its
memory formats) -- for the resident module and its streamed copy, on the same work,
and require the same list, then the same bits.
(Note [Same calls as the resident module], csrc/torch/engine.cpp.)
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import re

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import layerstream

_LIBC = ctypes.CDLL(None)
_POINTER = re.compile(r"0x[0-9a-fA-F]+")
_MKL_CALL = re.compile(r"MKL_VERBOSE ([A-Z0-9_]+\([^)]*\))")
_MKL = torch.backends.mkl.is_available()
_DNNL = torch.backends.mkldnn.is_available()


def _normalized(text: str) -> list:
    """The calls of a verbose log, without pointers, timings and thread ids."""
    calls = []
    for line in text.splitlines():
        m = _MKL_CALL.match(line)
        if m:
            calls.append(_POINTER.sub("P", m.group(1)))
        elif line.startswith("onednn_verbose") and ",exec," in line:
            calls.append(",".join(line.split(",")[:-1]))  # the last field is the time
    return calls


class _ComputeOps(TorchDispatchMode):
    """The matrix and convolution ops that reach the kernels, with each tensor
    argument's shape, strides and dtype: the BLAS-independent half of the record
    (it also covers dtypes whose GEMMs call no BLAS on this CPU, e.g. bf16)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if any(k in name for k in ("mm", "mv", "conv", "linear", "matmul")):
            self.ops.append((name, tuple((tuple(t.shape), t.stride(), t.dtype)
                                         for t in torch.utils._pytree.tree_leaves((args, kwargs or {}))
                                         if isinstance(t, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def _recorded(capfd, work, dispatch=True) -> tuple:
    """(BLAS calls, compute ops, result) of work(); the BLAS log is read from file
    descriptor 1. dispatch=False: no compute ops ([]), for compiled work (Dynamo would
    not compile under a dispatch mode, and ops inside an operator's kernel run below it)."""
    _LIBC.fflush(None)
    capfd.readouterr()
    ops = _ComputeOps()
    with contextlib.ExitStack() as stack:
        if _MKL:
            stack.enter_context(torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON))
        if _DNNL:
            stack.enter_context(torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON))
        if dispatch:
            stack.enter_context(ops)
        result = work()
    _LIBC.fflush(None)
    return _normalized(capfd.readouterr().out), ops.ops, result


def _run(capfd, model, x, grad_mode, dispatch=True):
    """(forward record, backward record, results): the output, the input's gradient
    and the parameters' gradients, for the same-bits check; backward with a fixed
    output gradient when training."""
    x = x.detach().clone().requires_grad_(x.requires_grad)

    def forward():
        if grad_mode == "no_grad":
            with torch.no_grad():
                return model(x)
        if grad_mode == "inference_mode":
            with torch.inference_mode():
                return model(x)
        return model(x)

    *fwd, out = _recorded(capfd, forward, dispatch)
    out = out[0] if isinstance(out, tuple) else out
    bwd = ([], [])
    if grad_mode == "train":
        g = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
        *bwd, _ = _recorded(capfd, lambda: out.backward(g), dispatch)
    results = (out.detach(), None if x.grad is None else x.grad,
               {n.removeprefix("_orig_mod."): p.grad.clone()  # a compiled module's names
                for n, p in model.named_parameters() if p.grad is not None})
    return fwd, bwd, results


def _compare(capfd, model, x, grad_mode="train", recomputed=False, prepare_resident=None, compiled=False, **kw):
    """The streamed copy's records equal the resident module's: forward to forward,
    backward to backward (a tensor group, `recomputed`, runs its forward again at the
    start of its backward: there, to the resident forward then backward). `compiled`:
    the streamed copy runs under torch.compile(fullgraph=True), whose graphs must hold
    nothing but layerstream operators (so the resident eager calls are what they must
    issue); only the BLAS calls are compared."""
    resident = copy.deepcopy(model)
    streamed = copy.deepcopy(model)
    if prepare_resident is not None:
        prepare_resident(resident)
    handle = layerstream.offload(streamed, device="sim", **kw)
    run, graphs = streamed, []
    if compiled:
        def backend(gm, example_inputs):
            graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
            return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)
        torch._dynamo.reset()
        run = torch.compile(streamed, fullgraph=True, backend=backend)
    try:
        want_fwd, want_bwd, want = _run(capfd, resident, x, grad_mode)
        got_fwd, got_bwd, got = _run(capfd, run, x, grad_mode, not compiled)
        # Again: the second step runs on prefetched slots (another code path in the engine).
        got_fwd2, got_bwd2, _ = _run(capfd, run, x, grad_mode, not compiled)
        assert handle.ordering_errors() == []
    finally:
        handle.detach()
    if recomputed and grad_mode == "train":
        want_bwd = tuple(f + b for f, b in zip(want_fwd, want_bwd))
    if compiled:
        assert len(graphs) == 1 and all(t.startswith(("layerstream.", "<built-in function getitem>"))
                                        for t in graphs[0]), graphs
        assert want_fwd[0], "the resident step made no BLAS call: the compiled case tests nothing"
    for what, w, g, g2 in (("forward", want_fwd, got_fwd, got_fwd2), ("backward", want_bwd, got_bwd, got_bwd2)):
        blas_w, ops_w = w
        if what == "forward":
            assert ops_w, "the resident step ran no matrix or convolution op: the case tests nothing"
        assert compiled or (g[1] == ops_w and g2[1] == ops_w), "\n".join(
            [f"{what} ops, resident:"] + [str(o) for o in ops_w] + ["streamed:"] + [str(o) for o in g[1]])
        assert g[0] == blas_w and g2[0] == blas_w, "\n".join(
            [f"{what} BLAS calls, resident:"] + blas_w + ["streamed:"] + g[0])
    assert torch.equal(got[0], want[0])
    if want[1] is not None:
        assert torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for n in want[2]:
        assert torch.equal(got[2][n], want[2][n]), n
        assert got[2][n].stride() == want[2][n].stride(), n  # .grad in the parameter's layout


def _transposed_weight(m: nn.Module) -> nn.Module:
    """The same values, stored transposed (strides (1, rows)), as some checkpoints are."""
    for mod in m.modules():
        if isinstance(mod, nn.Linear):
            mod.weight = nn.Parameter(mod.weight.detach().t().contiguous().t(), mod.weight.requires_grad)
    return m


def _linear(bias=True, transposed=False, frozen=False):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 48, bias=bias), nn.Linear(48, 64, bias=bias))
    if transposed:
        _transposed_weight(m)
    if frozen:
        m.requires_grad_(False)
    return m


_INPUTS = {
    "2d": lambda: torch.randn(30, 64),
    "2d-columns": lambda: torch.randn(64, 30).t(),           # column-major
    "3d": lambda: torch.randn(2, 15, 64),
    "3d-permuted": lambda: torch.randn(2, 3, 5, 64).permute(2, 0, 1, 3)[:, :, 0],
    "4d-permuted": lambda: torch.randn(2, 3, 5, 64).permute(2, 0, 1, 3),
}


@pytest.mark.parametrize("layout", list(_INPUTS))
@pytest.mark.parametrize("weights", ["contiguous", "transposed", "no-bias", "frozen"])
@pytest.mark.parametrize("grad_mode", ["train", "no_grad", "inference_mode"])
def test_linear_issues_the_resident_calls(capfd, layout, weights, grad_mode):
    model = _linear(bias=weights != "no-bias", transposed=weights == "transposed", frozen=weights == "frozen")
    x = _INPUTS[layout]()
    # A frozen layer still gets an input gradient (the LoRA case).
    x.requires_grad_(weights == "frozen" and grad_mode == "train")
    _compare(capfd, model, x, grad_mode)


def test_linear_bf16_issues_the_resident_calls(capfd):
    model = _linear(transposed=True).to(torch.bfloat16)
    _compare(capfd, model, _INPUTS["4d-permuted"]().to(torch.bfloat16))


@pytest.mark.parametrize("case", ["contiguous", "channels_last", "same-even-kernel", "unbatched", "conv1d",
                                  "strided-dilated"])
def test_conv_issues_the_resident_calls(capfd, case):
    torch.manual_seed(0)
    if case == "conv1d":
        model, x = nn.Sequential(nn.Conv1d(8, 16, 3), nn.Conv1d(16, 8, 5, padding=2)), torch.randn(4, 8, 40)
    elif case == "same-even-kernel":
        model, x = nn.Sequential(nn.Conv2d(8, 16, 4, padding="same"), nn.Conv2d(16, 8, 3)), torch.randn(4, 8, 16, 16)
    elif case == "strided-dilated":
        model = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, dilation=2), nn.Conv2d(16, 8, 1))
        x = torch.randn(4, 8, 20, 20)
    else:
        model, x = nn.Sequential(nn.Conv2d(8, 16, 3), nn.Conv2d(16, 8, 3, padding=1)), torch.randn(4, 8, 16, 16)
    if case == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    if case == "unbatched":
        x = x[0]
    _compare(capfd, model, x)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("module_mode", ["train", "eval"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
def test_attention_group_issues_the_resident_calls(capfd, batch_first, module_mode, compiled):
    """In eval mode, nn.MultiheadAttention takes its fused path only without grad mode:
    a streamed group's forward must run under grad mode as the resident one does, also
    inside the layerstream::group operator that torch.compile records."""
    torch.manual_seed(0)
    model = nn.MultiheadAttention(64, 4, batch_first=batch_first).train(module_mode == "train")

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = model

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    x = torch.randn(3, 10, 64) if batch_first else torch.randn(10, 3, 64)
    _compare(capfd, SelfAttention(), x.requires_grad_(True), recomputed=True, compiled=compiled)


def test_transformer_encoder_inference_issues_the_resident_calls(capfd):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=96, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()

    def unfused(m):  # what offload() does to the streamed copy (test_attention.py says why)
        for block in m.layers:
            block.activation_relu_or_gelu = 0

    _compare(capfd, model, torch.randn(3, 10, 64), grad_mode="no_grad", prepare_resident=unfused)


def test_groups_module_issues_the_resident_calls(capfd):
    """A custom module streamed whole (offload(groups=...)) that reads its weight
    directly with a permuted 3-D input: its forward runs on slot views with the
    parameters' requires_grad, under grad mode, like the resident one."""
    torch.manual_seed(0)

    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 64) / 8)

        def forward(self, x):
            return torch.nn.functional.linear(x, self.w).relu()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mixer = Mixer()

        def forward(self, x):
            return self.mixer(x.permute(2, 0, 1, 3))

    _compare(capfd, Net(), torch.randn(2, 3, 5, 64), groups=["mixer"], recomputed=True)


def test_the_log_sees_a_layout_change(capfd):
    """The recorder itself: two layouts known to take different BLAS paths give
    different call lists (a recorder that saw nothing would pass every test above)."""
    if not _MKL:
        pytest.skip("oneMKL is not this torch's BLAS: its verbose log cannot be read")
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(2, 3, 5, 64).permute(2, 0, 1, 3)
    folded, folded_ops, _ = _recorded(capfd, lambda: x @ w.t())
    batched, batched_ops, _ = _recorded(capfd, lambda: x @ w.detach().t())
    assert folded and batched and folded != batched
    assert folded_ops and batched_ops and folded_ops != batched_ops
