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

    __slots__ = ("format", "codes", "scales", "rows", "cols", "dense_dtype", "bnb_stats", "gguf",
                 "library", "out_scale")

    def __init__(self, format, codes, scales, rows, cols, dense_dtype, bnb_stats=None, gguf=False,
                 library=None, out_scale=None):
        self.format, self.codes, self.scales = format, codes, scales
        self.rows, self.cols, self.dense_dtype = int(rows), int(cols), dense_dtype
        self.bnb_stats = bnb_stats  # bitsandbytes: what detach() needs to rebuild Params4bit
        self.gguf = gguf  # load_gguf()'s bytes: detach() restores the dequantized weight
        # A library's tensor (_library_quantized): how that library computes the layer
        # (_LIBRARY_LINEAR); the bias is then added after the product, not in it.
        self.library = library
        self.out_scale = out_scale  # torchao int8: fp32 [rows], applied to the product


def _quantize_format(fmt: str) -> Optional[str]:
    """A quantize= format name as C++'s quant::parse_format reads it (one rule for C++,
    Python and the command line: _C.quant_format): any case, fp8's other names, "none"
    (and "", as OffloadOptions::quantize) for None. Anything else is a ValueError with
    parse_format's own message (a GGUF name's says where such weights come from)."""
    try:
        name = _C.quant_format(fmt)
    except LayerstreamError as e:
        raise ValueError(f"{e} (or None to keep a layer dense)") from None
    return None if name == "none" else name


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
    # The codes' container (bnb_4bit_quant_storage, e.g. bfloat16 for FSDP-QLoRA) holds
    # the same bytes: taken as bytes, given back in it by detach().
    codes = w.detach().reshape(-1)
    stats[_BNB_STORAGE] = codes.dtype
    if codes.dtype != torch.uint8:
        codes = codes.view(torch.uint8)
    return _Packed("nf4", codes.cpu(), absmax.detach().float().cpu(), rows, cols, qs.dtype, stats)


# bnb_stats' entry (not bitsandbytes'): the dtype a Params4bit's codes were stored in.
_BNB_STORAGE = "layerstream.quant_storage"


class BnbQuantStateKeys:
    """state_dict() post-hook of a bitsandbytes Linear4bit that offload() streams. bitsandbytes
    adds its quant state's keys (weight.absmax, weight.quant_map, weight.nested_*,
    weight.quant_state.bitsandbytes__nf4) from weight.quant_state, which the data-less stand-in
    has not: state_dict() lacked them without a word. They are added from the host copies
    offload() keeps for detach() (bnb_stats), as copies (a write into them would change what
    detach() rebuilds, not what streams); the same keys, in the same order, as resident."""

    def __init__(self, stats: dict):
        self._stats = stats

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        for k, v in self._stats.items():
            if k != _BNB_STORAGE:
                state_dict[prefix + "weight." + k] = v.clone() if torch.is_tensor(v) else v


def _prequantized(name: str, module: nn.Module) -> Optional[_Packed]:
    """The weight when it is already quantized: a torch quantized tensor
    (qint8, zero points 0) or an int8 tensor with a `weight_scale` attribute
    (int8, dense float32), a bitsandbytes nf4 Params4bit, a GGUF weight, or an
    optimum-quanto / torchao weight (_library_quantized). None for float
    weights."""
    w = module.weight
    lib = _library_quantized(name, w)
    if lib is not None:
        return lib
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


# The quantized weight tensors of optimum-quanto and torchao that stream packed
# (layerstream.compat): class -> (library, what it is). A weight of another class
# from these libraries (quanto qint4/qint2, torchao int4, ...) is refused by name.
_QUANTO_QBYTES = "WeightQBytesTensor"            # quantize(weights=qint8 / qfloat8), freeze()
_TORCHAO_TENSORS = ("Int8Tensor", "Float8Tensor")  # Int8WeightOnlyConfig, Float8WeightOnlyConfig


def _library_of(w) -> Optional[str]:
    """"quanto" / "torchao" for a weight tensor of optimum-quanto or torchao (a tensor
    subclass that holds its packed data and scales as attributes), else None."""
    mod = type(w).__module__
    if mod.startswith("optimum.quanto."):
        return "quanto"
    if mod.startswith("torchao."):
        return "torchao"
    return None


