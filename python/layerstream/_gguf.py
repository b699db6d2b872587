"""GGUF files (llama.cpp / ggml, also used for diffusion models): load_gguf().

The file's header is read by the C++ reader (``_C.gguf_read``, csrc/core/gguf.h);
the tensor data is read here, tensor by tensor, into host memory. Quantized
tensors of Linear weights stay packed as they are in the file (``GgufWeight``)
and offload() streams those bytes, dequantized on the device; everything else
is loaded into the model's own parameters and buffers.
"""
from __future__ import annotations

import ctypes
import math
import re
from typing import Callable, Dict, List, Mapping, Optional, Union

import torch
import torch.nn as nn

from . import _C
from ._gguf_weight import GgufWeight
from ._loading import LoadReport, assign, check_kind, check_strict, renamed, tensor_slots

LayerstreamError = _C.LayerstreamError

# ggml element types and the torch dtype their bytes are.
_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}
_DENSE = (torch.float32, torch.bfloat16, torch.float16)


# load_gguf()'s report (the loaders share it).
GgufLoad = LoadReport


def _orig_shape(meta: Mapping[str, str], name: str) -> Optional[tuple]:
    """ComfyUI-GGUF's converter stores the shape of tensors it reshaped for
    quantization under comfy.gguf.orig_shape.<name>."""
    text = meta.get(f"comfy.gguf.orig_shape.{name}")
    if not text:
        return None
    nums = re.findall(r"-?\d+", text)
    return tuple(int(n) for n in nums) if nums else None


def _streams_packed(mod: nn.Module, key: str, target: torch.Tensor) -> bool:
    """Whether `mod`'s tensor `key` streams as a GGUF file's blocks: the weight of a
    Linear that streams as one (torch's own forward), or a tensor of 2+ dimensions of
    a module offload() streams as a tensor group (mixture-of-experts weights)."""
    from ._discovery import _is_streamable, _stock_forward
    if mod._parameters.get(key) is not target:
        return False
    kind = _is_streamable(mod)
    if kind == "linear":
        return key == "weight" and _stock_forward(mod, "linear")
    return kind == "group" and target.dim() >= 2


def _keep_packed(out: "GgufLoad", holders, target: torch.Tensor, fmt: str, raw: torch.Tensor, dst: str) -> None:
    """Puts a GgufWeight of `raw` (the file's blocks) in every place that holds `target`."""
    new = GgufWeight(tuple(target.shape), target.dtype, fmt, raw, dst)
    for m, k in holders:
        m._parameters[k] = new
    out.packed.append(dst)
    out.packed_bytes += raw.numel()


def _load_merged(out: "GgufLoad", holders, mod: nn.Module, key: str, target: torch.Tensor, dst: str,
                 pieces: list) -> None:
    """Loads n file tensors [E, I, ...] side by side along dim 1 into `target`
    [E, n*I, ...] (e.g. ffn_gate_exps and ffn_up_exps into gate_up_proj). Of one
    GGUF type and streamed packed: per expert (dim 0), the pieces' blocks one after
    the other, which is that layout's packing. Otherwise dense, dequantized."""
    shape = tuple(target.shape)
    fmts = {rec["format"] for rec, _ in pieces}
    experts = shape[0]
    if len(fmts) == 1 and "" not in fmts and _streams_packed(mod, key, target):
        raw = torch.cat([raw.view(experts, -1) for _, raw in pieces], dim=1).reshape(-1)
        _keep_packed(out, holders, target, fmts.pop(), raw, dst)
        return
    dense = []
    for rec, raw in pieces:
        pshape = tuple(int(d) for d in rec["shape"])
        if rec["format"]:
            cols = pshape[-1]
            dense.append(_C.dequantize_packed(rec["format"], raw, math.prod(pshape) // cols, cols,
                                              target.dtype).reshape(pshape))
        else:
            dense.append(raw.view(_PLAIN[rec["type"]]).reshape(pshape).to(target.dtype))
    (out.dequantized if any(rec["format"] for rec, _ in pieces) else out.dense).append(dst)
    _assign(holders, target, torch.cat(dense, dim=1))


