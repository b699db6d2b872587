"""Weights that arrive already quantized (torch qint8, int8 with weight_scale,
bitsandbytes nf4, GGUF blocks) and the per-layer quantize= choice.
"""
from __future__ import annotations

import fnmatch
from typing import Optional

import torch
import torch.nn as nn

from . import _C
from ._gguf_weight import GgufWeight

LayerstreamError = _C.LayerstreamError


def _quant_for(name: str, quantize) -> Optional[str]:
    """The quantization format for layer `name`: quantize is None, a format
    name, or a dict of glob pattern -> format (None = keep dense); the first
    matching pattern wins."""
    if quantize is None:
        return None
    if isinstance(quantize, str):
        return quantize
    if isinstance(quantize, dict):
        for pattern, fmt in quantize.items():
            if fnmatch.fnmatchcase(name, pattern):
                return fmt
        return None
    raise TypeError(f"quantize must be None, a format name or a dict of pattern -> format, "
                    f"got {type(quantize).__name__}")


class _Packed:
    """A weight that arrives already packed: stored byte for byte."""

    __slots__ = ("format", "codes", "scales", "rows", "cols", "dense_dtype", "bnb_stats", "gguf")

    def __init__(self, format, codes, scales, rows, cols, dense_dtype, bnb_stats=None, gguf=False):
        self.format, self.codes, self.scales = format, codes, scales
        self.rows, self.cols, self.dense_dtype = int(rows), int(cols), dense_dtype
        self.bnb_stats = bnb_stats  # bitsandbytes: what detach() needs to rebuild Params4bit
        self.gguf = gguf  # load_gguf()'s bytes: detach() restores the dequantized weight


def _is_packed_only_format(fmt: str) -> bool:
    """A format the engine streams but does not quantize to (GGUF's q8_0 .. q6_k)."""
    try:
        _C.quant_packed_bytes(fmt, 0, 256)
        return True
    except LayerstreamError:
        return False


_DEQUANT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_CORE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}  # quant::to_string(OutDtype)


def _bnb_nf4(name: str, w) -> Optional[_Packed]:
    """A bitsandbytes Params4bit weight (Linear4bit), quantized: its NF4 codes
    (2 per byte, high nibble first) and fp32 absmax per block of 64 are our
    nf4 layout, so they are taken as they are."""
    qs = getattr(w, "quant_state", None)
    if qs is None:
        if getattr(w, "bnb_quantized", True) is False:
            raise LayerstreamError(
                f"layer '{name}': its bitsandbytes 4-bit weight is not quantized yet (bitsandbytes "
                f"quantizes when the module moves to a device); move it first, or offload the "
                f"unquantized model with offload(quantize='nf4')")
        return None
    if qs.quant_type != "nf4" or qs.blocksize != 64:
        raise LayerstreamError(
            f"layer '{name}': bitsandbytes {qs.quant_type} weights with blocksize {qs.blocksize} are "
            f"not supported (layerstream takes nf4 with blocks of 64); dequantize the model or load "
            f"it unquantized and use offload(quantize='nf4')")
    code = qs.code.detach().float().cpu()
    if code.numel() != 16 or not torch.equal(code, torch.tensor(_C.nf4_codes(), dtype=torch.float32)):
        raise LayerstreamError(f"layer '{name}': its bitsandbytes nf4 code table is not the standard one")
    if qs.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise LayerstreamError(f"layer '{name}': bitsandbytes dtype {qs.dtype} is not supported")
    absmax = qs.absmax
    if qs.nested:  # double quantization: absmax itself is blockwise-quantized
        import bitsandbytes.functional as bnbF
        absmax = bnbF.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    rows, cols = int(qs.shape[0]), int(qs.shape[1])
    stats = {k: (v.detach().cpu() if torch.is_tensor(v) else v)
             for k, v in qs.as_dict(packed=True).items()}
    return _Packed("nf4", w.detach().reshape(-1).cpu(), absmax.detach().float().cpu(), rows, cols,
                   qs.dtype, stats)


def _prequantized(name: str, module: nn.Module) -> Optional[_Packed]:
    """The weight when it is already quantized: a torch quantized tensor
    (qint8, zero points 0) or an int8 tensor with a `weight_scale` attribute
    (int8, dense float32), or a bitsandbytes nf4 Params4bit. None for float
    weights."""
    w = module.weight
    if type(w).__name__ == "Params4bit":
        return _bnb_nf4(name, w)
    if isinstance(w, GgufWeight):
        return _Packed(w.gguf_format, w.gguf_bytes, torch.empty(0), w.shape[0], w.shape[1], w.dtype, gguf=True)
    rows = w.shape[0]
    if w.is_quantized:
        if w.dtype != torch.qint8:
            raise LayerstreamError(f"quantized weight dtype {w.dtype} is not supported; use qint8")
        scheme = w.qscheme()
        if scheme in (torch.per_channel_affine, torch.per_channel_symmetric):
            if w.q_per_channel_axis() != 0 or bool((w.q_per_channel_zero_points() != 0).any()):
                raise LayerstreamError(
                    "per-channel quantized weights must use axis 0 and zero points 0 (symmetric); "
                    "dequantize them first or use offload(quantize='int8')")
            return _Packed("int8", w.int_repr(), w.q_per_channel_scales().float(), rows,
                           w.numel() // max(rows, 1), torch.float32)
        if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            if w.q_zero_point() != 0:
                raise LayerstreamError(
                    "per-tensor quantized weights must use zero point 0; dequantize them first or "
                    "use offload(quantize='int8')")
            return _Packed("int8", w.int_repr(), torch.tensor([w.q_scale()], dtype=torch.float32), rows,
                           w.numel() // max(rows, 1), torch.float32)
        raise LayerstreamError(f"unsupported quantization scheme {scheme}")
    if not w.dtype.is_floating_point:
        scale = getattr(module, "weight_scale", None)
        if w.dtype != torch.int8 or scale is None:
            raise LayerstreamError(
                f"an integer weight ({w.dtype}) needs dtype int8 and a `weight_scale` attribute "
                f"(one fp32 scale per output row, or one for the tensor) to be streamed")
        return _Packed("int8", w.detach(), torch.as_tensor(scale, dtype=torch.float32), rows,
                       w.numel() // max(rows, 1), torch.float32)
    return None
