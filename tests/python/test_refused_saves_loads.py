"""Saves and loads that a stand-in parameter (a quantized weight held packed, a FileWeight the
disk tier streams or load_safetensors() left in its file, a GgufWeight before offload()) cannot
take are refused before anything is written: torch.distributed.checkpoint.save() leaves a
checkpoint already in its folder as it was (Note [A refused save writes nothing], _standin.py),
and load_state_dict() leaves every key of the model as it was (Note [A refused load writes
nothing], _packed.py); each message says how to do it instead."""
import os
import warnings

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import layerstream
from layerstream import FileWeight, GgufWeight, LayerstreamError

dcp = pytest.importorskip("torch.distributed.checkpoint")

D = 64
_DISK_TIER = "33KiB"  # two staging entries, no room for a Linear: every one streams from its file


def _build(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, D), nn.Linear(D, D))


def _in_file(tmp_path, seed=0):
    """A frozen model whose Linear weights load_safetensors() left in its file."""
    path = str(tmp_path / "m.safetensors")
    save_file(_build(seed).state_dict(), path)
    with torch.device("meta"):
        model = _build()
    model.requires_grad_(False)
    layerstream.load_safetensors(model, path)
    assert isinstance(model[0].weight, FileWeight)
    return model


def _offloaded(tmp_path, tier, offload_sim):
    if tier == "disk":
        model = _in_file(tmp_path)
        handle = offload_sim(model, host_budget=_DISK_TIER)
        assert handle.stats()["disk_layers"] == 3
        return model, handle
    model = _build().requires_grad_(False)
    handle = offload_sim(model, quantize="int8", budget="48KiB")
    assert all(type(model[i].weight).__name__ == "_PackedWeight" for i in (0, 2, 3))  # every Linear streams
    return model, handle


def _files(folder):
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


@pytest.mark.parametrize("tier", ["int8", "disk"])
def test_a_refused_dcp_save_leaves_the_checkpoint_already_in_its_folder_intact(tmp_path, tier, offload_sim):
    """dcp.save() of an offloaded model whose weights have no values in the state dict (quantized:
    held packed; disk tier: in their file) was refused only once DCP's writer called .cpu() on
    them, after it had opened its data file: an earlier checkpoint in the folder was left with a
    0-byte __0_0.distcp and no longer loaded, and the quantized weight's message was about moving
    it (cpu()), not about saving. Now it is refused while DCP plans the save, with the save
    message; the earlier checkpoint's bytes are unchanged and it loads."""
    folder = str(tmp_path / "ckpt")
    good = _build(seed=2)
    dcp.save({"model": good.state_dict()}, checkpoint_id=folder)
    before = _files(folder)
    assert len(before[next(n for n in before if n.endswith(".distcp"))]) > 0
    model, handle = _offloaded(tmp_path, tier, offload_sim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group" warning
        with pytest.raises(BaseException) as info:  # DCP raises a CheckpointException, a BaseException
            dcp.save({"model": model.state_dict()}, checkpoint_id=folder)
    text = str(info.value)
    assert "torch.distributed.checkpoint.save" in text and "cpu()" not in text
    if tier == "int8":
        assert "it cannot be saved" in text and "save only the trainable parameters" in text
        assert "or detach() first" in text
    else:
        assert "so saving it" in text and "FileWeight.read() gives them" in text
    assert _files(folder) == before
    back = _build(seed=5).state_dict()
    dcp.load({"model": back}, checkpoint_id=folder)
    assert all(torch.equal(back[k], v) for k, v in good.state_dict().items())
    handle.detach()


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items() if not v.is_meta}


@pytest.mark.parametrize("where", ["disk", "in_file"])
def test_a_load_into_file_weights_is_refused_before_any_key_is_written(tmp_path, where, offload_sim):
    """load_state_dict() into a model with FileWeights (streamed by the disk tier, or left in their
    file by load_safetensors() before offload()) raised per key, after torch had written every other
    key (the LayerNorm), with torch's warning that the copy "is a no-op" and to pass assign=True:
    the model held parts of two checkpoints. Now nothing is written, torch warns nothing, and the
    message says what to do (disk tier: detach(), offload() with a larger host_budget)."""
    model = _in_file(tmp_path)
    handle = offload_sim(model, host_budget=_DISK_TIER) if where == "disk" else None
    before = _snapshot(model)
    new = {k: v + 1 for k, v in _build(seed=1).state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(LayerstreamError) as info:
            model.load_state_dict(new)
    assert not [w for w in caught if "no-op" in str(w.message)]
    text = str(info.value)
    assert text.startswith("load_state_dict() refused before writing anything: '0.weight' ")
    assert "(5 more key(s) likewise)" in text
    if where == "disk":
        assert "To load new values, call handle.detach(), then offload() again with a host_budget= that holds" in text
    else:
        assert "call layerstream.offload(model, ...) first" in text and "load_state_dict(..., assign=True)" in text
    after = _snapshot(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    if handle is not None:  # the advice: detach(), offload() with a host budget that holds them, load
        handle.detach()
        handle = offload_sim(model, host_budget="1MiB")
        assert handle.stats()["disk_layers"] == 0
        model.load_state_dict(new)
        ref = _build()
        ref.load_state_dict(new)
        x = torch.randn(3, D)
        assert torch.equal(model(x), ref(x))
        handle.detach()


def test_before_offload_a_load_with_assign_replaces_the_file_weights_and_offload_computes_with_them(
        tmp_path, offload_sim):
    """The other way the pre-offload message names: assign=True puts the loaded tensors in place of
    the FileWeights (the check lets it through); offload() then gives the loaded model's numbers."""
    model = _in_file(tmp_path)
    ref = _build(seed=1).requires_grad_(False)
    model.load_state_dict(ref.state_dict(), assign=True)
    assert not any(isinstance(p, FileWeight) for p in model.parameters())
    handle = offload_sim(model)
    x = torch.randn(3, D)
    assert torch.equal(model(x), ref(x))
    handle.detach()


def test_a_load_into_gguf_weights_before_offload_is_refused_before_any_key_is_written(tmp_path):
    """The same for the GgufWeights load_gguf() keeps packed until offload()."""
    gguf = pytest.importorskip("gguf")
    from conftest import write_gguf
    T = gguf.GGMLQuantizationType
    tensors = []
    for k, v in _build().state_dict().items():
        if k.endswith("weight") and v.dim() == 2:
            raw = gguf.quants.quantize(v.numpy(), T.Q8_0)
            tensors.append((k, tuple(v.shape), "Q8_0", torch.from_numpy(raw.reshape(-1).copy())))
        else:
            tensors.append((k, tuple(v.shape), "F32", v.contiguous().reshape(-1).view(torch.uint8).clone()))
    path = str(write_gguf(tmp_path / "m.gguf", tensors))
    with torch.device("meta"):
        model = _build()
    model.requires_grad_(False)
    layerstream.load_gguf(model, path)
    assert isinstance(model[0].weight, GgufWeight)
    before = _snapshot(model)
    with pytest.raises(LayerstreamError, match=r"^load_state_dict\(\) refused before writing anything: the "
                                               r"weight of '0.weight' is GGUF q8_0 .*assign=True"):
        model.load_state_dict({k: v + 1 for k, v in _build(seed=1).state_dict().items()})
    after = _snapshot(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