def _row_scales(name: str, scale: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    """fp32 [rows] scales from one per row ([rows, 1]) or one for the tensor."""
    if scale.numel() == 1:
        return scale.detach().float().reshape(1).expand(rows).contiguous()
    if scale.numel() == rows and scale.dim() <= 2 and scale.shape[0] == rows:
        return scale.detach().float().reshape(rows).contiguous()
    raise LayerstreamError(
        f"layer '{name}': its {what} weight has scales of shape {tuple(scale.shape)}; layerstream "
        f"streams one scale per output row or one per tensor (per-group or block scales are not "
        f"supported): quantize per row, or dequantize the layer")


def _library_quantized(name: str, w) -> Optional[_Packed]:
    """The packed codes and scales of an optimum-quanto or torchao weight-only
    quantized weight, None for any other tensor:
      quanto qint8 / qfloat8 (WeightQBytesTensor, axis 0): int8 / float8_e4m3fn
        codes, one scale per row (the model's dtype); quanto computes
        (x @ (scale * q)^T) + bias (qbytes_mm outside its CPU int8 kernels);
      torchao Int8Tensor (Int8WeightOnlyConfig, per row or per tensor): int8
        codes, fp32 scales applied to the product: (x @ q^T) * scale + bias;
        the slot holds q (unit scales) and the scale follows the product, as
        torchao does, so the rounding is torchao's;
      torchao Float8Tensor (Float8WeightOnlyConfig, per row or per tensor):
        float8_e4m3fn codes, fp32 scales; torchao computes
        (x @ dequantize(w)^T) + bias.
    Anything else from these libraries (activation quantization, 4-bit and 2-bit
    weights, per-group scales, other float8 kinds) is a LayerstreamError that
    says so."""
    library = _library_of(w)
    if library is None:
        return None
    cls = type(w).__name__
    rows = int(w.shape[0]) if w.dim() >= 1 else 0
    cols = w.numel() // max(rows, 1)
    dense = w.dtype
    if dense not in _DEQUANT_DTYPES:
        raise LayerstreamError(f"layer '{name}': {library} weight of dtype {dense}; layerstream streams "
                               f"quantized weights of float32, bfloat16 or float16 models")
    if w.dim() != 2:
        raise LayerstreamError(f"layer '{name}': {library} weight of shape {tuple(w.shape)}; "
                               f"only 2-D (Linear) weights stream")
    if library == "quanto":
        qtype = getattr(getattr(w, "qtype", None), "name", None)
        if cls != _QUANTO_QBYTES or qtype not in ("qint8", "qfloat8_e4m3fn"):
            raise LayerstreamError(
                f"layer '{name}': optimum-quanto {cls} ({qtype}) weights are not supported; "
                f"layerstream streams quanto qint8 and qfloat8 (e4m3fn) weights: quantize with "
                f"weights=qint8 or qfloat8, or exclude the layer (ignore_modules=[...])")
        if getattr(w, "activation_qtype", None) is not None or getattr(w, "axis", 0) != 0:
            raise LayerstreamError(
                f"layer '{name}': optimum-quanto weight with activation quantization or axis "
                f"{getattr(w, 'axis', None)}; layerstream streams weight-only quantization along "
                f"the output rows (quantize(model, weights=...), activations=None)")
        data = w._data
        fmt = "int8" if data.dtype == torch.int8 else "fp8"
        if fmt == "fp8" and data.dtype != torch.float8_e4m3fn:
            raise LayerstreamError(f"layer '{name}': optimum-quanto data of dtype {data.dtype}")
        return _Packed(fmt, data.detach().view(torch.uint8 if fmt == "fp8" else torch.int8).cpu(),
                       _row_scales(name, w._scale, rows, "quanto").cpu(), rows, cols, dense,
                       library="quanto")
    if cls not in _TORCHAO_TENSORS:
        raise LayerstreamError(
            f"layer '{name}': torchao {cls} weights are not supported; layerstream streams torchao "
            f"int8 and float8 weight-only tensors (Int8WeightOnlyConfig, Float8WeightOnlyConfig): "
            f"quantize with one of those, or exclude the layer (ignore_modules=[...])")
    if (getattr(w, "act_quant_kwargs", None) is not None
            or getattr(w, "act_pre_scale", None) is not None):
        raise LayerstreamError(
            f"layer '{name}': torchao {cls} with activation quantization or pre-scaling; layerstream "
            f"streams weight-only quantization (Int8WeightOnlyConfig, Float8WeightOnlyConfig)")
    qdata = w.qdata
    block = list(getattr(w, "block_size", None) or [1, cols])
    if block not in ([1, cols], [rows, cols]):
        raise LayerstreamError(
            f"layer '{name}': torchao {cls} with block size {block}; layerstream streams one scale "
            f"per output row or per tensor: quantize with granularity PerRow() or PerTensor()")
    if cls == "Int8Tensor":
        zp = getattr(w, "zero_point", None)
        if (zp is not None and bool(zp.detach().ne(0).any())) or qdata.dtype != torch.int8:
            raise LayerstreamError(f"layer '{name}': torchao Int8Tensor with zero points (asymmetric); "
                                   f"layerstream streams symmetric int8 weights")
        scales = _row_scales(name, w.scale, rows, "torchao int8").cpu()
        return _Packed("int8", qdata.detach().cpu(), torch.ones(rows, dtype=torch.float32), rows, cols,
                       dense, library="torchao_int8", out_scale=scales)
    if qdata.dtype != torch.float8_e4m3fn:
        raise LayerstreamError(f"layer '{name}': torchao Float8Tensor of {qdata.dtype}; layerstream "
                               f"streams float8_e4m3fn weights")
    return _Packed("fp8", qdata.detach().view(torch.uint8).cpu(),
                   _row_scales(name, w.scale, rows, "torchao float8").cpu(), rows, cols, dense,
                   library="torchao_fp8")


def _library_linear(pre: _Packed, run, x: torch.Tensor, bias, out_scale) -> torch.Tensor:
    """A library-quantized Linear computed as its library computes it
    (_library_quantized), `run(x)` being the streamed product x @ W^T with the
    slot's dequantized W (no bias); `bias` / `out_scale` on the compute device."""
    if pre.library == "torchao_fp8":
        y = run(x)
    else:  # quanto and torchao int8 multiply the rows of the input as one matrix
        flat = x.reshape(-1, x.shape[-1])
        if pre.library == "quanto":
            flat = flat.to(pre.dense_dtype)  # quanto casts the input to its scales' dtype
        y = run(flat)
        if pre.library == "torchao_int8":
            y = y * out_scale.to(y.dtype)
        y = y.reshape(*x.shape[:-1], pre.rows)
    return y if bias is None else y + bias
