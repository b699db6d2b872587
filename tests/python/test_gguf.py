"""GGUF files: the reader (csrc/core/gguf.h), the dequantization of the ten block
formats (bit for bit gguf-py's numpy reference), and load_gguf() + offload():
Linear weights stream as the file's bytes, everything else loads dense."""
import copy
import io

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.nn as nn

import gguf
from gguf import GGMLQuantizationType as T
from gguf import quants

import layerstream
from layerstream import GgufWeight, LayerstreamError, _C
from conftest import GGUF_BLOCKS, gguf_random_blocks, write_gguf

FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize("type_name", FORMATS)
def test_dequantization_is_bit_identical_to_gguf_py(type_name):
    """Random blocks (every code pattern) with scales of both signs, zero,
    subnormal and large: our CPU reference equals gguf-py's dequantize bit for
    bit in fp32, and its rounding to bf16 / fp16 equals torch's."""
    _, elems, nbytes, offsets = GGUF_BLOCKS[type_name]
    rows, cols = 7, 3 * elems
    raw = gguf_random_blocks(type_name, rows, cols, seed=1).reshape(-1, nbytes)
    special = torch.tensor([0.0, -0.0, 6e-8, -3e-5, 65504.0, -1.5, 2.0 ** -14], dtype=torch.float16)
    for off in offsets:
        raw[: len(special), off:off + 2] = special.view(torch.uint8).reshape(-1, 2)
    want = torch.from_numpy(quants.dequantize(raw.reshape(rows, -1).numpy(), getattr(T, type_name)).copy())
    assert want.shape == (rows, cols)
    fmt = type_name.lower()
    got = _C.dequantize_packed(fmt, raw.reshape(-1), rows, cols, torch.float32)
    assert torch.equal(_bits(got), _bits(want.float())), f"{type_name}: fp32 values differ from gguf-py"
    for dtype in (torch.bfloat16, torch.float16):
        got = _C.dequantize_packed(fmt, raw.reshape(-1), rows, cols, dtype)
        assert torch.equal(_bits(got), _bits(want.to(dtype))), f"{type_name}: {dtype} rounding differs"


def test_dequantize_checks_sizes_and_blocks():
    raw = gguf_random_blocks("Q4_K", 2, 256)
    with pytest.raises(LayerstreamError, match="is 288 bytes, got 287"):
        _C.dequantize_packed("q4_k", raw[:-1], 2, 256, torch.float32)
    with pytest.raises(LayerstreamError, match="must be a multiple of 256"):
        _C.dequantize_packed("q4_k", raw, 4, 128, torch.float32)


def _gguf_py_file(path, tensors, alignment=None):
    w = gguf.GGUFWriter(str(path), "test")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_string("general.name", "tiny")
    w.add_uint32("test.count", 7)
    w.add_float32("test.eps", 0.5)
    w.add_array("test.ids", [1, 2, 3])
    w.add_array("test.tokens", ["a", "bb", "ccc"])
    for name, arr, raw_dtype in tensors:
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_reader_reads_what_gguf_py_writes(tmp_path, alignment):
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((3, 5, 8)).astype(np.float16)
    q8 = quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), T.Q8_0)
    q6 = gguf_random_blocks("Q6_K", 2, 512).reshape(2, -1).numpy()
    path = tmp_path / "a.gguf"
    _gguf_py_file(path, [("dense", dense, None), ("q8", q8, T.Q8_0), ("blk.0.q6", q6, T.Q6_K)], alignment)
    info = _C.gguf_read(str(path))
    assert info["version"] == 3
    assert info["alignment"] == (alignment or 32)
    assert info["data_offset"] % (alignment or 32) == 0
    meta = info["metadata"]
    assert meta["general.name"] == "tiny" and meta["test.count"] == "7" and meta["test.eps"] == "0.5"
    assert meta["test.ids"] == "[1, 2, 3]" and meta["test.tokens"] == "[3 x STRING]"
    t = {r["name"]: r for r in info["tensors"]}
    assert [r["name"] for r in info["tensors"]] == ["dense", "q8", "blk.0.q6"]
    assert t["dense"]["shape"] == [3, 5, 8] and t["dense"]["type"] == "F16" and t["dense"]["format"] == ""
    assert t["q8"]["shape"] == [4, 64] and t["q8"]["type"] == "Q8_0" and t["q8"]["format"] == "q8_0"
    assert t["blk.0.q6"]["shape"] == [2, 512] and t["blk.0.q6"]["format"] == "q6_k"
    data = path.read_bytes()
    for name, arr in (("dense", dense), ("q8", q8), ("blk.0.q6", q6)):
        r = t[name]
        assert r["offset"] % (alignment or 32) == 0
        assert r["nbytes"] == arr.nbytes
        assert data[r["offset"]:r["offset"] + r["nbytes"]] == arr.tobytes(), name


def test_reader_rejects_damaged_files(tmp_path):
    raw = gguf_random_blocks("Q4_0", 2, 64)
    good = write_gguf(tmp_path / "good.gguf", [("w", (2, 64), "Q4_0", raw), ("b", (2,), "F32",
                                                                          torch.zeros(8, dtype=torch.uint8))])
    data = bytearray(open(good, "rb").read())
    assert len(_C.gguf_read(str(good))["tensors"]) == 2

    def read(blob, name):
        p = tmp_path / name
        p.write_bytes(bytes(blob))
        return _C.gguf_read(str(p))

    with pytest.raises(LayerstreamError, match="is not a GGUF file"):
        read(b"GGML" + data[4:], "magic.gguf")
    with pytest.raises(LayerstreamError, match="GGUF version 1 is not supported"):
        read(data[:4] + (1).to_bytes(4, "little") + data[8:], "v1.gguf")
    # gguf-py's big-endian files (GGUFWriter(endianess=BIG)): not "version 50331648"
    with pytest.raises(LayerstreamError, match="is a big-endian GGUF file .*gguf-convert-endian"):
        read(data[:4] + (3).to_bytes(4, "big") + data[8:], "big.gguf")
    with pytest.raises(LayerstreamError, match="the file ends .* while reading"):
        read(data[:40], "cut_header.gguf")
    with pytest.raises(LayerstreamError, match="tensor 'b' .* runs past the end"):
        read(data[:-4], "cut_data.gguf")
    with pytest.raises(LayerstreamError, match="does not exist"):
        _C.gguf_read(str(tmp_path / "nope.gguf"))
    bad = write_gguf(tmp_path / "t.gguf", [("w", (2, 64), "Q4_0", raw)])
    blob = bytearray(open(bad, "rb").read())
    type_at = blob.index(b"w") + 1 + 4 + 16  # name, n_dims, two dims
    blob[type_at:type_at + 4] = (99).to_bytes(4, "little")
    with pytest.raises(LayerstreamError, match="tensor 'w' has unknown ggml type 99"):
        read(blob, "type.gguf")
    blob[type_at:type_at + 4] = (2).to_bytes(4, "little")
    blob[type_at + 4:type_at + 12] = (8).to_bytes(8, "little")
    with pytest.raises(LayerstreamError, match="not a multiple of the alignment 32"):
        read(blob, "align.gguf")
    two = write_gguf(tmp_path / "two.gguf", [("a", (2, 64), "Q4_0", raw), ("b", (2, 64), "Q4_0", raw)])
    blob = bytearray(open(two, "rb").read())
    off_b = blob.index(b"\x01\x00\x00\x00\x00\x00\x00\x00b") + 9 + 4 + 16 + 4  # b's offset field
    blob[off_b:off_b + 8] = (0).to_bytes(8, "little")
    with pytest.raises(LayerstreamError, match="tensors 'a' and 'b' overlap"):
        read(blob, "overlap.gguf")
    blocks = write_gguf(tmp_path / "blk.gguf", [("w", (2, 64), "Q4_0", raw)])
    blob = bytearray(open(blocks, "rb").read())
    dim0 = blob.index(b"w") + 1 + 4
    blob[dim0:dim0 + 8] = (48).to_bytes(8, "little")
    with pytest.raises(LayerstreamError, match="not a multiple of the block size 32"):
        read(blob, "blocks.gguf")


