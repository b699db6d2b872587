"""load_safetensors(): a .safetensors checkpoint (one file, shards with an index,
or a transformers / diffusers directory) into a model, without a dense copy of
the weights that will stream.

The headers are read and checked by the C++ reader (``_C.read_checkpoint``,
csrc/core/safetensors.h); tensor bytes are read by ``_C.read_file_into`` (pread in
large chunks on reader threads, csrc/core/io/source_file.h). The weights and biases
of Linear layers that offload() streams stay in the file as ``FileWeight``
stand-ins: offload() reads each straight into its host store (one copy), or leaves
it there and streams it from disk when the host budget cannot hold it
(docs/design/host-tier.md). Everything else is read into the model's tensors.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn as nn

from . import _C
from ._file_weight import FileWeight
from ._loading import LoadReport, Rename, assign, check_kind, check_strict, put, renamed, tensor_slots

LayerstreamError = _C.LayerstreamError

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _stays_in_file(holders, target: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a tensor can stay in its file until offload(): the weight or bias of
    Linear layers that offload() streams as such (torch's own forward), floating point
    in the file and in the model (another dtype is cast as read), held by nothing else."""
    from ._discovery import _is_streamable, _stock_forward
    if not isinstance(target, nn.Parameter) or not (target.is_meta or isinstance(target, FileWeight)):
        return False
    if not (dtype.is_floating_point and target.dtype.is_floating_point):
        return False
    return all(k in ("weight", "bias") and m._parameters.get(k) is target and _is_streamable(m) == "linear"
               and _stock_forward(m, "linear") for m, k in holders)


def load_safetensors(model: nn.Module, path: str, *, strict: bool = True, rename: Rename = None) -> LoadReport:
    """Loads a safetensors checkpoint into `model` by name.

    ``path`` is a ``.safetensors`` file, a sharded checkpoint's
    ``*.safetensors.index.json``, or a directory holding one of them (a transformers
    model directory, or a diffusers component's, e.g. ``.../transformer``). A
    diffusers pipeline's root (``model_index.json``) is an error naming the folder to
    pass; a sharded variant (``save_pretrained(variant="fp16")``) loads from its index.

    * The weights and biases of ``nn.Linear`` layers that offload() streams, when the
      model is built without weights (``accelerate.init_empty_weights()`` or
      ``torch.device("meta")``), are not read: each becomes a ``FileWeight``
      (data-less, its file range beside it, ``requires_grad`` as the parameter had
      it). offload() reads it straight into its host store (pinned where allowed;
      one copy, no dense model copy ever), or, when ``host_budget`` cannot hold it,
      it is frozen and the file holds the model's dtype, streams it from the file
      on every use. A file in another floating dtype (an fp32 checkpoint for a bf16
      model) is cast as offload() reads it, as ``Tensor.to()`` rounds. Run the
      model after offload().
    * Everything else (norms, embeddings, convolutions, buffers, and every tensor
      of a model that has real weights) is
      read into the model: a meta tensor gets a new tensor (tied stay tied; tie
      them before loading, e.g. transformers' ``model.tie_weights()``), a real one is
      written in place, cast to its dtype.

    ``rename`` maps the file's tensor names to the model's (a dict or a callable; a
    name mapped to None is skipped). ``strict`` (default) raises, before anything
    changes, when the file has tensors the model lacks or the model has parameters or
    persistent buffers the file lacks; with ``strict=False`` those are listed in the
    result. Shapes must match. Every check (headers, shards, names, shapes, dtypes)
    and every read happens before the model changes: an error leaves it as it was.
    The files must not change while the model uses them: every later read (offload()
    included) checks that each is the file whose header was read here (size,
    modification time, inode) and raises instead of using other bytes.

    Returns a ``LoadReport`` (the type load_gguf() returns): ``dense`` (read into the
    model), ``in_file`` (left in the file) and its bytes, ``missing``,
    ``unexpected``, the files' ``__metadata__``. Not thread-safe with other users of
    the model."""
    from ._packed import _PackedWeight, install_refused_loads
    if any(hasattr(p, "_is_memory_managed") or isinstance(p, _PackedWeight) for p in model.parameters()):
        raise LayerstreamError("load_safetensors(): the model is offloaded (layerstream holds its weights); call "
                               "handle.detach() first, then load_safetensors() and offload() again")
    who = f"load_safetensors({str(path)!r})"
    ck = _C.read_checkpoint(str(path))
    slots, holders, persistent = tensor_slots(model)
    plan = []  # (record, model name)
    unexpected, loaded_by = [], {}
    for rec in ck["tensors"]:
        dst = renamed(rename, rec["name"])
        if dst is None:
            continue
        if dst not in slots:
            unexpected.append(rec["name"] if dst == rec["name"] else f"{rec['name']} (as {dst})")
            continue
        first = loaded_by.setdefault(id(slots[dst][2]), (rec["name"], dst))
        if first[1] != dst or first[0] != rec["name"]:
            raise LayerstreamError(
                f"{who}: '{first[0]}' and '{rec['name']}' of the checkpoint both load into one tensor of the "
                f"model ('{first[1]}'{'' if first[1] == dst else f' and its tied name {dst!r}'}); skip one with "
                f"rename= (map it to None) or untie them")
        plan.append((rec, dst))
    missing = sorted(n for n in persistent if id(slots[n][2]) not in loaded_by)
    if strict:
        check_strict(who, missing, unexpected)
    for rec, dst in plan:
        target = slots[dst][2]
        if rec["dtype"] not in _DTYPES:
            raise LayerstreamError(f"{rec['file']}: tensor '{rec['name']}' is {rec['dtype']}, which torch "
                                   f"cannot hold; supported: {', '.join(_DTYPES)}")
        if tuple(rec["shape"]) != tuple(target.shape):
            raise LayerstreamError(f"{rec['file']}: tensor '{rec['name']}' has shape {list(rec['shape'])} but "
                                   f"'{dst}' in the model is {list(target.shape)}")
        check_kind(rec["file"], rec["name"], rec["dtype"], _DTYPES[rec["dtype"]], dst, target)
    # Read everything that is read now before anything changes (an I/O error or a
    # file changed since its header was read leaves the model as it was).
    out = LoadReport([], [], [], missing, unexpected, dict(ck["metadata"]))
    values: Dict[str, torch.Tensor] = {}
    for rec, dst in plan:
        _, _, target = slots[dst]
        dtype = _DTYPES[rec["dtype"]]
        if _stays_in_file(holders[id(target)], target, dtype):
            continue
        value = torch.empty(tuple(rec["shape"]), dtype=dtype)
        _C.read_file_into(rec["file"], rec["offset"], value, rec["name"], rec["identity"])
        values[dst] = value
    for rec, dst in plan:
        _, _, target = slots[dst]
        if dst in values:
            assign(holders[id(target)], target, values.pop(dst),
                   replace=target.is_meta or isinstance(target, FileWeight), fresh=True)
            out.dense.append(dst)
            continue
        fr = _C.FileRange(rec["file"], rec["offset"], rec["nbytes"], rec["name"], rec["identity"])
        put(holders[id(target)], target, FileWeight(tuple(target.shape), target.dtype, fr, dst,
                                                    requires_grad=target.requires_grad,
                                                    file_dtype=_DTYPES[rec["dtype"]]))
        out.in_file.append(dst)
        out.in_file_bytes += rec["nbytes"]
    if out.in_file:
        install_refused_loads(model)  # load_state_dict() into a FileWeight: refused before any key is written
    return out
