"""The host tier's files (docs/design/host-tier.md, "Files change", "Open files"): a
checkpoint changed after loading is an error naming it, never other weights; paths
are absolute; a file is held open only while the disk tier reads from it, so a
checkpoint read into RAM is closed and deleting it frees its space."""
import os
import time

import pytest
import torch
from safetensors.torch import save_file

import layerstream
from layerstream import LayerstreamError

from test_host_tier import _frozen_on_disk, _ids, _meta, _quarter, _reference, _save


def test_a_file_changed_after_loading_is_an_error_never_other_weights(tmp_path):
    ref, path, model, handle = _frozen_on_disk(tmp_path)
    with torch.no_grad():
        assert torch.equal(model(_ids()), ref(_ids()))
    time.sleep(0.02)
    with open(path, "r+b") as f:  # same size, other bytes, new modification time
        f.seek(os.path.getsize(path) - 8)
        f.write(b"\x00" * 8)
    with pytest.raises(LayerstreamError, match=r"m.safetensors: the file changed after it was loaded.*tensor '"):
        with torch.no_grad():
            for _ in range(3):
                model(_ids())
            handle.synchronize()
    os.truncate(path, 100)  # and then truncated: still an error, at every later step
    with pytest.raises(LayerstreamError, match="m.safetensors"):
        with torch.no_grad():
            for _ in range(3):
                model(_ids())
            handle.synchronize()


def _rewrite(path, model, metadata=None):
    """`model`'s weights over the file at `path` (the same inode), its modification
    time one second later than before (no waiting on the clock's resolution)."""
    before = os.stat(path).st_mtime_ns
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path, metadata=metadata)
    os.utime(path, ns=(before + 10**9, before + 10**9))


@pytest.mark.parametrize("in_ram", [True, False])
def test_a_file_changed_between_loading_and_offload_is_an_error(tmp_path, in_ram):
    """The file's identity is recorded when its header is read: offload() (reading it
    into RAM or streaming it) and FileWeight.read() refuse a file rewritten since,
    instead of using its other values (or, with a longer header, bytes at shifted offsets)."""
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    for metadata in (None, {"note": "x" * 1000}):  # other values; then a header of another length
        model = _meta().requires_grad_(False)
        layerstream.load_safetensors(model, path)
        _rewrite(path, _reference(seed=1) if metadata is None else ref, metadata)
        with pytest.raises(LayerstreamError, match=r"m.safetensors: the file changed after it was loaded.*tensor '"):
            layerstream.offload(model, device="sim", host_budget=None if in_ram else _quarter(ref))
        with pytest.raises(LayerstreamError, match="changed after it was loaded"):
            model.layers[0].weight.read()


def test_a_checkpoint_loaded_by_a_relative_path_streams_after_a_chdir(tmp_path, monkeypatch):
    ref = _reference()
    _save(ref, tmp_path / "m.safetensors")
    monkeypatch.chdir(tmp_path)
    model = _meta().requires_grad_(False)
    layerstream.load_safetensors(model, "m.safetensors")
    assert model.layers[0].weight.file_range.path == str(tmp_path / "m.safetensors")
    layerstream.offload(model, device="sim", host_budget=_quarter(ref))
    monkeypatch.chdir(tmp_path.parent)
    with torch.no_grad():
        assert torch.equal(model(_ids()), ref(_ids()))


def _open_fds_of(path):
    """The descriptors of this process open on `path` (also after it was deleted)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed since
            continue
        if target in (path, path + " (deleted)"):
            found.append(fd)
    return found


def test_a_checkpoint_read_into_ram_is_closed_and_its_space_freed_when_deleted(tmp_path):
    """Every weight went to RAM: no descriptor keeps the file after offload() (deleting it
    frees its disk space at once, not at detach()), and the model computes as before.
    A disk-tier layer keeps its file open until detach()."""
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    model = _meta()
    layerstream.load_safetensors(model, path)
    handle = layerstream.offload(model, device="sim")
    assert _open_fds_of(path) == []
    os.remove(path)
    with torch.no_grad():
        assert torch.equal(model(_ids()), ref(_ids()))
    handle.detach()

    path = _save(ref, tmp_path / "d.safetensors")
    model = _meta().requires_grad_(False)
    layerstream.load_safetensors(model, path)
    handle = layerstream.offload(model, device="sim", host_budget=_quarter(ref))
    assert len(_open_fds_of(path)) == 1
    handle.detach()
    assert _open_fds_of(path) == []