class Net(nn.Module):
    def __init__(self, vocab=0):
        super().__init__()
        self.emb = nn.Embedding(vocab, 256) if vocab else None
        self.up = nn.Linear(256, 512)
        self.norm = nn.LayerNorm(512)
        self.down = nn.Linear(512, 256, bias=False)
        self.head = nn.Linear(256, 64)

    def forward(self, x):
        if self.emb is not None:
            x = self.emb(x)
        return self.head(torch.relu(self.down(self.norm(self.up(x)))))


TYPES = {"up.weight": "Q4_K", "down.weight": "Q8_0", "head.weight": "Q6_K"}


def _net_file(tmp_path, dtype=torch.bfloat16, vocab=0, emb_type="F16"):
    """A .gguf of Net: Q8_0 quantized by gguf-py from real weights, K-quants random;
    returns (path, reference Net with the dequantized values, in `dtype`)."""
    torch.manual_seed(0)
    src = Net(vocab)
    tensors, values = [], {}
    for k, v in src.state_dict().items():
        t = TYPES.get(k, emb_type if k == "emb.weight" else "F32")
        if t == "Q8_0":
            raw = torch.from_numpy(quants.quantize(v.numpy(), T.Q8_0).reshape(-1).copy())
        elif t in ("F32", "F16"):
            raw = v.to(torch.float32 if t == "F32" else torch.float16).reshape(-1).view(torch.uint8)
        else:
            raw = gguf_random_blocks(t, v.shape[0], v.shape[1], seed=len(tensors))
        tensors.append((k, tuple(v.shape), t, raw))
        if t in ("F32", "F16"):
            values[k] = raw.view(torch.float32 if t == "F32" else torch.float16).reshape(v.shape)
        else:
            values[k] = torch.from_numpy(quants.dequantize(raw.reshape(v.shape[0], -1).numpy(),
                                                           getattr(T, t)).copy())
    path = write_gguf(tmp_path / "net.gguf", tensors, metadata={"general.name": "net"})
    ref = Net(vocab)
    ref.load_state_dict({k: v.float() for k, v in values.items()})
    return path, ref.to(dtype)


def _meta_net(vocab=0, dtype=torch.bfloat16):
    with torch.device("meta"):
        return Net(vocab).to(dtype)


def test_load_gguf_keeps_linear_weights_packed_and_streams_them(tmp_path):
    path, ref = _net_file(tmp_path)
    model = _meta_net()
    r = layerstream.load_gguf(model, str(path))
    assert sorted(r.packed) == sorted(TYPES)
    assert sorted(r.dense) == ["head.bias", "norm.bias", "norm.weight", "up.bias"]
    assert r.dequantized == [] and r.missing == [] and r.unexpected == []
    assert r.metadata["general.name"] == "net"
    assert isinstance(model.up.weight, GgufWeight) and model.up.weight.gguf_format == "q4_k"
    assert not model.up.weight.requires_grad and model.up.weight.is_meta
    assert r.packed_bytes == (512 * 256 // 256 * 144 + 256 * 512 // 32 * 34 + 64 * 256 // 256 * 210)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    with pytest.raises(LayerstreamError, match=r"'up.weight' is GGUF q4_k .* call layerstream.offload"):
        model(x)
    h = layerstream.offload(model, device="sim", checker=True)
    assert h.stats()["quantized_layers"] == 3
    with torch.no_grad():
        y, want = model(x), ref(x)
    assert torch.equal(y, want), "the device dequantization must equal gguf-py's values"
    # The file's bytes (each packed tensor padded to 256 bytes) and the biases, nothing else.
    bus = sum(-(-model.get_submodule(k[:-7]).weight.numel() // GGUF_BLOCKS[t][1] * GGUF_BLOCKS[t][2] // 256) * 256
              for k, t in TYPES.items())
    assert bus - r.packed_bytes == 128  # head: 13440 bytes
    assert h.stats()["h2d_bytes"] == bus + (512 + 64) * 2
    # Frozen packed weights, but the input gradient flows (LoRA-style training).
    xg = x.clone().requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    model(xg).float().square().sum().backward()
    ref.requires_grad_(False)
    ref(xr).float().square().sum().backward()
    assert torch.equal(xg.grad, xr.grad)
    assert h.ordering_errors() == []
    h.detach()
    for k in TYPES:  # dense, dequantized
        p = model.get_parameter(k)
        assert type(p) is nn.Parameter and not p.requires_grad
        assert torch.equal(p, ref.get_parameter(k))
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_gguf_weights_refuse_writes_and_saving_but_deep_copy(tmp_path):
    path, ref = _net_file(tmp_path)
    model = _meta_net()
    layerstream.load_gguf(model, str(path))
    with pytest.raises(LayerstreamError, match="'down.weight' is GGUF q8_0 .* writing into it"):
        with torch.no_grad():
            model.down.weight.copy_(torch.zeros(256, 512))
    for save in (lambda: torch.save(model.state_dict(), io.BytesIO()),
                 lambda: safetensors.torch.save(model.state_dict())):
        with pytest.raises(LayerstreamError, match="'[a-z]+.weight' is GGUF .* saving it .* is not possible"):
            save()
    twin = copy.deepcopy(model)
    assert twin.up.weight.gguf_bytes is model.up.weight.gguf_bytes
    assert torch.equal(twin.up.weight.dequantized(), ref.up.weight)
    h = layerstream.offload(model, device="sim")
    with pytest.raises(LayerstreamError, match=r"the model is offloaded .* handle.detach\(\) first"):
        layerstream.load_gguf(model, str(path))
    with pytest.raises(RuntimeError, match="layer 'up' was not quantized by offload\\(\\) \\(its weight came "
                                           "pre-packed: detach\\(\\), load, and offload\\(\\) again"):
        model.load_state_dict(ref.state_dict())
    h.detach()


@pytest.mark.parametrize("how", ["exclude", "budget"])
def test_gguf_layers_that_stay_resident_are_dequantized(tmp_path, how):
    """A GGUF Linear that does not stream (excluded, or kept resident by the
    planner) gets its dense, dequantized weight at offload()."""
    path, ref = _net_file(tmp_path)
    model = _meta_net()
    layerstream.load_gguf(model, str(path))
    kw = {"exclude": ["head"]} if how == "exclude" else {"budget": "1GiB"}
    h = layerstream.offload(model, device="sim", **kw)
    if how == "budget":
        assert h.stats()["resident_layers"] == 3
    assert type(model.head.weight) is nn.Parameter
    assert torch.equal(model.head.weight, ref.head.weight)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    h.detach()


class _Block(nn.Module):  # a module with a Linear below it, for offload(groups=...)
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("how", ["streamed", "resident"])
def test_gguf_linear_in_a_groups_module_streams_packed_with_it(tmp_path, how):
    """offload(groups=[...]) streams a module whole as one tensor group; a GGUF
    weight below it crosses as the file's blocks with the group's other tensors and
    is dequantized into the slot. Kept resident by the planner, the group's GGUF
    weights are dequantized at offload(). Outputs equal the reference either way;
    detach() leaves the dequantized weights."""
    path, ref = _net_file(tmp_path)
    net = _meta_net()
    layerstream.load_gguf(net, str(path))
    model = _Block(net)
    kw = {"budget": "1GiB"} if how == "resident" else {}
    h = layerstream.offload(model, device="sim", groups=["net"], checker=True, **kw)
    stats = h.stats()
    if how == "resident":
        assert stats["resident_layers"] == 1 and type(net.up.weight) is nn.Parameter
    else:
        assert stats["group_layers"] == 1 and stats["quantized_layers"] == 1
        # The three GGUF weights are in the store as the file's blocks (padded), not dense.
        assert stats["pinned_bytes"] < 512 * 256 * 2
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    assert h.ordering_errors() == []
    h.detach()
    for n in ("up", "down", "head"):
        w = getattr(net, n).weight
        assert type(w) is nn.Parameter and torch.equal(w, getattr(ref, n).weight), n


def test_quantized_tensors_of_other_layers_are_dequantized_on_load(tmp_path):
    path, ref = _net_file(tmp_path, vocab=100, emb_type="Q8_0")
    model = _meta_net(vocab=100)
    r = layerstream.load_gguf(model, str(path))
    assert r.dequantized == ["emb.weight"]
    assert type(model.emb.weight) is nn.Parameter and torch.equal(model.emb.weight, ref.emb.weight)
    ids = torch.randint(0, 100, (2, 3))
    h = layerstream.offload(model, device="sim")
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))
    h.detach()