def load_gguf(model: nn.Module, path: str, *, rename: Union[None, str, Callable[[str], Optional[str]],
                                                            Mapping[str, Optional[str]]] = None,
              strict: bool = True, permute_qk: Optional[bool] = None) -> GgufLoad:
    """Loads the tensors of a .gguf file into `model` by name.

    * A tensor quantized in one of the formats layerstream streams (Q8_0, Q4_0,
      Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) that is the weight of an
      ``nn.Linear``, or a tensor of 2+ dimensions of a module offload()
      streams as a tensor group (transformers' mixture-of-experts modules, whose
      3-D expert weights then cross per expert as the file's blocks), stays
      packed: the parameter becomes a ``GgufWeight`` (no dense copy is ever
      made) and offload() streams the file's bytes, which the device
      dequantizes to the parameter's dtype, bit-identical to gguf-py's
      ``dequantize`` rounded to that dtype. Frozen.
    * Plain tensors (F32, F16, BF16, ...) are copied into the parameter or
      buffer, cast to its dtype (a floating-point tensor and an integer one do
      not load into each other: an error, as in load_safetensors()); quantized tensors of anything else (a conv or
      embedding weight, a bias) are dequantized on load to its dtype.
    * The model may be built without weights (``accelerate.init_empty_weights()``,
      which keeps buffers real, or ``torch.device("meta")``): a meta parameter
      gets a new tensor (tied parameters stay tied; tie them before loading,
      e.g. transformers' ``model.tie_weights()``); a real one is written in place.
      A packed weight that several modules hold (tied) is dequantized by
      offload(), once for all of them (tied weights stream dense).

    ``rename`` maps the file's tensor names to the model's parameter names: a
    callable or a dict (a name it maps to None, or a callable returning None,
    is skipped). A name may also map to a list of ``(parameter name, (first
    row, end row))`` to split a tensor by rows (dim 0), e.g. a fused qkv
    weight into separate q, k and v projections: GGUF rows are whole blocks,
    so each part stays packed and exact. ``strict`` (default) raises, before anything changes, when the
    file has tensors the model lacks or the model has parameters or persistent
    buffers the file lacks; with ``strict=False`` those are listed in the
    result. Shapes must match (the file's dims reversed, as ggml stores the
    innermost first); a mismatch is an error naming both.

    ``rename="llama.cpp"`` loads a language model file written by llama.cpp's
    converter (``blk.0.attn_q.weight``, ``token_embd.weight``, ...) into the
    transformers model of its architecture: the names are mapped with gguf-py's
    tensor name map for the file's ``general.architecture`` (the mapping
    transformers' own GGUF loader uses), and the rows of ``attn_q`` /
    ``attn_k`` (weights and biases), which that converter reorders per head
    for llama.cpp's rotary layout, are put back in the model's order.
    ``permute_qk`` says whether the file has that reordering: None (default)
    means yes for the "llama" architecture (Llama, Mistral, Mixtral files),
    as transformers assumes, and no otherwise; pass True or False to say so
    for another architecture. A row reorder of a GGUF tensor moves whole
    blocks, so those weights stay packed and exact. The head counts come from
    the file (``<arch>.attention.head_count`` / ``head_count_kv``) and must
    equal the model's config. A mixture-of-experts model whose experts fuse
    gate and up into one ``gate_up_proj`` (transformers' Qwen3-MoE, Mixtral,
    ...) gets the file's ``ffn_gate_exps`` and ``ffn_up_exps`` side by side
    along dim 1, gate first (as transformers' loader does); when both have
    the same GGUF type they stay packed (per expert, the gate's blocks then
    the up's), otherwise they are dequantized on load. llama.cpp's rotary
    tables (``rope_freqs``, ``rope_factors_*``) are skipped: transformers
    computes them from the config. Needs the ``gguf`` package.

    Returns a ``GgufLoad`` (what was packed, loaded dense, dequantized,
    missing, unexpected; the file's metadata). Not thread-safe with other users
    of the model."""
    from ._packed import _PackedWeight
    if any(hasattr(p, "_is_memory_managed") or isinstance(p, _PackedWeight) for p in model.parameters()):
        raise LayerstreamError("load_gguf(): the model is offloaded (layerstream holds its weights); call "
                               "handle.detach() first, then load_gguf() and offload() again")
    info = _C.gguf_read(str(path))
    meta = info["metadata"]
    # Every (owner module, key) holding each tensor, by qualified name.
    slots, holders, persistent = tensor_slots(model)

    reorder: Dict[str, Optional[int]] = {}  # file name -> heads its rows are reordered over (llama.cpp)
    merges: Dict[str, tuple] = {}  # file name -> (k, n): the k-th of n tensors side by side along dim 1
    if isinstance(rename, str):
        if rename != "llama.cpp":
            raise LayerstreamError(f"load_gguf(): rename={rename!r} is not a known naming; give \"llama.cpp\", "
                                   f"a dict or a function of the file's tensor names")
        rename, reorder, merges = _llama_cpp_names(model, path, meta, [r["name"] for r in info["tensors"]],
                                                   list(slots), permute_qk)
    elif permute_qk:
        raise LayerstreamError("load_gguf(): permute_qk= applies to rename=\"llama.cpp\" (a file of llama.cpp's "
                               "converter); with other names, the file must already be in the model's layout")
    # (tensor record, target name, first row, end row, heads to undo llama.cpp's reorder over,
    #  None or (k, n): the k-th of n file tensors that lie side by side along dim 1 of the target)
    plan = []
    unexpected, seen = [], set()
    loaded_by: Dict[int, tuple] = {}  # id of a model tensor -> (file name, model name) that loads it
    for rec in info["tensors"]:
        src = rec["name"]
        dst = renamed(rename, src)
        if dst is None:
            continue
        rows = int(rec["shape"][0]) if rec["shape"] else 1
        pieces = [(dst, 0, rows)] if isinstance(dst, str) else _row_pieces(path, src, dst, rows)
        for name, r0, r1 in pieces:
            if name not in slots:
                unexpected.append(src if name == src else f"{src} (as {name})")
                continue
            if name in seen and src not in merges:
                raise LayerstreamError(f"{path}: two tensors of the file load into '{name}'; fix rename=")
            first = loaded_by.setdefault(id(slots[name][2]), (src, name))
            if first[1] != name:  # tied: one tensor under two names, and the file has a tensor for each
                raise LayerstreamError(
                    f"{path}: '{first[0]}' and '{src}' of the file both load into one tensor of the model, "
                    f"'{first[1]}' and '{name}' being tied; untie them (the file has both; for transformers, "
                    f"tie_word_embeddings=False) or skip one with rename= (map it to None)")
            seen.add(name)
            plan.append((rec, name, r0, r1, reorder.get(src), merges.get(src)))
    pieces_of: Dict[str, set] = {}
    for rec, dst, _, _, _, merge in plan:
        if merge:
            pieces_of.setdefault(dst, set()).add(merge)
    for dst, got in pieces_of.items():
        n = next(iter(got))[1]
        if got != {(k, n) for k in range(n)}:
            raise LayerstreamError(f"{path}: '{dst}' is made of {n} tensors of the file side by side, but "
                                   f"only {len(got)} are in it")
    seen_ids = {id(slots[d][2]) for d in seen}
    missing = sorted(n for n in persistent if id(slots[n][2]) not in seen_ids)
    if strict:
        check_strict(f"load_gguf({path!r})", missing, unexpected)
    # Shapes and types, all checked before anything changes.
    for rec, dst, r0, r1, heads, merge in plan:
        if heads and (int(rec["shape"][0]) % (2 * heads) if rec["shape"] else 1):
            raise LayerstreamError(f"{path}: tensor '{rec['name']}' has {rec['shape'][0] if rec['shape'] else 0} "
                                   f"rows, not a whole number of pairs for {heads} heads: it cannot be llama.cpp's "
                                   f"per-head reordering (pass permute_qk=False if the file does not have it)")
        _, _, target = slots[dst]
        shape = _rows_shape(rec, r0, r1)
        if merge:  # one of n equal tensors side by side along dim 1
            n = merge[1]
            shape = shape[:1] + (shape[1] * n,) + shape[2:] if len(shape) >= 2 else shape
        if shape != tuple(target.shape):
            orig = _orig_shape(meta, rec["name"])
            whole = (r0, r1) == (0, int(rec["shape"][0]) if rec["shape"] else 1)
            if orig is None or not whole or orig != tuple(target.shape):
                rows = "" if whole else f" (rows {r0}:{r1})"
                raise LayerstreamError(
                    f"{path}: tensor '{rec['name']}'{rows} has shape {list(shape)} (GGUF dims reversed) but "
                    f"'{dst}' in the model is {list(target.shape)}")
        if rec["type"] not in _PLAIN and not rec["format"]:
            raise LayerstreamError(_C.gguf_type_unreadable(str(path), rec["name"], rec["type"]))
        if not rec["format"]:
            check_kind(str(path), rec["name"], f"GGUF type {rec['type']}", _PLAIN[rec["type"]], dst, target)
        if rec["format"] and target.dtype not in _DENSE:
            raise LayerstreamError(f"{path}: '{dst}' is {target.dtype}; a quantized GGUF tensor loads "
                                   f"into float32, bfloat16 or float16 parameters")

    out = GgufLoad([], [], [], missing, unexpected, dict(meta))
    with open(path, "rb") as f:
        parts: Dict[str, dict] = {}  # target -> {k: (record, bytes)} of a merge, until all are read
        for rec, dst, r0, r1, heads, merge in plan:
            mod, key, target = slots[dst]
            # Rows of a GGUF tensor are whole blocks: rows r0..r1 are one byte range.
            row_bytes = rec["nbytes"] // max(int(rec["shape"][0]) if rec["shape"] else 1, 1)
            nbytes = (r1 - r0) * row_bytes
            f.seek(rec["offset"] + r0 * row_bytes)
            raw = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes and f.readinto(_writable_view(raw)) != nbytes:
                raise LayerstreamError(f"{path}: could not read tensor '{rec['name']}' (file truncated?)")
            if heads:  # whole rows move, so packed blocks stay intact (a tensor with a reorder is never split)
                raw = raw.view(r1 - r0, row_bytes)[_llama_cpp_row_order(r1 - r0, heads)].reshape(-1)
            shape = tuple(target.shape)
            if merge:
                got = parts.setdefault(dst, {})
                got[merge[0]] = (rec, raw)
                if len(got) == merge[1]:
                    _load_merged(out, holders[id(target)], mod, key, target, dst, [got[k] for k in sorted(got)])
                    del parts[dst]
                continue
            if rec["format"] and _streams_packed(mod, key, target) and _rows_shape(rec, r0, r1) == shape:
                _keep_packed(out, holders[id(target)], target, rec["format"], raw, dst)
                continue
            if rec["format"]:
                cols = int(rec["shape"][-1])
                value = _C.dequantize_packed(rec["format"], raw, target.numel() // max(cols, 1), cols,
                                             target.dtype).reshape(shape)
                out.dequantized.append(dst)
            else:
                value = raw.view(_PLAIN[rec["type"]]).reshape(shape)
                out.dense.append(dst)
            _assign(holders[id(target)], target, value)
    if out.packed:
        from ._packed import install_refused_loads
        install_refused_loads(model)  # load_state_dict() into a GgufWeight: refused before any key is written
    return out


