"""layerstream.compat with models quantized by optimum-quanto and torchao, as
ai-toolkit quantizes them (quantize(); freeze(); MemoryManager.attach()): the
packed bytes and scales stream, the slot dequantizes them, and each layer
computes what its library computes, so the output (and the input gradient)
equals the unoffloaded quantized model's, bit for bit.

One exception, asserted as such: on the CPU, quanto runs bfloat16 x qint8
through torch._weight_int8pack_mm, a fused kernel that rounds differently from
quanto's own default path (scale * codes, then the matmul, as on CUDA), which
is the one layerstream follows; there the output equals quanto's default path
(its own qbytes_mm function) exactly and the CPU kernel's to its rounding."""
import types
import warnings

import pytest
import torch
import torch.nn as nn

from aitoolkit_like import LoRA, Toy
from layerstream.compat import LinearLayerMemoryManager, MemoryManager

quanto = pytest.importorskip("optimum.quanto")
torchao_q = pytest.importorskip("torchao.quantization")
qbytes_mm = pytest.importorskip("optimum.quanto.library.qbytes_mm").qbytes_mm  # quanto's default path

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def quantized_toy(lib, qtype, dtype):
    """A Toy quantized as ai-toolkit does (the head kept dense), frozen. Built from a
    seed: quanto's tensors cannot be deep-copied."""
    torch.manual_seed(0)
    m = Toy().to(dtype)
    if lib == "quanto":
        quanto.quantize(m, weights={"qint8": quanto.qint8, "qfloat8": quanto.qfloat8}[qtype],
                        exclude="proj_out")
        quanto.freeze(m)
    else:  # "int8-tensor" / "float8-tensor": one scale for each weight (granularity PerTensor())
        kind, _, per = qtype.partition("-")
        config = {"int8": torchao_q.Int8WeightOnlyConfig, "float8": torchao_q.Float8WeightOnlyConfig}[kind](
            **({"granularity": torchao_q.PerTensor()} if per == "tensor" else {}))
        torchao_q.quantize_(m, config, filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and fqn != "proj_out")
    m.requires_grad_(False)
    return m


CASES = [("quanto", "qint8", "fp32"), ("quanto", "qint8", "fp16"),
         ("quanto", "qfloat8", "fp32"), ("quanto", "qfloat8", "bf16"), ("quanto", "qfloat8", "fp16"),
         ("torchao", "int8", "fp32"), ("torchao", "int8", "bf16"), ("torchao", "int8", "fp16"),
         ("torchao", "float8", "fp32"), ("torchao", "float8", "bf16"),
         ("torchao", "int8-tensor", "bf16"), ("torchao", "float8-tensor", "bf16")]