def test_load_gguf_into_real_parameters_writes_in_place(tmp_path):
    path, ref = _net_file(tmp_path, dtype=torch.float32)
    model = Net()
    norm_w = model.norm.weight
    layerstream.load_gguf(model, str(path))
    assert model.norm.weight is norm_w and torch.equal(norm_w, ref.norm.weight)
    assert isinstance(model.up.weight, GgufWeight) and model.up.weight.dtype == torch.float32


def test_strict_names_and_rename(tmp_path):
    path, ref = _net_file(tmp_path)
    model = _meta_net(vocab=10)  # emb.weight is not in the file
    with pytest.raises(LayerstreamError, match=r"1 parameter\(s\)/buffer\(s\) of the model are not in the "
                                               r"file: emb.weight.*rename=.*strict=False"):
        layerstream.load_gguf(model, str(path))
    assert model.up.weight.is_meta and not isinstance(model.up.weight, GgufWeight)  # nothing changed
    r = layerstream.load_gguf(model, str(path), strict=False)
    assert r.missing == ["emb.weight"] and r.unexpected == []
    # Names mapped by a dict and by a function; None skips a tensor.
    renamed = write_gguf(tmp_path / "r.gguf", [("blk.up", (512, 256), "Q4_0", gguf_random_blocks("Q4_0", 512, 256)),
                                                ("extra", (4,), "F32", torch.zeros(16, dtype=torch.uint8))])
    with torch.device("meta"):
        lin = nn.Sequential(nn.Linear(256, 512, bias=False))
    with pytest.raises(LayerstreamError, match=r"2 tensor\(s\) of the file name nothing in the model: blk.up, extra"):
        layerstream.load_gguf(lin, str(renamed))
    r = layerstream.load_gguf(lin, str(renamed), rename={"blk.up": "0.weight", "extra": None})
    assert r.packed == ["0.weight"] and r.unexpected == []
    with torch.device("meta"):
        lin = nn.Sequential(nn.Linear(256, 512, bias=False))
    r = layerstream.load_gguf(lin, str(renamed), rename=lambda n: "0.weight" if n == "blk.up" else None)
    assert r.packed == ["0.weight"]


def test_shape_and_type_errors_change_nothing(tmp_path):
    raw = gguf_random_blocks("Q4_0", 512, 256)
    with torch.device("meta"):
        lin = nn.Sequential(nn.Linear(512, 256, bias=False))
    p = write_gguf(tmp_path / "s.gguf", [("0.weight", (512, 256), "Q4_0", raw)])
    with pytest.raises(LayerstreamError, match=r"tensor '0.weight' has shape \[512, 256\] .* is \[256, 512\]"):
        layerstream.load_gguf(lin, str(p))
    p = write_gguf(tmp_path / "t.gguf", [("0.weight", (256, 512), "IQ4_NL", gguf_random_blocks("IQ4_NL", 256, 512))])
    with pytest.raises(LayerstreamError, match="GGUF type IQ4_NL, which layerstream cannot read"):
        layerstream.load_gguf(lin, str(p))
    assert not isinstance(lin[0].weight, GgufWeight)


