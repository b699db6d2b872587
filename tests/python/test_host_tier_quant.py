"""quantize= with a disk tier (docs/design/host-tier.md, "The quantization cache
file"; core/io/quant_cache.h): frozen Linear weights of load_safetensors() that do
not fit in host_budget are packed once into a cache file under cache_dir= and
streamed packed from it; outputs and LoRA gradients equal the same model quantized
in RAM; the cache is reused while valid and rebuilt when stale; a write that fails
(no space) is a clear error that leaves nothing behind."""
import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import layerstream
from layerstream import FileWeight, LayerstreamError

from test_host_tier import N, _ids, _layer_bytes, _meta, _quarter, _reference, _save, assert_lora_steps_equal


def _loaded(path):
    model = _meta()
    layerstream.load_safetensors(model, path)
    return model.requires_grad_(False)


def _budget(ref):
    """Host RAM under the packed bytes of both formats: the Linear layers go to disk."""
    return _layer_bytes(ref) // 12 + ref.emb.weight.numel() * 4


def _cache_file(handle):
    files = handle.host_plan["cache_files"]
    assert len(files) == 1
    return files[0]


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_disk_tier_streams_packed_bytes_from_the_cache_and_equals_the_model_quantized_in_ram(tmp_path, fmt):
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    cache = tmp_path / "cache"
    model, in_ram = _loaded(path), _loaded(path)
    budget = _budget(ref)
    handle = layerstream.offload(model, device="sim", quantize=fmt, host_budget=budget, cache_dir=cache)
    ram = layerstream.offload(in_ram, device="sim", quantize=fmt)
    assert isinstance(model.layers[0].weight, FileWeight)  # on disk: the module keeps its stand-in
    assert ram.host_plan["disk_bytes"] == 0 and not isinstance(in_ram.layers[0].weight, FileWeight)
    cache_file = _cache_file(handle)
    assert os.path.dirname(cache_file) == str(cache) and f".{fmt}." in os.path.basename(cache_file)
    assert "packed in " + cache_file in handle.plan
    # The disk holds the packed bytes: fewer than dense.
    packed = handle.host_plan["disk_bytes"]
    assert packed < _layer_bytes(ref) * (0.4 if fmt == "int8" else 0.25)
    assert_lora_steps_equal(model, in_ram, 3)
    stats = handle.stats()
    assert stats["disk_layers"] == N + 1 and stats["ordering_errors"] == 0
    assert 0 < stats["disk_read_bytes"] and stats["staging_entry_bytes"] * 2 <= budget
    # A .safetensors file any tool reads: one U8 tensor per weight, metadata saying what it was built from.
    with safe_open(cache_file, "pt") as f:
        meta = f.metadata()
        assert meta["format"] == fmt and meta["layerstream.quant_cache"] == "2"
        assert os.path.realpath(path) in meta["sources"]
        assert sorted(f.keys()) == sorted(n for n, _ in ref.named_parameters()
                                          if n.endswith("weight") and not n.startswith(("emb", "norm")))
        assert f.get_tensor("layers.0.weight").dtype == torch.uint8
    handle.detach()
    # Its stand-in in the checkpoint, not dequantized values (docs/design/host-tier.md).
    assert isinstance(model.layers[0].weight, FileWeight)
    assert torch.equal(model.layers[0].weight.read(), ref.layers[0].weight)