def _llama_cpp_row_order(rows: int, heads: int) -> torch.Tensor:
    """For each row of the model's q/k projection, the row of llama.cpp's file
    that holds it. Per head, transformers' rotary layout pairs element i of the
    first half with element i of the second (rows i and half + i); llama.cpp's
    converter interleaves them (rows 2i and 2i + 1)."""
    half = rows // heads // 2
    # model row h*2*half + j*half + i  <-  file row h*2*half + 2*i + j
    h, j, i = torch.meshgrid(torch.arange(heads), torch.arange(2), torch.arange(half), indexing="ij")
    return (h * 2 * half + 2 * i + j).reshape(-1)


def _llama_cpp_names(model: nn.Module, path, meta: Mapping[str, str], file_names: List[str],
                     model_names: List[str], permute_qk: Optional[bool]):
    """rename="llama.cpp" for a file of llama.cpp's converter: (file name -> model
    name, file name -> heads to undo the q/k row reordering over, file name -> (k, n)
    for the k-th of n file tensors side by side in one parameter: ffn_gate_exps and
    ffn_up_exps in transformers' experts.gate_up_proj)."""
    try:
        import gguf
    except ImportError:
        raise LayerstreamError('load_gguf(rename="llama.cpp") maps llama.cpp\'s tensor names with the gguf '
                               'package\'s name tables: pip install gguf') from None
    arch = meta.get("general.architecture", "")
    found = [a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch]
    if not found:
        raise LayerstreamError(f"{path}: general.architecture is {arch!r}, which the installed gguf package "
                               f"does not know; rename=\"llama.cpp\" needs its tensor name table (map the "
                               f"names with a dict or function instead)")

    def count(key: str) -> Optional[int]:
        text = meta.get(f"{arch}.{key}")
        if text is None:
            return None
        try:
            return int(text)
        except ValueError:
            raise LayerstreamError(f"{path}: {arch}.{key} is {text}, not one number (per-layer values are not "
                                   f"supported by rename=\"llama.cpp\")") from None

    blocks = count("block_count")
    if blocks is None:
        raise LayerstreamError(f"{path}: {arch}.block_count is missing; is this a llama.cpp language-model file?")
    table = gguf.get_tensor_name_map(found[0], blocks)
    names: Dict[str, Optional[str]] = {}
    merges: Dict[str, tuple] = {}

    def gguf_name(qn: str) -> Optional[str]:
        parts = qn.split(".")
        for k in range(len(parts)):  # the name as the converter saw it may lack a wrapper's prefix
            g = table.get_name(".".join(parts[k:]))
            if g is not None:
                return g
        return None

    for n in file_names:
        if n.startswith(("rope_freqs.", "rope_factors_")):
            names[n] = None  # llama.cpp's rotary tables: transformers computes them from the config
    for qn in model_names:
        if qn.endswith("experts.gate_up_proj"):
            # transformers' fused experts: the file's ffn_gate_exps and ffn_up_exps, gate first.
            pair = [gguf_name(qn[:-len("gate_up_proj")] + w) for w in ("gate_proj", "up_proj")]
            if all(pair):
                for k, g in enumerate(pair):
                    names.setdefault(f"{g}.weight", qn)
                    merges[f"{g}.weight"] = (k, 2)
                continue
        base, dot, suffix = qn.rpartition(".")
        if suffix in ("weight", "bias"):
            g = gguf_name(base) if dot else None
        else:  # a parameter named for what it is (experts.down_proj): the file calls it <name>.weight
            g, suffix = gguf_name(qn), "weight"
        if g is not None:
            names.setdefault(f"{g}.{suffix}", qn)
    if permute_qk is None:
        permute_qk = arch == "llama"
    reorder: Dict[str, Optional[int]] = {}
    if permute_qk:
        heads, kv = count("attention.head_count"), count("attention.head_count_kv")
        if heads is None:
            raise LayerstreamError(f"{path}: {arch}.attention.head_count is missing; it is needed to undo "
                                   f"llama.cpp's q/k row order (permute_qk=False if the file does not have it)")
        kv = kv or heads
        cfg = getattr(model, "config", None)
        for key, want in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
            have = getattr(cfg, key, None)
            if isinstance(have, int) and have != want:
                raise LayerstreamError(f"{path}: the file has {want} {key.replace('num_', '').replace('_', ' ')} "
                                       f"but the model's config.{key} is {have}; build the model from the "
                                       f"file's configuration")
        for n in file_names:
            parts = n.split(".")
            if len(parts) == 4 and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
                reorder[n] = heads if parts[2] == "attn_q" else kv
    return names, reorder, merges