def test_a_float_tensor_and_an_integer_one_do_not_load_into_each_other_with_either_loader(tmp_path):
    """load_gguf() cast a float tensor of the file into an integer buffer (0.7 -> 0,
    -2.5 -> -2) and an integer one into a float parameter, silently, where
    load_safetensors() refuses the same: both now apply one rule, before anything
    changes. Integer into integer and float into float still load (cast)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.register_buffer("pos", torch.zeros(4, dtype=torch.int64))

    ones, ramp = np.ones((8, 8), np.float32), np.arange(8, dtype=np.float32)
    cases = {"pos": [("a.weight", ones, None), ("a.bias", ramp, None),
                     ("pos", np.array([0.7, 1.9, -2.5, 3.0], np.float32), None)],
             "a.bias": [("a.weight", ones, None), ("a.bias", np.arange(8, dtype=np.int32), None),
                        ("pos", np.arange(4, dtype=np.int32), None)]}
    for dst, tensors in cases.items():
        path = tmp_path / f"{dst}.gguf"
        _gguf_py_file(path, tensors)
        with torch.device("meta"):
            model = M()
        with pytest.raises(LayerstreamError, match=rf"tensor '{dst}' is GGUF type (F32|I32) but '{dst}' in the "
                                                   rf"model is torch\.(int64|float32); a floating-point tensor "
                                                   rf"and an integer one do not load into each other"):
            layerstream.load_gguf(model, str(path))
        assert all(t.is_meta and not isinstance(t, GgufWeight) for t in model.state_dict().values())
        st = tmp_path / f"{dst}.safetensors"
        safetensors.torch.save_file({n: torch.from_numpy(a) for n, a, _ in tensors}, str(st))
        with pytest.raises(LayerstreamError, match=rf"tensor '{dst}' is (F32|I32) but '{dst}' in the model is "
                                                   rf"torch\.(int64|float32); a floating-point tensor and an "
                                                   rf"integer one do not load into each other"):
            layerstream.load_safetensors(model, str(st))
    path = tmp_path / "ok.gguf"  # int32 into the int64 buffer
    _gguf_py_file(path, [("a.weight", ones, None), ("a.bias", ramp, None), ("pos", np.arange(4, dtype=np.int32), None)])
    with torch.device("meta"):
        model = M()
    layerstream.load_gguf(model, str(path))
    assert model.pos.dtype == torch.int64 and model.pos.tolist() == [0, 1, 2, 3]
    assert torch.equal(model.a.bias, torch.arange(8, dtype=torch.float32))


def test_a_0d_tensor_loads(tmp_path):
    """gguf-py writes a 0-d tensor (CLIP's logit_scale) with no dimensions; the reader
    refused the whole file ("0 dimensions (1 to 8 are valid)")."""
    class WithScale(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.logit_scale = nn.Parameter(torch.tensor(2.6592))

    torch.manual_seed(0)
    src = WithScale()
    path = tmp_path / "scalar.gguf"
    _gguf_py_file(path, [(k, v.detach().numpy(), None) for k, v in src.state_dict().items()])
    with torch.device("meta"):
        model = WithScale()
    layerstream.load_gguf(model, str(path))
    for k, v in src.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_meta_tied_parameters_stay_tied(tmp_path):
    with torch.device("meta"):
        m = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32, bias=False))
    m[1].weight = m[0].weight
    table = torch.randn(32, 16).to(torch.float16)
    p = write_gguf(tmp_path / "tied.gguf", [("0.weight", (32, 16), "F16", table.reshape(-1).view(torch.uint8))])
    r = layerstream.load_gguf(m, str(p))
    assert r.dense == ["0.weight"] and r.missing == []
    assert m[1].weight is m[0].weight and torch.equal(m[0].weight, table.float())


@pytest.mark.parametrize("kw", [{}, {"budget": "1GiB"}])
def test_a_gguf_weight_tied_to_an_embedding_stays_tied_and_trains_like_the_resident_model(tmp_path, kw):
    """A head tied to its embedding table, the file naming the head (Q8_0, kept packed
    by load_gguf in both places). offload() used to give the table a dense copy of its
    own while the head streamed the file's blocks (and a resident layer a copy per
    holder), so the tie came apart: after detach(), training the table left the head
    as it was. Now the tied weight is dequantized once for both, and logits and a
    training step equal the resident model's."""
    torch.manual_seed(0)
    w, h1 = torch.randn(64, 256), torch.randn(256, 256) * 0.05
    q = {n: torch.from_numpy(quants.quantize(t.numpy(), T.Q8_0).reshape(-1).copy()) for n, t in (("w", w), ("h", h1))}
    b = torch.randn(256)
    path = write_gguf(tmp_path / "tied.gguf", [("1.weight", (256, 256), "Q8_0", q["h"]),
                                               ("1.bias", (256,), "F32", b.view(torch.uint8)),
                                               ("2.weight", (64, 256), "Q8_0", q["w"])])

    def build():
        m = nn.Sequential(nn.Embedding(64, 256), nn.Linear(256, 256), nn.Linear(256, 64, bias=False))
        m[2].weight = m[0].weight
        return m

    ref = build()
    with torch.no_grad():
        ref[0].weight.copy_(torch.from_numpy(quants.dequantize(q["w"].numpy().reshape(64, -1), T.Q8_0)))
        ref[1].weight.copy_(torch.from_numpy(quants.dequantize(q["h"].numpy().reshape(256, -1), T.Q8_0)))
        ref[1].bias.copy_(b)
    ref.requires_grad_(False)
    with torch.device("meta"):
        model = build()
    layerstream.load_gguf(model, str(path))
    assert isinstance(model[0].weight, GgufWeight) and model[2].weight is model[0].weight
    with pytest.warns(RuntimeWarning, match=r"1 GGUF weight\(s\) are tied .* 0.weight = 2.weight"):
        handle = layerstream.offload(model, device="sim", **kw)
    assert model[2].weight is model[0].weight
    ids = torch.randint(0, 64, (3, 5))
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))
    handle.detach()
    assert model[2].weight is model[0].weight
    for m in (model, ref):  # one step on the tied weight, through the table and the head
        m[0].weight.requires_grad_(True)
        opt = torch.optim.SGD([m[0].weight], lr=0.1)
        m(ids).square().mean().backward()
        opt.step()
    assert model[2].weight is model[0].weight and torch.equal(model[0].weight, ref[0].weight)
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))


class _DiffusersGgufNet(nn.Module):
    """Four diffusers GGUFLinear layers (Q8_0, Q4_0, Q4_K, Q6_K blocks in GGUFParameters,
    bf16 compute and biases) and a dense bf16 head, as GGUFQuantizationConfig builds them."""

    TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")
    SCALES = {"Q8_0": 0.004, "Q4_0": 0.01, "Q4_K": 0.00005, "Q6_K": 0.0001}

    def __init__(self):
        super().__init__()
        from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter
        self.blocks = nn.ModuleList()
        for i, t in enumerate(self.TYPES):
            layer = GGUFLinear(256, 256, bias=True, compute_dtype=torch.bfloat16)
            blocks = gguf_random_blocks(t, 256, 256, seed=i, scale=self.SCALES[t])  # outputs near the inputs' scale
            layer.weight = GGUFParameter(blocks.reshape(256, -1), quant_type=int(T[t]))
            layer.bias = nn.Parameter(torch.randn(256, generator=torch.Generator().manual_seed(9 + i)).to(
                torch.bfloat16), requires_grad=False)
            self.blocks.append(layer)
        self.head = nn.Linear(256, 8).to(torch.bfloat16)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(8, 256, generator=torch.Generator().manual_seed(7)) * 0.05)
            self.head.bias.zero_()

    def forward(self, x):
        for b in self.blocks:
            x = torch.nn.functional.gelu(b(x))
        return self.head(x)