@pytest.mark.parametrize("lib,qtype,dt", CASES, ids=["-".join(c) for c in CASES])
def test_quantized_model_output_and_input_grad_equal_the_resident_quantized_model(lib, qtype, dt):
    dtype = DTYPES[dt]
    ref = quantized_toy(lib, qtype, dtype)
    model = quantized_toy(lib, qtype, dtype)
    mgr = MemoryManager.attach(model, torch.device("cpu"), ignore_modules=[model.proj_in])
    streamed = [n for n, m in model.named_modules() if hasattr(m, "_layer_memory_manager")]
    assert streamed == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "proj_out"]
    if qtype.endswith("-tensor"):  # one scale for the tensor (a path of its own: spread over the rows)
        assert ref.blocks[0].up.weight.scale.numel() == 1
    torch.manual_seed(1)
    x = torch.randn(2, 5, 32, dtype=dtype, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, yr = model(x), ref(xr)
    assert not y.isnan().any()
    assert torch.equal(y, yr)
    y.float().square().sum().backward()
    yr.float().square().sum().backward()
    assert torch.equal(x.grad, xr.grad)
    assert mgr.stats()["quantized_layers"] == 4
    assert mgr.engine.ordering_errors() == []


@pytest.mark.parametrize("qtype", ["qint8", "qfloat8"])
def test_quanto_layer_streams_its_codes_and_scales(qtype):
    """One quanto layer: the bytes that cross are the packed codes and the per-row
    scales (layerstream's int8 / fp8 layout), not the dense weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 96)).to(torch.bfloat16)
    quanto.quantize(model, weights=getattr(quanto, qtype))
    quanto.freeze(model)
    lin = model[0].requires_grad_(False)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = qbytes_mm(x, lin.weight._data, lin.weight._scale) + lin.bias
    mgr = MemoryManager(lin, "cpu")
    LinearLayerMemoryManager.attach(lin, mgr)
    with torch.no_grad():
        y = lin(x)
    assert torch.equal(y, expected)
    align = lambda n: (n + 255) // 256 * 256  # noqa: E731 - the 256-byte sections of quant-formats.md
    assert mgr.stats()["h2d_bytes"] == align(96 * 256) + align(96 * 4)


def test_quanto_bf16_qint8_follows_quantos_default_path():
    """bfloat16 x qint8: equal to quanto's default path (its qbytes_mm function: scale *
    codes, then the matmul; what quanto runs on CUDA) bit for bit, and to quanto's CPU
    kernel (torch._weight_int8pack_mm) within that kernel's rounding."""
    ref = quantized_toy("quanto", "qint8", torch.bfloat16)
    model = quantized_toy("quanto", "qint8", torch.bfloat16)
    MemoryManager.attach(model, "cpu")
    torch.manual_seed(1)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    layer = model.blocks[0].up
    with torch.no_grad():
        h = model.blocks[0].norm(model.proj_in(x))
        w = ref.blocks[0].up.weight
        default = (qbytes_mm(h.reshape(-1, 64), w._data, w._scale)
                   .reshape(2, 5, 128) + ref.blocks[0].up.bias)
        assert torch.equal(layer(h), default)
        cpu_kernel = ref.blocks[0].up(h)
        assert not torch.equal(cpu_kernel, default)  # the CPU kernel really rounds differently
        torch.testing.assert_close(layer(h), cpu_kernel, rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(model(x), ref(x), rtol=1.6e-2, atol=2e-2)


def test_quantized_layers_train_a_lora_wrapper_like_the_resident_model():
    """ai-toolkit's flow on a quantized base: quantize, freeze, attach (part of the
    layers, the input projection and the parameter table ignored), then a LoRA network
    wraps the base layers (its org_forward is the streamed forward) and trains: the
    adapters' gradients equal those of the resident quantized model."""
    ref = quantized_toy("torchao", "int8", torch.bfloat16)
    model = quantized_toy("torchao", "int8", torch.bfloat16)
    MemoryManager.attach(model, "cpu", offload_percent=0.6,
                         ignore_modules=[model.proj_in, model.scale_shift_table])
    assert 0 < sum(hasattr(m, "_layer_memory_manager") for m in model.modules()) < 5
    loras, ref_loras = [], []
    for m, r in zip(model.modules(), ref.modules()):
        if isinstance(m, nn.Linear) and m is not model.proj_in:
            torch.manual_seed(len(loras))
            loras.append(LoRA(m).to(torch.bfloat16))
            torch.manual_seed(len(ref_loras))
            ref_loras.append(LoRA(r).to(torch.bfloat16))
    for a in loras + ref_loras:
        a.apply_to()
    torch.manual_seed(1)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    y, yr = model(x), ref(x)
    assert torch.equal(y, yr)
    y.float().square().mean().backward()
    yr.float().square().mean().backward()
    for a, b in zip(loras, ref_loras):
        assert torch.equal(a.lora_down.weight.grad, b.lora_down.weight.grad)
        assert torch.equal(a.lora_up.weight.grad, b.lora_up.weight.grad)


def test_unsupported_quantization_stays_resident_with_a_warning(monkeypatch):
    """Layers layerstream cannot stream packed (quanto qint4, a quanto model not frozen,
    torchao per-group int8) run their own forward, resident, named in a warning."""
    # quanto unpacks qint4 on the CPU with a C++ extension it compiles at first use
    # (80 s on CI's fresh venv); its default (Python) kernel unpacks the same bits.
    default = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    ext = pytest.importorskip("optimum.quanto.library.extensions").get_extension("quanto_cpp")
    monkeypatch.setattr(ext, "_lib", types.SimpleNamespace(
        unpack=lambda t, bits: torch.ops.quanto.unpack.default.redispatch(default, t, bits)))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    quanto.quantize(m, weights=quanto.qint4, include="0")
    quanto.freeze(m[0])
    quanto.quantize(m, weights=quanto.qint8, include="2")  # not frozen: quantizes at every call
    torchao_q.quantize_(m, torchao_q.Int8WeightOnlyConfig(granularity=torchao_q.PerGroup(32)),
                        filter_fn=lambda mod, fqn: fqn == "4")
    m.requires_grad_(False)
    x = torch.randn(3, 128)
    with torch.no_grad():
        expected = m(x)
    with pytest.warns(RuntimeWarning) as record:
        MemoryManager.attach(m, "cpu")
    text = " ".join(str(r.message) for r in record)
    assert "'0'" in text and "WeightQBitsTensor" in text
    assert "'2'" in text and "freeze" in text
    assert "'4'" in text and "block size" in text
    assert not any(hasattr(layer, "_layer_memory_manager") for layer in m)
    with torch.no_grad():
        assert torch.equal(m(x), expected)


def test_trainable_quantized_weight_warns_it_gets_no_gradient():
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(16, 16))
    quanto.quantize(lin, weights=quanto.qint8)
    quanto.freeze(lin)
    assert lin[0].weight.requires_grad  # as quanto leaves it
    with pytest.warns(RuntimeWarning, match="no weight gradient"):
        MemoryManager.attach(lin, "cpu")
    x = torch.randn(2, 16, requires_grad=True)
    lin(x).sum().backward()
    assert lin[0].weight.grad is None and x.grad is not None


