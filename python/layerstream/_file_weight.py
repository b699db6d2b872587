"""FileWeight: the stand-in parameter of a weight load_safetensors() leaves in
its file until offload() (a data-less meta tensor beside where its bytes are).
Its own room so that offload() can recognise it without importing the loader."""
from __future__ import annotations

import torch

from . import _C, _standin

LayerstreamError = _C.LayerstreamError


class FileWeight(_standin.StandIn):
    """A weight (or bias) of a Linear layer that load_safetensors() left in its
    .safetensors file: data-less (a meta tensor of the model parameter's shape and
    dtype) with the file's path and byte range beside it (``file_range``, a
    ``_C.FileRange``) and the dtype the file holds (``file_dtype``: another floating
    dtype is cast as read, and such a weight is always read into RAM). offload()
    reads it straight into host memory (this object then becomes an ordinary
    Parameter, so what holds it keeps it: an optimizer built before), or, when the host budget cannot hold it and
    it is frozen, streams it from the file on every use (the disk tier); run the
    model only after offload(). ``requires_grad`` is the model parameter's: a
    trainable one is always read into RAM. Its ``.device`` is the CPU, where its
    bytes will be (peft then creates LoRA adapters over it in host memory).
    ``read()`` gives its values."""

    def __new__(cls, shape, dtype, file_range, name: str, requires_grad: bool = False, file_dtype=None):
        self = cls._meta(shape, dtype)
        self.requires_grad_(requires_grad)
        self.file_range, self.file_name = file_range, name
        self.file_dtype = dtype if file_dtype is None else file_dtype
        self._disk_tier = False  # set while an offload() streams it from its file (the disk tier)
        return self

    _CARRIED = ("file_range", "file_name", "file_dtype", "_disk_tier")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return cls._read_only(func, types, args, kwargs)  # _standin.StandIn's rules

    def _refusal(self, what: str, write: bool = False, load: bool = False) -> str:
        r = self.file_range
        change = ("To load new values, " if load else
                  "To change them (e.g. peft's merge_and_unload(), a .data write), " if write else "")
        if getattr(self, "_disk_tier", False):
            return (f"'{self.file_name}' streams from its file ({r.path}, tensor '{r.tensor}') on every use: "
                    f"offload(host_budget=...) left this frozen weight there (the disk tier), so {what} is not "
                    "possible; the file holds its values unchanged. " + (
                        change + "call handle.detach(), then offload() again with a host_budget= that holds "
                        "it in host memory" if write or load else
                        "FileWeight.read() gives them (for a state dict to save: {k: v.read() if isinstance(v, "
                        "layerstream.FileWeight) else v for k, v in sd.items()}, or save only the trainable "
                        "tensors, as peft's save_pretrained() does)"))
        return (f"'{self.file_name}' is still in its file ({r.path}, tensor '{r.tensor}'): load_safetensors() "
                f"left it there for offload() to read into host memory or stream from disk, so {what} is "
                f"not possible yet. " + (
                    "The file's values would stay as they are. " + change + "call layerstream.offload(model, "
                    "...) first (a weight it reads into host memory becomes an ordinary parameter), or " + (
                        "load_state_dict(..., assign=True), which puts the loaded tensors in place of the "
                        "file's" if load else
                        "put its values in its place: module.weight = torch.nn.Parameter(module.weight.read())")
                    if write or load else
                    "Call layerstream.offload(model, ...) to run the model, or FileWeight.read() for one "
                    "weight's values"))

    def _write_refusal(self, what: str) -> str:
        return self._refusal(what, write=True)

    def _load_refusal(self) -> str:
        return self._refusal(_standin.LOADING, load=True)

    def __deepcopy__(self, memo):
        out = FileWeight(self.shape, self.dtype, self.file_range, self.file_name, self.requires_grad,
                         self.file_dtype)
        memo[id(self)] = out
        return out

    def __repr__(self):
        r = self.file_range
        cast = "" if self.file_dtype == self.dtype else f" (read from {self.file_dtype})"
        return f"FileWeight({r.path}:{r.tensor}, shape {tuple(self.shape)}, {self.dtype}{cast}, {r.bytes} bytes)"

    def read(self) -> torch.Tensor:
        """Its values: a new CPU tensor read from the file (checked: the file must be
        the one loaded, unchanged), in its dtype (cast from ``file_dtype``)."""
        out = torch.empty(tuple(self.shape), dtype=self.file_dtype)
        r = self.file_range
        if r.bytes != out.nbytes:  # else a prefix of its bytes (or more) decoded in another dtype: wrong values
            raise LayerstreamError(
                f"'{self.file_name}': tensor '{r.tensor}' has {r.bytes} bytes in {r.path}, but "
                f"{list(self.shape)} of {self.file_dtype} (its file_dtype) needs {out.nbytes}; this FileWeight "
                f"does not describe its file: load the model with load_safetensors() again")
        _C.read_file_into(r.path, r.offset, out, r.tensor, r.identity)
        return out.to(self.dtype)