def _writable_view(t: torch.Tensor) -> memoryview:
    """A writable buffer over a contiguous CPU uint8 tensor's memory, for readinto()
    straight into it (no numpy needed, no copy)."""
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


def _rows_shape(rec, r0: int, r1: int) -> tuple:
    """The torch shape of rows [r0, r1) of a file tensor."""
    shape = tuple(int(d) for d in rec["shape"])
    return ((r1 - r0),) + shape[1:] if shape else shape


def _row_pieces(path, src: str, value, rows: int) -> list:
    """rename='s value for one tensor that splits it by rows: a list of
    (target name, (first row, end row)), e.g. a fused qkv weight into q, k and v."""
    try:
        pieces = [(str(name), int(a), int(b)) for name, (a, b) in value]
    except (TypeError, ValueError):
        raise LayerstreamError(
            f"{path}: rename= maps '{src}' to {value!r}; give a parameter name, None (skip), or a list of "
            f"(parameter name, (first row, end row)) to split it by rows") from None
    for name, a, b in pieces:
        if not 0 <= a < b <= rows:
            raise LayerstreamError(f"{path}: rename= gives '{name}' rows {a}:{b} of '{src}', which has {rows} rows")
    return pieces


def _assign(holders, target: torch.Tensor, value: torch.Tensor) -> None:
    """Writes `value` into `target` (in place, cast), or for a meta target puts a
    new tensor of its dtype in every place that holds it (tied stay tied)."""
    assign(holders, target, value, replace=target.is_meta or isinstance(target, GgufWeight))