def test_dtype_change_of_a_quantized_streamed_layer_fails_before_anything_changes():
    model = quantized_toy("quanto", "qfloat8", torch.bfloat16)
    MemoryManager.attach(model, "cpu")
    before = {n: (p.dtype, p) for n, p in model.named_parameters()}
    with pytest.raises(Exception, match="cannot change to torch.float32"):
        model.to(dtype=torch.float32)
    assert {n: (p.dtype, p) for n, p in model.named_parameters()} == before
    assert model.to(torch.device("cpu"), dtype=torch.bfloat16) is model  # its own dtype: fine


def test_detach_restores_the_quantized_model():
    ref = quantized_toy("quanto", "qint8", torch.float32)
    model = quantized_toy("quanto", "qint8", torch.float32)
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    MemoryManager.attach(model, "cpu")
    MemoryManager.detach(model)
    assert [m.weight for m in model.modules() if isinstance(m, nn.Linear)] == weights
    assert not any("forward" in m.__dict__ or hasattr(m, "_layer_memory_manager") for m in model.modules())
    x = torch.randn(2, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(model(x), ref(x))


def test_offload_refuses_library_weights_naming_compat():
    """offload() does not stream optimum-quanto / torchao weights: a torchao Linear
    (torch's own forward) is refused before anything changes, naming compat; quanto's
    QLinear has its own forward, so offload() keeps it resident, like any such
    subclass."""
    import layerstream

    model = quantized_toy("torchao", "int8", torch.float32)
    weight = model.blocks[0].up.weight
    with pytest.raises(layerstream.LayerstreamError, match=r"layerstream\.compat\.MemoryManager\.attach"):
        layerstream.offload(model, device="sim")
    assert model.blocks[0].up.weight is weight and "forward" not in model.blocks[0].up.__dict__
    ref = quantized_toy("quanto", "qint8", torch.float32)
    model = quantized_toy("quanto", "qint8", torch.float32)
    with pytest.warns(RuntimeWarning, match="own forward.*QLinear"):
        handle = layerstream.offload(model, device="sim")
    x = torch.randn(2, 32)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    handle.detach()
