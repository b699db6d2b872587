"""An independent reference for layerstream's own quantized formats (int8, fp8, nf4,
int4), written in torch from their specification in docs/design/quant-formats.md
and sharing no code with the engine. Tests compare what the engine streams (the
values detach() restores, the outputs of a streamed model) with:

* ``ref_dequantize(fmt, w)``: quantize then dequantize ``w`` as the spec says; the
  engine's device dequantization must equal it bit for bit (same fp32 operations);
* ``error_bound(fmt, w)``: the per-element bound on ``|w - w'|`` the spec states,
  so that the reference itself is checked against the original weights.

A weight of any rank is viewed as the matrix ``[prod(shape[:-1]), shape[-1]]``
(rows of the last dimension; for 2-D weights that is [out_features, in_features],
and a mixture-of-experts tensor [experts, rows, cols] packs as [experts * rows, cols]).
Only fp32 values are produced here (a bf16 parameter is widened first, as the
packer does, and the fp32 result rounded to the parameter's dtype at the end).
"""
from __future__ import annotations

import torch

NF4_CODES = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236328, 1.0,
]
NF4_BLOCK = 64
INT4_GROUP = 128
# The formats' stated slack (docs/design/quant-formats.md, "Error bounds"): 2^-10
# relative (fp32 rounding of w / scale and of the product) and 2^-140 absolute.
_REL_SLACK = 2.0 ** -10
_ABS_SLACK = 2.0 ** -140


def _matrix(w: torch.Tensor) -> torch.Tensor:
    # By the last dimension: a Linear's weight, and a group tensor's view (quant-formats.md,
    # "Matrix view"); a convolution streamed as a layer is [shape[0], prod(rest)]: pass that.
    w = w.detach().to("cpu", torch.float32)
    return w.reshape(-1, w.shape[-1]) if w.dim() >= 2 else w.reshape(1, -1)


def _safe_div(a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return a / torch.where(s == 0, torch.ones_like(s), s)


def _top_code_finite(scale, top):
    """A scale whose top code would dequantize to Inf (absmax near FLT_MAX) steps one ulp down."""
    return torch.where(torch.isinf(scale * top), torch.nextafter(scale, torch.zeros_like(scale)), scale)


def _int8(m):
    scale = _top_code_finite(m.abs().amax(1, keepdim=True) / 127.0, 127.0)  # fp32 division
    q = torch.round(_safe_div(m, scale).clamp(-127.0, 127.0))  # torch.round: half to even
    q = torch.where(scale == 0, torch.zeros_like(q), q)
    return q * scale


def _fp8(m):
    scale = _top_code_finite(m.abs().amax(1, keepdim=True) / 448.0, 448.0)
    x = _safe_div(m, scale).clamp(-448.0, 448.0)  # e4m3fn saturates at 448
    dec = x.to(torch.float8_e4m3fn).to(torch.float32)  # round to nearest even, subnormals too
    return torch.where(scale == 0, torch.zeros_like(dec), dec * scale)


def _nf4(m):
    flat = m.reshape(-1)
    n = flat.numel()
    pad = (-n) % NF4_BLOCK
    blocks = torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, NF4_BLOCK)
    absmax = blocks.abs().amax(1, keepdim=True)
    x = _safe_div(blocks, absmax)  # fp32 ratio
    codes = torch.tensor(NF4_CODES, dtype=torch.float64)
    mids = (codes[1:] + codes[:-1]) / 2  # exact midpoints, in double
    # nearest code; a tie (x exactly on a midpoint) takes the lower index
    idx = torch.searchsorted(mids, x.double().contiguous(), right=False)
    idx = torch.where(absmax == 0, torch.full_like(idx, 7), idx)
    deq = codes.float()[idx] * absmax
    return deq.reshape(-1)[:n].reshape(m.shape)