@pytest.mark.parametrize("cache", [False, True])
def test_diffusers_gguf_layers_stream_their_blocks_and_compute_what_diffusers_computes(offload_sim, cache):
    """diffusers' GGUFLinear layers (GGUFQuantizationConfig) stream as tensor groups: the
    file's blocks cross the bus as they are and diffusers' own forward dequantizes them
    on the device, so outputs, input gradients and the head's gradients equal the
    resident diffusers model's bit for bit over training steps (Note [diffusers' GGUF
    layers stream as groups]); a compiled model equals the eager one within bf16
    rounding; detach() gives back the GGUFParameters."""
    model, ref = _DiffusersGgufNet(), _DiffusersGgufNet()
    blocks = [m.weight.detach().clone() for m in model.blocks]  # the bytes, to compare after detach()
    packed = sum(w.numel() for w in blocks) + 4 * 256 * 2  # the blocks and the bf16 biases
    handle = offload_sim(model, budget="150KiB", slots=2, cache_across_steps=cache)  # 2 slots of Q8_0's
    assert handle.stats()["group_layers"] == 4 and "blocks.0" in handle.layers
    opt, ref_opt = torch.optim.SGD(model.head.parameters(), lr=0.1), torch.optim.SGD(ref.head.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 256, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        before = handle.stats()["h2d_bytes"]
        out, want = model(xs), ref(xr)
        assert torch.equal(out, want), step
        if not cache:  # every group's blocks cross once in the forward (the head is resident)
            assert handle.stats()["h2d_bytes"] - before == packed
        out.float().square().mean().backward()
        want.float().square().mean().backward()
        assert torch.equal(xs.grad, xr.grad) and torch.equal(model.head.weight.grad, ref.head.weight.grad), step
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    x = torch.randn(4, 256).to(torch.bfloat16)
    eager = model(x)
    compiled = torch.compile(model)(x)
    assert torch.allclose(compiled.float(), eager.float(), rtol=0.02, atol=0.02)
    handle.detach()
    assert [type(m.weight).__name__ for m in model.blocks] == ["GGUFParameter"] * 4
    assert [m.weight.quant_type for m in model.blocks] == [int(T[t]) for t in _DiffusersGgufNet.TYPES]
    assert all(torch.equal(m.weight, w) for m, w in zip(model.blocks, blocks))
    assert torch.equal(model(x), ref(x))


def test_peft_lora_over_diffusers_gguf_layers_streams_and_matches(offload_sim):
    """peft's LoRA over streamed diffusers GGUFLinear layers: outputs and adapter
    gradients of one step equal the resident model's bit for bit."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, target_modules=[f"blocks.{i}" for i in range(4)], init_lora_weights=False)

    def lora():
        torch.manual_seed(1)
        return peft.get_peft_model(_DiffusersGgufNet(), cfg)
    model, ref = lora(), lora()
    handle = offload_sim(model, budget="180KiB", slots=2, exclude=["*lora_*"])
    assert handle.stats()["group_layers"] == 4
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out, want = model(x), ref(x)
    assert torch.equal(out, want)
    out.float().square().mean().backward()
    want.float().square().mean().backward()
    grads = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters()) if p.requires_grad]
    assert len(grads) == 8 and all(torch.equal(a, b) for _, a, b in grads), [n for n, a, b in grads
                                                                                if not torch.equal(a, b)]


class _Pair(nn.Module):
    """A custom block around two GGUFLinear layers, streamed whole with offload(groups=...)."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x):
        return torch.nn.functional.gelu(self.b(torch.nn.functional.gelu(self.a(x))))


def test_a_custom_group_holding_diffusers_gguf_layers_streams_their_blocks(offload_sim):
    """offload(groups=...) on a module whose parameters include GGUF blocks (uint8): they
    cross as they are inside the group's slot and the layers' own forwards decode them;
    outputs and input gradients equal the resident model's."""
    def build():
        n, k = _DiffusersGgufNet(), _DiffusersGgufNet()
        return nn.Sequential(_Pair(n.blocks[0], n.blocks[1]), _Pair(n.blocks[2], n.blocks[3]),
                             _Pair(k.blocks[0], k.blocks[1]), _Pair(k.blocks[2], k.blocks[3]), n.head)
    model, ref = build(), build()
    handle = offload_sim(model, budget="220KiB", slots=2, groups=["0", "1", "2", "3"])
    assert handle.stats()["group_layers"] == 4 and handle.layers == ["0", "1", "2", "3"]
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = model(xs), ref(xr)
    assert torch.equal(out, want)
    out.float().square().mean().backward()
    want.float().square().mean().backward()
    assert torch.equal(xs.grad, xr.grad)


def test_the_original_systems_api_leaves_diffusers_gguf_layers_resident_and_says_offload_streams_them():
    """layerstream.compat streams Linear and conv layers only (as the original system):
    a diffusers GGUFLinear stays resident there, computing as before, and the warning
    names offload(), which streams it."""
    import warnings
    from layerstream.compat import MemoryManager
    model, ref = _DiffusersGgufNet(), _DiffusersGgufNet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MemoryManager.attach(model, torch.device("cpu"), offload_percent=1.0)
    said = [str(w.message) for w in caught if "GGUF" in str(w.message)]
    assert len(said) == 1 and "layerstream.offload() streams it" in said[0] and "'blocks.3'" in said[0], said
    assert hasattr(model.head, "_layer_memory_manager")  # the head streams
    assert not any(hasattr(b, "_layer_memory_manager") for b in model.blocks)
    x = torch.randn(2, 256).to(torch.bfloat16)
    assert torch.equal(model(x), ref(x))
    MemoryManager.detach(model)


def test_quantize_names_a_gguf_format_is_refused():
    model = Net()
    with pytest.raises(ValueError, match="'q4_k' is a GGUF format: .*load_gguf.*int8, fp8"):
        layerstream.offload(model, device="sim", quantize="q4_k")
    assert type(model.up.weight) is nn.Parameter


def test_quantize_over_gguf_layers_warns_that_they_stream_as_stored(tmp_path):
    """quantize="nf4" (or a dict whose wildcard gives them a format) over layers load_gguf()
    kept packed was ignored without a word: they streamed their GGUF blocks all the same.
    Now a warning names them and their formats; the numbers and the bytes on the bus are
    those of the run without quantize=."""
    path, ref = _net_file(tmp_path, dtype=torch.float32)
    x = torch.randn(5, 256)
    want = ref(x)
    plain = _meta_net(dtype=torch.float32)
    layerstream.load_gguf(plain, str(path))
    h = layerstream.offload(plain, device="sim")
    plain(x)
    bus = h.stats()["h2d_bytes"]
    h.detach()
    for quantize in ("nf4", {"*": "int4"}):
        model = _meta_net(dtype=torch.float32)
        layerstream.load_gguf(model, str(path))
        with pytest.warns(RuntimeWarning, match=r"quantize=.* does not apply to 3 layer\(s\) whose weights came "
                                                r"quantized .*stream as stored: 'up' \(GGUF q4_k blocks\), "
                                                r"'down' \(GGUF q8_0 blocks\), 'head' \(GGUF q6_k blocks\)"):
            h = layerstream.offload(model, device="sim", quantize=quantize)
        assert torch.equal(model(x), want)
        assert h.stats()["h2d_bytes"] == bus
        h.detach()


def test_quantize_dict_naming_a_gguf_layer_is_refused(tmp_path):
    """quantize={"down": "int4"} naming a layer load_gguf() kept packed was ignored without
    a word (it streamed its Q8_0 blocks). Now an error names the layer and what to do,
    before anything changes."""
    path, ref = _net_file(tmp_path, dtype=torch.float32)
    model = _meta_net(dtype=torch.float32)
    layerstream.load_gguf(model, str(path))
    with pytest.raises(LayerstreamError, match=r"quantize=\{'down': 'int4', \.\.\.\} names layer 'down', whose "
                                               r"weights came quantized \(GGUF q8_0 blocks\): they stream as "
                                               r"stored.*Leave the layer out of quantize=.*dequantized\(\)"):
        layerstream.offload(model, device="sim", quantize={"down": "int4"})
    assert all(isinstance(model.get_submodule(k[:-7]).weight, GgufWeight) for k in TYPES)
    h = layerstream.offload(model, device="sim", quantize={"down": None})
    x = torch.randn(5, 256)
    assert torch.equal(model(x), ref(x))
    h.detach()


def test_lora_over_a_gguf_base_trains(tmp_path):
    """peft over GgufWeights (before offload): the adapters land in host memory, and
    training them gives the gradients of a dense model holding the dequantized values."""
    peft = pytest.importorskip("peft")
    path, ref = _net_file(tmp_path, dtype=torch.float32)
    model = _meta_net(dtype=torch.float32)
    layerstream.load_gguf(model, str(path))
    cfg = peft.LoraConfig(r=4, target_modules=["up", "down"], init_lora_weights=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, cfg)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(lora) == 4 and all(p.device.type == "cpu" and not p.is_meta for p in lora.values())
    torch.manual_seed(1)
    ref = peft.get_peft_model(ref, cfg)
    ref_lora = {n: p for n, p in ref.named_parameters() if "lora_" in n}
    for n, p in lora.items():
        assert torch.equal(p, ref_lora[n])
    h = layerstream.offload(model, device="sim", checker=True)
    x = torch.randn(4, 256)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    for n, p in lora.items():
        torch.testing.assert_close(p.grad, ref_lora[n].grad, rtol=1e-5, atol=1e-5)
    assert h.ordering_errors() == []
    h.detach()



def test_a_transformers_model_built_empty_loads_and_streams(tmp_path):
    """The intended use: a transformers Llama built without weights (accelerate's
    init_empty_weights: parameters on meta, buffers such as rotary inv_freq real),
    its Linear weights from a GGUF file (Q8_0 / Q4_0 quantized by gguf-py from the
    reference's values), the tied table dense. Logits equal the reference model's
    holding the dequantized values."""
    accelerate = pytest.importorskip("accelerate")
    from conftest import tiny_llama

    ref = tiny_llama(tie_word_embeddings=True).eval()
    tensors = []
    with torch.no_grad():
        for name, p in ref.named_parameters():  # lm_head.weight is embed_tokens': listed once
            w = p.detach()
            if name.endswith("proj.weight"):
                t = T.Q4_0 if "down_proj" in name else T.Q8_0
                raw = quants.quantize(w.numpy(), t)
                p.copy_(torch.from_numpy(quants.dequantize(raw, t).copy()))
                tensors.append((name, tuple(w.shape), t.name, torch.from_numpy(raw.reshape(-1).copy())))
            else:
                tensors.append((name, tuple(w.shape), "F32", w.contiguous().reshape(-1).view(torch.uint8).clone()))
    path = write_gguf(tmp_path / "llama.gguf", tensors)
    with accelerate.init_empty_weights():
        model = tiny_llama(seed=None, tie_word_embeddings=True).eval()
    model.tie_weights()  # transformers ties in from_pretrained(); an empty model is tied by hand
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    assert model.lm_head.weight is model.model.embed_tokens.weight
    r = layerstream.load_gguf(model, str(path))
    assert len(r.packed) == 14 and r.missing == [] and r.unexpected == []
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.is_meta
    h = layerstream.offload(model, device="sim", checker=True)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert torch.equal(got, want)
    assert h.stats()["quantized_layers"] == 14
    assert h.ordering_errors() == []
    h.detach()


def test_file_bytes_are_released_as_each_layer_is_stored(tmp_path, monkeypatch):
    """offload() copies each GGUF weight's bytes into the engine's host store and
    lets go of them then, not when it returns: the file is not held twice."""
    import gc
    import weakref
    path, _ = _net_file(tmp_path)
    model = _meta_net()
    layerstream.load_gguf(model, str(path))
    held = [weakref.ref(model.get_parameter(k).gguf_bytes) for k in ("up.weight", "down.weight", "head.weight")]
    alive_at_call = []
    original = _C.Engine.add_linear_packed

    def counting(self, *args, **kwargs):
        gc.collect()
        alive_at_call.append(sum(r() is not None for r in held))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(_C.Engine, "add_linear_packed", counting)
    h = layerstream.offload(model, device="sim")
    assert alive_at_call == [3, 2, 1]
    gc.collect()
    assert all(r() is None for r in held)
    h.detach()



def test_rename_splits_a_fused_tensor_by_rows(tmp_path):
    """A fused qkv weight (and its bias) in the file, separate q/k/v Linears in the
    model (diffusers' Flux vs the original's): rename= gives each its rows; each
    part stays packed (a row range of a GGUF tensor is whole blocks) and streams."""
    raw = gguf_random_blocks("Q4_K", 3 * 64, 256, seed=5)
    bias = torch.randn(3 * 64)
    path = write_gguf(tmp_path / "qkv.gguf", [("attn.qkv.weight", (192, 256), "Q4_K", raw),
                                              ("attn.qkv.bias", (192,), "F32", bias.view(torch.uint8))])
    whole = _C.dequantize_packed("q4_k", raw, 192, 256, torch.float32)
    with torch.device("meta"):
        model = nn.ModuleDict({"q": nn.Linear(256, 64), "k": nn.Linear(256, 64), "v": nn.Linear(256, 64)})
    split = {n: [(f"{p}.{n.split('.')[-1]}", (64 * i, 64 * i + 64)) for i, p in enumerate("qkv")]
             for n in ("attn.qkv.weight", "attn.qkv.bias")}
    r = layerstream.load_gguf(model, str(path), rename=split)
    assert sorted(r.packed) == ["k.weight", "q.weight", "v.weight"] and r.missing == []
    assert model["k"].weight.gguf_bytes.numel() == 64 * 144
    for i, p in enumerate("qkv"):
        assert torch.equal(model[p].weight.dequantized(), whole[64 * i:64 * i + 64])
        assert torch.equal(model[p].bias, bias[64 * i:64 * i + 64])
    h = layerstream.offload(model, device="sim")
    x = torch.randn(3, 256)
    with torch.no_grad():
        got = torch.cat([model[p](x) for p in "qkv"], dim=-1)
    assert torch.equal(got, nn.functional.linear(x, whole, bias))
    h.detach()
    with torch.device("meta"):
        model = nn.ModuleDict({"q": nn.Linear(256, 64)})
    with pytest.raises(LayerstreamError, match=r"rows 128:256 of 'attn.qkv.weight', which has 192 rows"):
        layerstream.load_gguf(model, str(path), rename={"attn.qkv.weight": [("q.weight", (128, 256))]},
                              strict=False)
    with pytest.raises(LayerstreamError, match=r"tensor 'attn.qkv.weight' \(rows 0:32\) has shape \[32, 256\]"):
        layerstream.load_gguf(model, str(path), rename={"attn.qkv.weight": [("q.weight", (0, 32))]},
                              strict=False)
    with pytest.raises(LayerstreamError, match="give a parameter name, None"):
        layerstream.load_gguf(model, str(path), rename={"attn.qkv.weight": 7}, strict=False)


def _llama_cpp_file(path, ref):
    """A GGUF file of `ref` (a transformers Llama) as llama.cpp's converter writes
    one: its tensor names, its metadata, and the rows of q/k (weights and biases)
    reordered per head for llama.cpp's rotary layout (done here independently of
    layerstream: reshape to (heads, 2, half, ...) and swap the middle axes). The
    projections are Q8_0, everything else F32."""
    cfg = ref.config
    table, w = _llama_cpp_writer(path, gguf.MODEL_ARCH.LLAMA, cfg)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_token_types([1] * cfg.vocab_size)
    for name, p in ref.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        a = p.detach().numpy().astype(np.float32)
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(base.split(".")[-1])
        if heads:
            a = a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if a.ndim == 2 and base.endswith("proj"):
            w.add_tensor(f"{table.get_name(base)}.{suffix}", quants.quantize(a, T.Q8_0), raw_dtype=T.Q8_0)
        else:
            w.add_tensor(f"{table.get_name(base)}.{suffix}", a)
    # Llama 3's rotary scaling table, which transformers computes from the config.
    w.add_tensor("rope_freqs.weight", np.ones(cfg.hidden_size // cfg.num_attention_heads // 2, np.float32))
    return _written(w, path)


def _llama_cpp_writer(path, arch, cfg):
    """gguf-py's name table for `arch` and a writer with the metadata every
    llama.cpp language-model file has (block count, width, head counts)."""
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    return gguf.get_tensor_name_map(arch, cfg.num_hidden_layers), w


def _written(w, path):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _empty_llama(config):
    accelerate = pytest.importorskip("accelerate")
    from transformers import LlamaForCausalLM
    with accelerate.init_empty_weights():
        return LlamaForCausalLM(config).eval()


def test_llama_cpp_file_loads_packed_in_the_models_row_order(tmp_path):
    """A Llama file with llama.cpp's names and q/k row order (4 query heads, 2 kv
    heads, q/k/v biases), loaded with rename="llama.cpp" into the model built
    empty: every projection stays packed and holds exactly the values of the
    reference's own weight quantized by gguf-py (Q8_0 blocks run along a row, so
    quantizing commutes with reordering rows), the biases are the reference's,
    and the streamed logits equal the reference holding those values. With
    permute_qk=False (the file's rows as they are) q and k differ."""
    from conftest import tiny_llama

    ref = tiny_llama(num_attention_heads=4, num_key_value_heads=2, attention_bias=True).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias"):  # transformers starts them at zero, which any row order keeps
                p.copy_(torch.randn(p.shape))
    path = _llama_cpp_file(tmp_path / "llama.gguf", ref)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_(torch.from_numpy(quants.dequantize(quants.quantize(p.numpy(), T.Q8_0), T.Q8_0).copy()))
    model = _empty_llama(ref.config)
    r = layerstream.load_gguf(model, str(path), rename="llama.cpp")
    assert len(r.packed) == 14 and r.missing == [] and r.unexpected == []
    assert "model.layers.1.self_attn.k_proj.bias" in r.dense
    params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = params[name]
        got = p.dequantized() if isinstance(p, GgufWeight) else p
        assert torch.equal(got, want), name
    h = layerstream.offload(model, device="sim", checker=True)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert h.ordering_errors() == []
    h.detach()

    unordered = _empty_llama(ref.config)
    layerstream.load_gguf(unordered, str(path), rename="llama.cpp", permute_qk=False)
    attn = unordered.model.layers[0].self_attn
    assert not torch.equal(attn.q_proj.weight.dequantized(), params["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(attn.k_proj.bias, params["model.layers.0.self_attn.k_proj.bias"])
    assert torch.equal(attn.v_proj.bias, params["model.layers.0.self_attn.v_proj.bias"])


def test_llama_cpp_file_loads_like_transformers_gguf_loader(tmp_path):
    """The same file (no biases: transformers' GGUF config has no attention_bias)
    through transformers' own GGUF loader (from_pretrained(gguf_file=): gguf-py's
    name table, its numpy row reorder, dequantized to fp32) and, as the README
    shows, through a model built empty from the file's config +
    load_gguf(rename="llama.cpp") + offload(): equal logits."""
    accelerate = pytest.importorskip("accelerate")
    from conftest import tiny_llama
    from transformers import AutoConfig, AutoModelForCausalLM

    _llama_cpp_file(tmp_path / "llama.gguf", tiny_llama(num_attention_heads=4, num_key_value_heads=2))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="llama.gguf", dtype=torch.float32,
                                              attn_implementation="eager").eval()
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file="llama.gguf")
    with accelerate.init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.tie_weights()
    r = layerstream.load_gguf(model, str(tmp_path / "llama.gguf"), rename="llama.cpp")
    assert len(r.packed) == 14 and r.missing == [] and r.unexpected == []
    h = layerstream.offload(model, device="sim")
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, hf(ids).logits)
    h.detach()


def test_llama_cpp_names_errors(tmp_path):
    """rename="llama.cpp" refuses what it cannot load right: head counts that
    differ from the model's config, an architecture the gguf package does not
    know, another naming, permute_qk= without llama.cpp names, and a file with
    both token_embd and output for a model whose head is tied to its table."""
    accelerate = pytest.importorskip("accelerate")
    from conftest import tiny_llama
    from transformers import LlamaForCausalLM

    ref = tiny_llama(num_attention_heads=4, num_key_value_heads=2)
    path = _llama_cpp_file(tmp_path / "llama.gguf", ref)
    with accelerate.init_empty_weights():
        other = LlamaForCausalLM(tiny_llama(seed=None, num_attention_heads=4, num_key_value_heads=4).config)
    with pytest.raises(LayerstreamError, match=r"2 key value heads but the model's config.num_key_value_heads is 4"):
        layerstream.load_gguf(other, str(path), rename="llama.cpp")
    assert other.model.layers[0].self_attn.q_proj.weight.is_meta  # nothing changed
    with pytest.raises(LayerstreamError, match=r"rename='hf' is not a known naming"):
        layerstream.load_gguf(other, str(path), rename="hf")
    with pytest.raises(LayerstreamError, match=r"permute_qk= applies to rename=\"llama.cpp\""):
        layerstream.load_gguf(other, str(path), permute_qk=True)
    write_gguf(tmp_path / "odd.gguf", [("x.weight", (4,), "F32", torch.zeros(4).view(torch.uint8))],
               {"general.architecture": "no-such-arch"})
    with pytest.raises(LayerstreamError, match=r"general.architecture is 'no-such-arch'"):
        layerstream.load_gguf(other, str(tmp_path / "odd.gguf"), rename="llama.cpp")
    # The file has output.weight, the model ties lm_head to the table: refused, not overwritten.
    tied = _empty_llama(tiny_llama(seed=None, num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=True).config)
    tied.tie_weights()
    with pytest.raises(LayerstreamError, match=r"'token_embd.weight' and 'output.weight' of the file both load "
                                               r"into one tensor of the model.*tie_word_embeddings=False"):
        layerstream.load_gguf(tied, str(path), rename="llama.cpp")
    assert tied.lm_head.weight.is_meta


def _tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).eval()


def _qwen3_moe_file(path, ref, gate=T.Q8_0, up=T.Q8_0, down=T.Q8_0):
    """A qwen3moe GGUF file of `ref` as llama.cpp's converter writes one: its names,
    the experts' gate and up apart (ffn_gate_exps / ffn_up_exps, the first and second
    half of transformers' gate_up_proj along dim 1), quantized in the given types;
    everything else F32. Sets ref's expert weights to the values the file holds."""
    cfg = ref.config
    table, w = _llama_cpp_writer(path, gguf.MODEL_ARCH.QWEN3MOE, cfg)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)

    def put(name, a, t):
        if t is None:
            w.add_tensor(name, a)
            return a
        w.add_tensor(name, quants.quantize(a, t), raw_dtype=t)
        return quants.dequantize(quants.quantize(a, t), t)

    with torch.no_grad():
        for name, p in ref.state_dict().items():
            base, suffix = name.rsplit(".", 1)
            a = p.numpy().astype(np.float32)
            if name.endswith("experts.gate_up_proj"):
                half = a.shape[1] // 2
                g = put(table.get_name(name[:-len("gate_up_proj")] + "gate_proj") + ".weight", a[:, :half], gate)
                u = put(table.get_name(name[:-len("gate_up_proj")] + "up_proj") + ".weight", a[:, half:], up)
                p.copy_(torch.from_numpy(np.concatenate([g, u], axis=1)))
            elif name.endswith("experts.down_proj"):
                p.copy_(torch.from_numpy(put(table.get_name(name) + ".weight", a, down).copy()))
            else:
                put(f"{table.get_name(base)}.{suffix}", a, None)
    return _written(w, path)


