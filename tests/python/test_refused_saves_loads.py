"""Saves that a stand-in parameter (a quantized weight held packed, a FileWeight the disk tier
streams) cannot take are refused before anything is written: torch.distributed.checkpoint.save()
leaves a checkpoint already in its folder as it was (Note [A refused save writes nothing],
_standin.py); the message says how to save instead."""
import os
import warnings

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import layerstream
from layerstream import FileWeight

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