def test_the_cache_is_reused_while_valid_and_rebuilt_when_stale(tmp_path):
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    cache = tmp_path / "cache"
    budget = _budget(ref)

    def run(source=path, fmt="int8"):
        model = _loaded(source)
        handle = layerstream.offload(model, device="sim", quantize=fmt, host_budget=budget, cache_dir=cache)
        with torch.no_grad():
            out = model(_ids())
        f = _cache_file(handle)
        handle.detach()
        return out, f, os.stat(f).st_ino

    first, f, inode = run()
    again, f2, inode2 = run()
    assert f2 == f and inode2 == inode and torch.equal(again, first)  # reused: not rewritten

    # Another format: another file; the first stays.
    _, f_nf4, _ = run(fmt="nf4")
    assert f_nf4 != f and os.path.exists(f)

    # A cache of another version (or whose metadata differs): rebuilt, never read.
    with safe_open(f, "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
        meta = dict(h.metadata(), **{"layerstream.quant_cache": "0"})
    tensors["layers.0.weight"] = torch.zeros_like(tensors["layers.0.weight"])
    save_file(tensors, f, metadata=meta)
    tampered = os.stat(f).st_ino
    out, _, inode3 = run()
    assert inode3 != tampered and torch.equal(out, first)

    # A truncated cache file: rebuilt.
    with open(f, "r+b") as h:
        h.truncate(100)
    out, _, _ = run()
    assert torch.equal(out, first)

    # The checkpoint rewritten with other values (other size or mtime): rebuilt from the new values.
    other = _reference(seed=5)
    _save(other, path)
    out, _, inode4 = run()
    in_ram = _loaded(path)
    h = layerstream.offload(in_ram, device="sim", quantize="int8")
    with torch.no_grad():
        want = in_ram(_ids())
    h.detach()
    assert torch.equal(out, want) and not torch.equal(out, first)


def test_a_relative_cache_dir_is_taken_from_the_working_directory_of_offload(tmp_path, monkeypatch):
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    monkeypatch.chdir(tmp_path)
    model = _loaded(path)
    handle = layerstream.offload(model, device="sim", quantize="int8", host_budget=_budget(ref), cache_dir="cache")
    assert os.path.dirname(_cache_file(handle)) == str(tmp_path / "cache")
    with torch.no_grad():
        first = model(_ids())
        monkeypatch.chdir(tmp_path.parent)
        assert torch.equal(model(_ids()), first)


def test_the_checkpoints_own_directory_is_refused_as_cache_dir(tmp_path):
    """A cache file beside the checkpoint would make load_safetensors() of that
    directory find two .safetensors files; the error says what to pass instead."""
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    model = _loaded(str(tmp_path))
    with pytest.raises(LayerstreamError, match=r"is the directory of the checkpoint .*cache_dir=.*layerstream-cache"):
        layerstream.offload(model, device="sim", quantize="int8", host_budget=_budget(ref), cache_dir=tmp_path)
    assert os.listdir(tmp_path) == ["m.safetensors"]
    layerstream.offload(model, device="sim", quantize="int8", host_budget=_budget(ref),
                        cache_dir=tmp_path / "layerstream-cache")
    layerstream.load_safetensors(_meta(), str(tmp_path))  # the directory still loads


def test_temporaries_of_builds_whose_process_is_gone_are_removed(tmp_path):
    """A build killed (SIGTERM) leaves <cache>.tmp-<pid>-<n>: the next build of that
    cache removes those of processes that are gone, not those of live ones."""
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    cache = tmp_path / "cache"
    handle = layerstream.offload(_loaded(path), device="sim", quantize="int8", host_budget=_budget(ref),
                                 cache_dir=cache)
    f = _cache_file(handle)
    handle.detach()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead, alive = f"{f}.tmp-{gone.pid}-0", f"{f}.tmp-{os.getppid()}-0"
    for name in (dead, alive):
        open(name, "wb").write(b"partial")
    os.remove(f)  # rebuilt
    layerstream.offload(_loaded(path), device="sim", quantize="int8", host_budget=_budget(ref), cache_dir=cache)
    assert os.path.exists(f) and not os.path.exists(dead) and os.path.exists(alive)


def test_two_models_with_other_weights_on_disk_keep_their_own_cache_files(tmp_path):
    """Two handles over one checkpoint and one cache_dir with other sets of weights on
    disk: the second gets its own file and never replaces the one the first streams."""
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    cache = tmp_path / "cache"
    a, b = _loaded(path), _loaded(path)
    ha = layerstream.offload(a, device="sim", quantize="int8", host_budget=_budget(ref), cache_dir=cache)
    with torch.no_grad():
        first = a(_ids())
    hb = layerstream.offload(b, device="sim", quantize="int8", host_budget=_budget(ref), cache_dir=cache,
                             exclude=["layers.0"])
    assert _cache_file(hb) != _cache_file(ha)
    with torch.no_grad():
        b(_ids())
        assert torch.equal(a(_ids()), first)


def test_a_cache_file_changed_under_a_reader_is_named_as_layerstreams_cache(tmp_path):
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    model = _loaded(path)
    handle = layerstream.offload(model, device="sim", quantize="int8", host_budget=_budget(ref),
                                 cache_dir=tmp_path / "cache")
    os.truncate(_cache_file(handle), 100)
    with pytest.raises(LayerstreamError, match=r"layerstream's quantization cache file \(cache_dir=\).*offload\(\) again"):
        with torch.no_grad():
            model(_ids())
            handle.synchronize()


def test_cache_bytes_changed_in_place_are_refused_at_their_first_read_and_a_deleted_cache_is_rebuilt(tmp_path):
    """The cache's metadata (sizes, times) cannot see bytes changed in place: a damaged
    cache file was streamed as it was (wrong numbers). Each tensor's checksum is now
    checked at its first read."""
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    budget, cache = _budget(ref), tmp_path / "cache"

    def run():
        model = _loaded(path)
        handle = layerstream.offload(model, device="sim", quantize="int8", host_budget=budget, cache_dir=cache)
        try:
            with torch.no_grad():
                out = model(_ids())
                handle.synchronize()
            return out, _cache_file(handle)
        finally:
            handle.detach()

    first, f = run()
    with safe_open(f, "pt") as h:
        sums = json.loads(h.metadata()["checksums"])
        assert sorted(sums) == sorted(h.keys()) and all(len(v) == 16 for v in sums.values())
    # One byte of layers.1's packed weight changed in place, the file's times put back.
    with open(f, "rb") as h:
        n = int.from_bytes(h.read(8), "little")
        at = 8 + n + json.loads(h.read(n))["layers.1.weight"]["data_offsets"][0] + 5
    st = os.stat(f)
    with open(f, "r+b") as h:
        h.seek(at)
        byte = h.read(1)
        h.seek(at)
        h.write(bytes([byte[0] ^ 0x40]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(LayerstreamError,
                       match=r"tensor 'layers\.1\.weight' does not hold the bytes written there \(checksum .*Delete it"):
        run()
    os.remove(f)
    again, f2 = run()
    assert f2 == f and torch.equal(again, first)

    # A cache file without checksums (as written before they were kept): rebuilt, never read.
    with safe_open(f, "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
        meta = {k: v for k, v in h.metadata().items() if k != "checksums"}
    tensors["layers.0.weight"] = torch.zeros_like(tensors["layers.0.weight"])
    save_file(tensors, f, metadata=meta)
    out, _ = run()
    assert torch.equal(out, first)
    with safe_open(f, "pt") as h:
        assert "checksums" in h.metadata()


def test_without_cache_dir_quantized_weights_must_fit_in_ram(tmp_path):
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    model = _loaded(path)
    with pytest.raises(LayerstreamError, match="pass cache_dir="):
        layerstream.offload(model, device="sim", quantize="int8", host_budget=_quarter(ref) // 8)
    # With the budget for it, no cache is needed: packed in RAM, as without a host budget.
    handle = layerstream.offload(_loaded(path), device="sim", quantize="int8", host_budget=_layer_bytes(ref),
                                 cache_dir=tmp_path / "unused")
    assert handle.host_plan["disk_bytes"] == 0 and "cache_files" not in handle.host_plan
    assert not (tmp_path / "unused").exists()



def test_lossless_weights_cannot_stay_on_disk_and_the_error_does_not_offer_cache_dir(tmp_path):
    """quantize="lossless" codes weights in RAM, so cache_dir= cannot keep them on disk:
    the error says so rather than suggest cache_dir=, with it or without it."""
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    for cache_dir in (None, tmp_path / "cache"):
        with pytest.raises(LayerstreamError, match="are quantized losslessly, e.g. 'layers.0': lossless weights are "
                                                   "coded in RAM and cannot stay on disk") as e:
            layerstream.offload(_loaded(path), device="sim", quantize="lossless", host_budget=_quarter(ref),
                                cache_dir=cache_dir)
        assert "pass cache_dir=" not in str(e.value), e.value

def test_the_advice_for_quantized_weights_in_memory_follows_the_disk_rule(tmp_path):
    """A model in memory, quantized: its layers' advice follows core/host_tier.h's rule.
    Lossless ones cannot stay on disk however they are loaded, so the error does not tell
    to load them with load_safetensors() (before, it did, beside the lossless hint that
    says they cannot); int8 ones could with cache_dir=, so with it the error says to load
    them with load_safetensors(), and without it to pass cache_dir=."""
    ref = _reference().requires_grad_(False)
    with pytest.raises(LayerstreamError, match="quantized losslessly") as e:
        layerstream.offload(copy.deepcopy(ref), device="sim", quantize="lossless", host_budget=_quarter(ref) // 8)
    assert "have their weights in memory" not in str(e.value), e.value
    with pytest.raises(LayerstreamError, match=r"frozen Linear layer\(s\) have their weights in memory.*"
                                               r"load it with load_safetensors\(\)") as e:
        layerstream.offload(copy.deepcopy(ref), device="sim", quantize="int8", host_budget=_quarter(ref) // 8,
                            cache_dir=tmp_path / "cache")
    assert "pass cache_dir=" not in str(e.value), e.value
    with pytest.raises(LayerstreamError, match="pass cache_dir=") as e:
        layerstream.offload(copy.deepcopy(ref), device="sim", quantize="int8", host_budget=_quarter(ref) // 8)
    assert "have their weights in memory" not in str(e.value), e.value
    assert not (tmp_path / "cache").exists()


def test_a_cache_file_that_cannot_be_written_is_a_clear_error_and_leaves_nothing(tmp_path):
    """No space (here: a file-size limit, which fails the write the same way ENOSPC
    does, half-way): the error names the cache file and says what to change; no
    partial file stays; the model is as it was and offload() works once there is room."""
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    cache = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path[:0] = {sys.path!r}
        import torch, layerstream
        from layerstream import FileWeight, LayerstreamError
        from test_host_tier import _meta, _reference
        from test_host_tier_quant import _budget
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        model = _meta()
        layerstream.load_safetensors(model, {path!r})
        model.requires_grad_(False)
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (12000, hard))
        try:
            layerstream.offload(model, device="sim", quantize="int8", host_budget=_budget(_reference()),
                                cache_dir={str(cache)!r})
        except LayerstreamError as e:
            print("ERROR:", e)
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        assert all(isinstance(m.weight, FileWeight) for m in model.layers), "the model changed"
        h = layerstream.offload(model, device="sim", quantize="int8", host_budget=_budget(_reference()),
                                cache_dir={str(cache)!r})
        print("OK", h.stats()["disk_layers"])
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__)] + sys.path))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    err = next(line for line in run.stdout.splitlines() if line.startswith("ERROR:"))
    assert "writing the quantization cache file" in err and str(cache) in err and "File too large" in err
    assert "pass another cache_dir=" in err
    assert f"OK {N + 1}" in run.stdout
    leftovers = [n for n in os.listdir(cache) if ".tmp-" in n]
    assert leftovers == []


def test_a_weight_with_nan_is_refused_before_anything_changes(tmp_path):
    ref = _reference()
    with torch.no_grad():
        ref.layers[3].weight[2, 5] = float("nan")
    path = _save(ref, tmp_path / "m.safetensors")
    model = _loaded(path)
    with pytest.raises(LayerstreamError, match=r"cannot quantize 'layers\.3\.weight' of .*m\.safetensors to int8"):
        layerstream.offload(model, device="sim", quantize="int8", host_budget=_budget(ref), cache_dir=tmp_path / "c")
    assert all(isinstance(m.weight, FileWeight) for m in model.layers)
    assert os.listdir(tmp_path / "c") == []


def test_a_disk_without_room_for_the_cache_is_refused_before_writing(tmp_path):
    """The free-space check (statvfs) before the cache file is written: on a 4 KiB
    file system (a tmpfs mounted in a mount namespace of its own, so nothing outside
    sees it) offload() says how much the file needs and how much is free, and writes
    nothing. Needs root (mount); CI runs as root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    cache = tmp_path / "small"
    cache.mkdir()
    script = textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = {sys.path!r}
        import layerstream
        from layerstream import LayerstreamError
        from test_host_tier import _reference
        from test_host_tier_quant import _budget, _loaded
        try:
            layerstream.offload(_loaded({str(path)!r}), device="sim", quantize="int8",
                                host_budget=_budget(_reference()), cache_dir={str(cache)!r})
        except LayerstreamError as e:
            print("ERROR:", e)
        print("LEFT:", os.listdir({str(cache)!r}))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__)] + sys.path))
    run = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f"mount -t tmpfs -o size=4k tmpfs '{cache}' && exec \"$0\" -c \"$1\"", sys.executable,
                          script], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    err = next(line for line in run.stdout.splitlines() if line.startswith("ERROR:"))
    assert "no space for the quantization cache file" in err and "4.00 KiB free" in err, err
    assert "pass another cache_dir=" in err
    assert "LEFT: []" in run.stdout