def _int4(m):
    rows, cols = m.shape
    assert cols % INT4_GROUP == 0, "int4 needs in_features divisible by 128"
    g = m.reshape(rows, cols // INT4_GROUP, INT4_GROUP)
    lo = g.amin(-1, keepdim=True).clamp(max=0.0)
    hi = g.amax(-1, keepdim=True).clamp(min=0.0)
    scale = ((hi.double() - lo.double()) / 15.0).float()
    zero = torch.round(_safe_div(-lo, scale)).clamp(0.0, 15.0)
    q = torch.round(_safe_div(g, scale) + zero).clamp(0.0, 15.0)
    deq = (q - zero) * scale
    deq = torch.where(scale == 0, torch.zeros_like(deq), deq)
    return deq.reshape(rows, cols)


_FORMATS = {"int8": _int8, "fp8": _fp8, "nf4": _nf4, "int4": _int4}


def ref_dequantize(fmt: str, w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """w quantized to `fmt` and dequantized, per the spec; shape of w, on the CPU, in
    `dtype` (default: w's dtype; the fp32 value rounded to nearest even)."""
    out = _FORMATS[fmt](_matrix(w)).reshape(w.shape)
    return out.to(dtype or w.dtype)


def error_bound(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """The stated per-element bound on |w - dequantized| (fp32), shape of w."""
    m = _matrix(w)
    if fmt == "int8":
        b = (m.abs().amax(1, keepdim=True) / 127.0 / 2).expand_as(m)
    elif fmt == "fp8":
        scale = m.abs().amax(1, keepdim=True) / 448.0
        b = scale * torch.maximum(2.0 ** -4 * _safe_div(m, scale).abs(), torch.tensor(2.0 ** -10))
    elif fmt == "nf4":
        flat = m.reshape(-1)
        n = flat.numel()
        pad = (-n) % NF4_BLOCK
        blocks = torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, NF4_BLOCK)
        half_gap = max(b - a for a, b in zip(NF4_CODES, NF4_CODES[1:])) / 2
        b = (blocks.abs().amax(1, keepdim=True) * half_gap).expand_as(blocks).reshape(-1)[:n].reshape(m.shape)
    elif fmt == "int4":
        rows, cols = m.shape
        g = m.reshape(rows, cols // INT4_GROUP, INT4_GROUP)
        scale = (g.amax(-1, keepdim=True).clamp(min=0.0).double()
                 - g.amin(-1, keepdim=True).clamp(max=0.0).double()) / 15.0
        b = (scale.float() / 2).expand_as(g).reshape(rows, cols)
    else:
        raise ValueError(fmt)
    return (b + _REL_SLACK * m.abs() + _ABS_SLACK).reshape(w.shape)


def assert_reference_values(fmt: str, original: torch.Tensor, restored: torch.Tensor, what: str = "") -> None:
    """`restored` (what the engine holds for a packed weight: detach()'s values) equals
    the reference dequantization of `original` bit for bit, and that lies within the
    format's stated bound of `original`."""
    want = ref_dequantize(fmt, original, dtype=torch.float32)
    err = (want - original.detach().cpu().float()).abs()
    bound = error_bound(fmt, original)
    assert (err <= bound).all(), f"{what}: reference {fmt} error {float((err - bound).max()):.3g} over its bound"
    got = restored.detach().cpu()
    want = want.to(got.dtype)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        raise AssertionError(f"{what}: {fmt} values differ from the reference dequantization at "
                             f"{bad.shape[0]} of {got.numel()} elements (first {bad[0].tolist()})")


def packed_names(model: torch.nn.Module) -> list:
    """Names of the parameters offload(quantize=...) packed (they are data-less stand-ins
    until detach()). Only *which* tensors were packed is read from the engine's side."""
    return [n for n, p in model.named_parameters() if p.is_meta]


def with_reference_values(model: torch.nn.Module, fmt, names) -> torch.nn.Module:
    """A deep copy of `model` (taken before offload) whose parameters `names` hold their
    reference dequantization in `fmt` (a format name, or a function name -> format)."""
    import copy

    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for n in names:
            f = fmt(n) if callable(fmt) else fmt
            params[n].copy_(ref_dequantize(f, params[n]))
    return ref
