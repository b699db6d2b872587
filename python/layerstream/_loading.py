"""What the checkpoint loaders (load_gguf, load_safetensors) share: the report,
where each tensor of the model lives, the rename rule, strict checking and the
assignment of loaded values (meta or real targets, tied tensors kept tied)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Mapping, Optional, Union

import torch
import torch.nn as nn

from . import _C

LayerstreamError = _C.LayerstreamError

Rename = Union[None, Callable[[str], Optional[str]], Mapping[str, Optional[str]]]


@dataclasses.dataclass
class LoadReport:
    """What load_gguf() / load_safetensors() did, by parameter name."""
    packed: List[str]         # load_gguf: Linear weights and tensor-group (expert) tensors kept packed (GgufWeight)
    dense: List[str]          # loaded into the model's tensors (cast to their dtype)
    dequantized: List[str]    # load_gguf: quantized in the file, dequantized on load (not a Linear weight)
    missing: List[str]        # parameters / persistent buffers of the model not in the file
    unexpected: List[str]     # tensors of the file that name nothing in the model
    metadata: Dict[str, str]  # the file's key/value metadata (GGUF arrays summarized)
    packed_bytes: int = 0     # load_gguf: host bytes of the packed weights
    # load_safetensors: weights left in their file (FileWeight) until offload() reads them
    # into host memory or streams them from disk, and their bytes.
    in_file: List[str] = dataclasses.field(default_factory=list)
    in_file_bytes: int = 0


def tensor_slots(model: nn.Module):
    """(slots, holders, persistent): by qualified name, (owner module, key, tensor) of
    every parameter and buffer; by tensor id, every (module, key) holding it; the
    names of parameters and persistent buffers (what a checkpoint must have)."""
    slots: Dict[str, tuple] = {}
    holders: Dict[int, list] = {}
    persistent = set()
    for mname, mod in model.named_modules(remove_duplicate=False):
        for k, t in list(mod._parameters.items()) + list(mod._buffers.items()):
            if t is None:
                continue
            qn = f"{mname}.{k}" if mname else k
            slots[qn] = (mod, k, t)
            holders.setdefault(id(t), []).append((mod, k))
            if k in mod._parameters or k not in mod._non_persistent_buffers_set:
                persistent.add(qn)
    return slots, holders, persistent


def renamed(rename: Rename, src: str):
    """The model name `rename` gives the file's tensor `src` (None: skipped)."""
    if rename is None:
        return src
    if callable(rename):
        return rename(src)
    return rename.get(src, src)


def check_strict(who: str, missing: List[str], unexpected: List[str]) -> None:
    """strict=True: the file and the model must name the same tensors."""
    if not (missing or unexpected):
        return
    parts = []
    if unexpected:
        parts.append(f"{len(unexpected)} tensor(s) of the file name nothing in the model: "
                     f"{', '.join(unexpected[:5])}{', ...' if len(unexpected) > 5 else ''}")
    if missing:
        parts.append(f"{len(missing)} parameter(s)/buffer(s) of the model are not in the file: "
                     f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}")
    raise LayerstreamError(f"{who}: " + "; ".join(parts) +
                           ". Map the names with rename= (a dict or a function of the file's name), "
                           "or pass strict=False to load what matches")


def check_kind(where: str, tensor: str, file_type: str, file_dtype: torch.dtype, dst: str,
               target: torch.Tensor) -> None:
    """The loaders' one rule on dtypes: a floating-point tensor and an integer one do
    not load into each other (the cast would truncate 0.7 to 0, or make indices floats,
    silently); a bool target takes either (nonzero is True). `file_type` is the
    file's name for its type (safetensors' "F32", GGUF's "I32")."""
    if file_dtype.is_floating_point != target.dtype.is_floating_point and target.dtype != torch.bool:
        raise LayerstreamError(f"{where}: tensor '{tensor}' is {file_type} but '{dst}' in the model is "
                               f"{target.dtype}; a floating-point tensor and an integer one do not load into "
                               f"each other")


def put(holders, target: torch.Tensor, new_t: torch.Tensor) -> None:
    """Puts `new_t` (a tensor of target's dtype) in every place that holds `target`
    (tied stay tied); a parameter stays a parameter with its requires_grad."""
    if isinstance(target, nn.Parameter) and not isinstance(new_t, nn.Parameter):
        new_t = nn.Parameter(new_t, requires_grad=target.requires_grad and new_t.is_floating_point())
    for m, k in holders:
        if k in m._parameters:
            m._parameters[k] = new_t
        else:
            m._buffers[k] = new_t


def assign(holders, target: torch.Tensor, value: torch.Tensor, replace: bool, fresh: bool = False) -> None:
    """Writes `value` into `target` (in place, cast), or, when `replace` (a meta
    target, or a stand-in), puts a new tensor of its dtype in every place that
    holds it: `value` itself when `fresh` (memory of its own) and of that dtype,
    else a copy."""
    if replace:
        new_t = value.to(target.dtype)
        put(holders, target, new_t if fresh or new_t is not value else value.clone())
        return
    with torch.no_grad():
        target.copy_(value)
