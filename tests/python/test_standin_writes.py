"""Writes into the read-only stand-ins load_safetensors() (FileWeight) and load_gguf()
(GgufWeight) leave until offload(): through the parameter or through its ``.data``, they
raise an error naming the weight and how to change it, and the model keeps the file's
values; the supported ways to change them (peft's merge_and_unload() included) give the
resident model's numbers."""
import copy

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import layerstream
from layerstream import FileWeight, GgufWeight, LayerstreamError
from conftest import write_gguf

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T, quants  # noqa: E402

D = 64

WRITES = {
    "data.zero_": lambda w: w.data.zero_(),
    "data.mul_": lambda w: w.data.mul_(2),
    "data+=": lambda w: w.data.__iadd__(torch.ones(D, D)),
    "data.copy_": lambda w: w.data.copy_(torch.zeros(D, D)),
    "data[0]=": lambda w: w.data.__setitem__(0, 1.0),
    "data=": lambda w: setattr(w, "data", torch.zeros(D, D)),
    "normal_": lambda w: w.normal_(),
}


def _reference():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D)).requires_grad_(False)


def _meta():
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D)).requires_grad_(False)


def _safetensors(tmp_path):
    ref = _reference()
    path = str(tmp_path / "m.safetensors")
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    return path, ref


def _gguf(tmp_path):
    """A .gguf whose Linear weights are Q8_0 (by gguf-py); the reference holds the
    dequantized values."""
    ref = _reference()
    tensors = []
    for k, v in ref.state_dict().items():
        if k.endswith("weight"):
            raw = quants.quantize(v.numpy(), T.Q8_0)
            with torch.no_grad():
                v.copy_(torch.from_numpy(quants.dequantize(raw, T.Q8_0).copy()))
            tensors.append((k, tuple(v.shape), "Q8_0", torch.from_numpy(raw.reshape(-1).copy())))
        else:
            tensors.append((k, tuple(v.shape), "F32", v.contiguous().reshape(-1).view(torch.uint8).clone()))
    return str(write_gguf(tmp_path / "m.gguf", tensors)), ref


def _loaded(kind, path):
    model = _meta()
    if kind == "safetensors":
        layerstream.load_safetensors(model, path)
    else:
        layerstream.load_gguf(model, path)
    assert isinstance(model[0].weight, FileWeight if kind == "safetensors" else GgufWeight)
    return model


_REFUSAL = {"safetensors": r"'0.weight' is still in its file .*merge_and_unload.*offload\(model",
            "gguf": r"the weight of '0.weight' is GGUF q8_0 .*merge_and_unload.*dequantized\(\)"}


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
def test_writes_into_a_weight_still_in_its_file_raise_and_keep_the_files_values(tmp_path, kind, write):
    """Before, a write through .data (w.data.zero_(), w.data += t, w.data.copy_(t): what
    peft's merge_and_unload() does) went to a plain meta tensor and was dropped without a
    word: offload() then streamed the file's values as if unchanged."""
    path, ref = (_safetensors if kind == "safetensors" else _gguf)(tmp_path)
    model = _loaded(kind, path)
    w = model[0].weight
    with pytest.raises(LayerstreamError, match=_REFUSAL[kind]):
        with torch.no_grad():
            WRITES[write](w)
    assert model[0].weight is w and type(w) in (FileWeight, GgufWeight)
    h = layerstream.offload(model, device="sim")
    x = torch.randn(3, D)
    assert torch.equal(model(x), ref(x))
    h.detach()


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_metadata_reads_through_data_still_work(tmp_path, kind):
    path, _ = (_safetensors if kind == "safetensors" else _gguf)(tmp_path)
    model = _loaded(kind, path)
    w = model[0].weight
    d = w.data
    assert d is w  # writes through it reach the stand-in's refusals
    assert (d.shape, d.dtype, d.device, d.is_meta, d.numel(), d.requires_grad) == \
        ((D, D), torch.float32, torch.device("cpu"), True, D * D, False)
    w.data = w  # an unchanged parameter assigned back (nn.Module._apply does) is no write
    assert model[0].weight is w


def test_peft_merge_over_a_weight_in_its_file_raises_and_merging_after_offload_matches(tmp_path):
    """Before, peft's merge_and_unload() over a load_safetensors() base raised nothing and
    the merged model computed the base alone (the LoRA delta lost). Merging after
    offload() (which reads the weight into host memory), as the error says, gives the
    resident merged model's numbers."""
    peft = pytest.importorskip("peft")
    path, ref = _safetensors(tmp_path)
    cfg = peft.LoraConfig(target_modules=["0"], r=4, init_lora_weights=False)
    torch.manual_seed(1)
    ref = peft.get_peft_model(ref, cfg).merge_and_unload()
    x = torch.randn(3, D)
    torch.manual_seed(1)
    model = peft.get_peft_model(_loaded("safetensors", path), cfg)
    with pytest.raises(LayerstreamError, match=r"'0.weight' is still in its file .*writing into it.*"
                                               r"merge_and_unload.*offload\(model, \.\.\.\) first"):
        model.merge_and_unload()
    h = layerstream.offload(model, device="sim")
    merged = model.merge_and_unload()
    assert torch.equal(merged(x), ref(x))
    h.detach()


def test_peft_merge_over_a_gguf_weight_raises_and_merging_its_dense_values_matches(tmp_path):
    """Before, peft's merge_and_unload() over a load_gguf() base raised nothing and the
    merged model computed the GGUF weight alone (the LoRA delta lost). Merging into the
    dense values, as the error says, gives the resident merged model's numbers."""
    peft = pytest.importorskip("peft")
    path, ref = _gguf(tmp_path)
    cfg = peft.LoraConfig(target_modules=["0"], r=4, init_lora_weights=False)
    torch.manual_seed(1)
    ref = peft.get_peft_model(copy.deepcopy(ref), cfg).merge_and_unload()
    x = torch.randn(3, D)
    torch.manual_seed(1)
    model = peft.get_peft_model(_loaded("gguf", path), cfg)
    with pytest.raises(LayerstreamError, match=r"'0.weight' is GGUF q8_0 .*writing into it.*merge_and_unload.*"
                                               r"torch.nn.Parameter\(module.weight.dequantized\(\)"):
        model.merge_and_unload()
    base = model.base_model.model[0].base_layer
    base.weight = nn.Parameter(base.weight.dequantized(), requires_grad=False)
    merged = model.merge_and_unload()
    h = layerstream.offload(merged, device="sim")
    assert torch.equal(merged(x), ref(x))
    h.detach()