@pytest.mark.parametrize("up", [T.Q8_0, T.Q4_0], ids=["same-types", "up-q4_0"])
def test_llama_cpp_moe_experts_stream_as_the_files_blocks(tmp_path, up):
    """A Qwen3-MoE file of llama.cpp's converter (experts Q8_0; gate and up apart):
    rename="llama.cpp" puts ffn_gate_exps and ffn_up_exps side by side into
    transformers' gate_up_proj. Of one type they stay packed (each expert's gate
    blocks, then its up blocks) and stream as the file's bytes, every expert or only
    the routed ones; of two types gate_up_proj is dequantized on load. Logits equal
    the reference holding the file's values either way, and detach() leaves them."""
    accelerate = pytest.importorskip("accelerate")
    ref = _tiny_qwen3_moe()
    path = _qwen3_moe_file(tmp_path / "moe.gguf", ref, up=up)
    with accelerate.init_empty_weights():
        model = type(ref)(ref.config).eval()
    r = layerstream.load_gguf(model, str(path), rename="llama.cpp")
    assert r.missing == [] and r.unexpected == []
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts.down_proj, GgufWeight)
    if up == T.Q8_0:
        assert sorted(r.packed) == sorted(f"model.layers.{i}.mlp.experts.{n}" for i in range(2)
                                          for n in ("gate_up_proj", "down_proj"))
        assert experts.gate_up_proj.gguf_bytes.numel() == 4 * 64 * 32 // 32 * 34
        assert torch.equal(experts.gate_up_proj.dequantized(), ref.model.layers[1].mlp.experts.gate_up_proj)
    else:
        assert "model.layers.1.mlp.experts.gate_up_proj" in r.dequantized
        assert not isinstance(experts.gate_up_proj, GgufWeight)
    whole = _loaded(ref, path)  # the same file, every expert fetched
    h = layerstream.offload(model, device="sim", checker=True)  # experts="routed", the default
    h_all = layerstream.offload(whole, device="sim", experts="all")
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
        for step in range(3):  # decoding: one token reads 2 of the 4 experts per layer
            token = torch.tensor([[5 + step]])
            before, before_all = h.stats()["h2d_bytes"], h_all.stats()["h2d_bytes"]
            want = ref(token).logits
            assert torch.equal(model(token).logits, want) and torch.equal(whole(token).logits, want)
    # The last step: the routed model moved fewer bytes (only its experts' blocks).
    assert h.stats()["h2d_bytes"] - before < h_all.stats()["h2d_bytes"] - before_all
    assert h.stats()["routed_fetches"] >= 2 and h_all.stats()["routed_fetches"] == 0
    assert h.stats()["group_layers"] == 2 and h.ordering_errors() == []
    assert h.stats()["quantized_layers"] == 2  # the experts cross as GGUF blocks (down_proj at least)
    for handle, m in ((h, model), (h_all, whole)):
        handle.detach()
        for i in range(2):
            for n in ("gate_up_proj", "down_proj"):
                got = getattr(m.model.layers[i].mlp.experts, n)
                assert not isinstance(got, GgufWeight) and torch.equal(got, getattr(ref.model.layers[i].mlp.experts, n))


def _loaded(ref, path):
    accelerate = pytest.importorskip("accelerate")
    with accelerate.init_empty_weights():
        model = type(ref)(ref.config).eval()
    layerstream.load_gguf(model, str(path), rename="llama.cpp")
    return model
