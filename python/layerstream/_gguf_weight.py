"""GgufWeight: the stand-in parameter of a weight load_gguf() keeps packed
(the file's bytes beside a data-less meta tensor). Its own room so that module
discovery (_discovery) can recognise it without importing the loader."""
from __future__ import annotations

import torch

from . import _C, _standin

LayerstreamError = _C.LayerstreamError


class GgufWeight(_standin.StandIn):
    """The weight of a Linear layer that load_gguf() keeps packed: data-less (a
    meta tensor of the weight's shape and dtype) with the file's bytes beside it
    (``gguf_format``: "q4_k", ...; ``gguf_bytes``: a CPU uint8 tensor). offload()
    streams those bytes and dequantizes them on the device; run the model only
    after offload(). Frozen (requires_grad False). Its ``.device`` is the CPU,
    where the bytes are (``is_meta`` is True): peft then creates LoRA adapters
    over it in host memory instead of on the meta device."""

    def __new__(cls, shape, dtype, fmt: str, data: torch.Tensor, name: str):
        self = cls._meta(shape, dtype)
        self.gguf_format, self.gguf_bytes, self.gguf_name = fmt, data, name
        return self

    _CARRIED = ("gguf_format", "gguf_bytes", "gguf_name")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return cls._read_only(func, types, args, kwargs)  # _standin.StandIn's rules

    def _not_possible(self, what: str) -> str:
        return (f"the weight of '{self.gguf_name}' is GGUF {self.gguf_format} bytes that load_gguf() kept "
                f"packed (a data-less stand-in), so {what} is not possible: ")

    def _refusal(self, what: str) -> str:
        return (self._not_possible(what) + "call layerstream.offload(model, ...) to run the model (the bytes "
                "stream to the device and are dequantized there); handle.detach() afterwards leaves dense, "
                "dequantized weights, and GgufWeight.dequantized() gives one weight's values")

    def _write_refusal(self, what: str) -> str:
        return (self._not_possible(what) + "the file's blocks would stay as they are. To change its values (e.g. "
                "peft's merge_and_unload(), a .data write), make it dense first: module.weight = "
                "torch.nn.Parameter(module.weight.dequantized(), requires_grad=False), or offload() and then "
                "handle.detach() (dense, dequantized weights)")

    def _load_refusal(self) -> str:
        return (self._not_possible(_standin.LOADING) + "the file's blocks would stay as they are. Load with "
                "load_state_dict(..., assign=True) before offload(), which puts the loaded tensors in place of the "
                "file's, or offload(), handle.detach() (dense, dequantized weights), then load")

    def _save_refusal(self) -> str:
        return self._refusal(f"saving it ({_standin.SAVERS})") + "; save the .gguf file's path instead"

    def __deepcopy__(self, memo):
        # The copy shares the file's bytes (nothing writes them).
        out = GgufWeight(self.shape, self.dtype, self.gguf_format, self.gguf_bytes, self.gguf_name)
        memo[id(self)] = out
        return out

    def __repr__(self):
        return (f"GgufWeight({self.gguf_format}, shape {tuple(self.shape)}, dense dtype {self.dtype}, "
                f"{self.gguf_bytes.numel()} bytes on the host)")

    def dequantized(self) -> torch.Tensor:
        """The dense weight (CPU, the parameter's dtype), bit-identical to gguf-py's
        dequantize() of the same bytes (rounded to the dtype)."""
        cols = self.shape[-1]
        rows = self.numel() // max(cols, 1)
        return _C.dequantize_packed(self.gguf_format, self.gguf_bytes, rows, cols, self.dtype).reshape(self.shape)
