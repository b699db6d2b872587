"""Shared fixtures for the layerstream acceptance tests.

Every test that streams a model goes through ``offload_sim`` (always the
simulated device) or ``offload_dev`` (the device LS_TEST_DEVICE names). Both
call ``layerstream.offload(model, device=..., **kw)`` with the ordering checker
on, and at teardown assert that the checker found no race on any handle the
test created. Handles detached during the test are checked right before
their detach (the checker can no longer be read afterwards).

LS_TEST_DEVICE (read once, when pytest configures): "sim" (default, also
when unset or empty), "cuda" or "cuda:N". Only the tests that take the
``offload_dev`` / ``compute_device`` fixtures (test_parity_layers.py) run on
it; the other files build CPU tensors and stay on "sim". Any other value is a
usage error, and asking for CUDA where torch or this layerstream build cannot
use it stops the session before any test runs -- it never falls back to sim.
On CUDA there is no ordering checker (Handle.ordering_errors() is always
empty there), so the teardown check is vacuous on that device.
"""
from __future__ import annotations

import copy
import os
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import layerstream

torch.set_num_threads(1)

DEVICE_ENV = "LS_TEST_DEVICE"


def requested_device() -> str:
    """The LS_TEST_DEVICE value ("sim" when unset or empty); raises
    pytest.UsageError for anything but "sim", "cuda" or "cuda:N"."""
    value = os.environ.get(DEVICE_ENV, "") or "sim"
    if value in ("sim", "cuda") or re.fullmatch(r"cuda:[0-9]+", value):
        return value
    raise pytest.UsageError(
        f"{DEVICE_ENV}={value!r} is not a test device: use 'sim' (the default), 'cuda' or "
        f"'cuda:N' (e.g. 'cuda:0')")


def _check_cuda_usable(value: str) -> None:
    """Stops the session (pytest.UsageError) unless `value` can really run on CUDA."""
    if not torch.cuda.is_available():
        raise pytest.UsageError(
            f"{DEVICE_ENV}={value} asks for the parity tests on CUDA, but torch.cuda.is_available() "
            f"is False (torch {torch.__version__}, CUDA build {torch.version.cuda}); not falling "
            f"back to the simulated device. Run on a machine with a visible GPU, or unset "
            f"{DEVICE_ENV} (or set it to 'sim') to test on the simulator.")
    try:
        layerstream._C.resolve_device(value)  # the check offload() makes: index, CUDA build
    except layerstream.LayerstreamError as e:
        raise pytest.UsageError(f"{DEVICE_ENV}={value}: {e}") from None


def pytest_configure(config):
    value = requested_device()
    if value != "sim":
        _check_cuda_usable(value)


def torch_device_for(device: str) -> torch.device:
    """Where the streamed computation runs for offload(device=...): the CPU
    for "sim" (the sim device computes with CPU tensors), else the CUDA
    device offload() resolves it to ("cuda" -> cuda:0)."""
    if device == "sim":
        return torch.device("cpu")
    return torch.device(layerstream._C.resolve_device(device))


def requested_torch_device() -> torch.device:
    """torch_device_for(requested_device()): cpu for sim, cuda:N for CUDA."""
    return torch_device_for(requested_device())


def _ordering_errors_or_none(handle):
    try:
        return handle.ordering_errors()
    except layerstream.LayerstreamError:  # already detached
        return None


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def _checked_offload(device: str):
    """A fixture body: yields offload(model, **kw) -> Handle on `device`, and
    asserts at teardown that the ordering checker saw no race."""
    expected = torch_device_for(device)
    handles = []
    seen_at_detach = []  # (handle, errors read right after detach: its frees are checked too)

    def _offload(model, **kw):
        kw.setdefault("checker", True)
        assert kw["checker"], "the ordering checker must stay on in the acceptance tests"
        handle = layerstream.offload(model, device=device, **kw)
        assert handle.compute_device == expected, (
            f"offload(device={device!r}) computes on {handle.compute_device}, expected {expected}")
        original_detach = handle.detach

        def detach_checked():
            engine = handle._engine  # None once detached; outlives the handle's detach
            try:
                return original_detach()
            finally:
                if engine is not None:
                    seen_at_detach.append((handle, list(engine.ordering_errors())))

        handle.detach = detach_checked
        handles.append(handle)
        return handle

    yield _offload

    problems = []
    # Detach what the test left attached, so every parameter is an ordinary
    # tensor again before the engines are destroyed. (A parameter that
    # outlives its engine currently crashes the interpreter -- see
    # test_training.py::test_parameter_outlives_engine -- and one test's
    # leftovers must not take the rest of the suite down.)
    for handle in handles:
        if _ordering_errors_or_none(handle) is not None:
            handle.detach()
    for handle, errs in seen_at_detach:
        if errs:
            problems.append((repr(handle), errs))
    assert problems == [], f"ordering checker reported races: {problems}"


@pytest.fixture
def offload_sim():
    """offload_sim(model, **kw) -> Handle on device="sim" whatever LS_TEST_DEVICE says,
    with the checker asserted clean at teardown."""
    yield from _checked_offload("sim")


@pytest.fixture
def offload_dev():
    """offload_dev(model, **kw) -> Handle on the LS_TEST_DEVICE device ("sim" by
    default), with the checker asserted clean at teardown (sim only; CUDA has none).
    Inputs must be on the ``compute_device`` fixture's device."""
    yield from _checked_offload(requested_device())


@pytest.fixture
def compute_device() -> torch.device:
    """The torch device the offload_dev computation runs on: cpu for sim, cuda:N for CUDA."""
    return requested_torch_device()


def clone_input(x: torch.Tensor) -> torch.Tensor:
    """An independent leaf copy of x with the same requires_grad."""
    return x.detach().clone().requires_grad_(x.requires_grad)


def make_pair(model):
    """(model to stream, unmodified deep copy) -- copies taken before offload."""
    return model, copy.deepcopy(model)


def assert_grads_match(model, ref, *, exact=False, rtol=1e-5, atol=1e-6):
    """Every parameter of `model` has the same grad (or None) as in `ref`."""
    got = dict(model.named_parameters())
    want = dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():
        q = want[name]
        if q.grad is None:
            assert p.grad is None, f"{name}: grad should be None, got a tensor"
            continue
        assert p.grad is not None, f"{name}: grad missing (reference has one)"
        assert p.grad.dtype == q.grad.dtype, (name, p.grad.dtype, q.grad.dtype)
        assert p.grad.shape == q.grad.shape, (name, p.grad.shape, q.grad.shape)
        if exact:
            assert torch.equal(p.grad, q.grad), f"{name}: grad not bit-exact"
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _layer_params(module: torch.nn.Module):
    """A streamed layer's tensors: its own; an nn.MultiheadAttention's with its out_proj's
    (they stream as one tensor group)."""
    own = list(module.parameters(recurse=False))
    if isinstance(module, torch.nn.MultiheadAttention):
        own += list(module.out_proj.parameters(recurse=False))
    return own


def layer_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in _layer_params(module))


def streamable_modules(model: torch.nn.Module):
    """(name, module) of the layers offload() streams by default: Linear / conv layers and
    nn.MultiheadAttention (a tensor group with its out_proj, which is not a layer of its own)."""
    kinds = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.MultiheadAttention)
    skip = torch.nn.modules.linear.NonDynamicallyQuantizableLinear
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, kinds) and not isinstance(m, skip)]


def largest_streamable_bytes(model: torch.nn.Module) -> int:
    return max(layer_bytes(m) for _, m in streamable_modules(model))


def slot_bytes(module: torch.nn.Module) -> int:
    """Bytes of one layer in a device slot: each tensor 256-byte aligned (weight and bias;
    a tensor group's tensors)."""
    a = lambda n: (n + 255) // 256 * 256  # noqa: E731
    if isinstance(module, torch.nn.MultiheadAttention):
        return sum(a(p.numel() * p.element_size()) for p in _layer_params(module))
    b = 0 if module.bias is None else module.bias.numel() * module.bias.element_size()
    return a(module.weight.numel() * module.weight.element_size()) + a(b)


def fixed_resident_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers of everything that is not a streamable layer
    (they always live on the device, and a budget covers them)."""
    layer_ids = {id(m) for _, m in streamable_modules(model)}
    layer_ids |= {id(m.out_proj) for _, m in streamable_modules(model) if isinstance(m, torch.nn.MultiheadAttention)}
    total = 0
    for m in model.modules():
        if id(m) in layer_ids:
            continue
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


class CastCounter(TorchDispatchMode):
    """Counts dtype casts (aten._to_copy) run on this thread of tensors shaped like
    one of `shapes`: the weight casts at use. (compute_dtype's cast into the slot
    runs on a stream worker on sim and through copy_ on CUDA, so it is not counted.)"""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.casts = {tuple(s) for s in shapes}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in self.shapes:
            self.casts += 1
        return func(*args, **(kwargs or {}))


def tiny_llama(vocab_size: int = 64, seed=0, **config):
    """A 2-layer transformers Llama (hidden 32, eager attention) on the CPU, seeded unless
    seed is None; `config` overrides LlamaConfig fields (tie_word_embeddings=True, biases)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                max_position_embeddings=64), **config})
    cfg._attn_implementation = "eager"
    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


# ---- GGUF test files, written without gguf-py (the GPU machine lacks it) ----
GGUF_BLOCKS = {  # ggml type: (id, elements per block, bytes per block, offsets of its fp16 scales)
    "F32": (0, 1, 4, ()), "F16": (1, 1, 2, ()), "BF16": (30, 1, 2, ()),
    "Q4_0": (2, 32, 18, (0,)), "Q4_1": (3, 32, 20, (0, 2)), "Q5_0": (6, 32, 22, (0,)),
    "Q5_1": (7, 32, 24, (0, 2)), "Q8_0": (8, 32, 34, (0,)), "Q2_K": (10, 256, 84, (80, 82)),
    "Q3_K": (11, 256, 110, (108,)), "Q4_K": (12, 256, 144, (0, 2)), "Q5_K": (13, 256, 176, (0, 2)),
    "Q6_K": (14, 256, 210, (208,)), "IQ4_NL": (20, 32, 18, (0,)),
}


def gguf_random_blocks(type_name: str, rows: int, cols: int, seed: int = 0, scale: float = 0.02) -> torch.Tensor:
    """Random bytes for a [rows, cols] tensor of a GGUF block type, with its fp16
    scale fields set to small finite values (any bytes are valid codes)."""
    _, elems, nbytes, offsets = GGUF_BLOCKS[type_name]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows * cols // elems, nbytes), dtype=torch.uint8, generator=g)
    for off in offsets:
        d = (torch.randn(blocks.shape[0], generator=g) * scale).to(torch.float16)
        blocks[:, off:off + 2] = d.view(torch.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def write_gguf(path, tensors, metadata=None, alignment=None, version=3):
    """Writes a GGUF file: tensors is a list of (name, torch shape, ggml type name,
    raw bytes as a uint8 tensor); metadata: str -> str or int (UINT32)."""
    import struct

    def s(text):
        b = text.encode()
        return struct.pack("<Q", len(b)) + b

    kv = dict(metadata or {})
    if alignment is not None:
        kv["general.alignment"] = alignment
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv)))
    for k, v in kv.items():
        out += s(k) + (struct.pack("<II", 4, v) if isinstance(v, int) else struct.pack("<I", 8) + s(v))
    align = alignment or 32
    offset = 0
    offsets = []
    for name, shape, tname, raw in tensors:
        dims = list(reversed(shape))
        out += s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", GGUF_BLOCKS[tname][0], offset)
        offsets.append(offset)
        offset += (raw.numel() + align - 1) // align * align
    out += bytes((-len(out)) % align)
    data_start = len(out)
    for (name, shape, tname, raw), off in zip(tensors, offsets):
        out += bytes(data_start + off - len(out))
        out += raw.numpy().tobytes()
    with open(path, "wb") as f:
        f.write(out)
    return path


class FirstLayerSometimes(torch.nn.Module):
    """A first layer that only some calls run (a conditioning embedder, an optional
    stage): the calls that skip it never fetch the layer the first step began with
    (Note [When a step begins] in csrc/core/scheduler.cpp)."""

    def __init__(self, d=64, n=4):
        super().__init__()
        self.pre = torch.nn.Linear(d, d)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))

    def forward(self, x, first=False):
        if first:
            x = self.pre(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def assert_data_writes_between_calls_are_seen(model, ref, x, layer=1, calls=3):
    """A call that runs `pre`, then `calls` that skip it, each after the same write
    through `.data` to model.layers[layer] and ref's: outputs equal ref's each time."""
    with torch.no_grad():
        assert torch.equal(model(x, first=True), ref(x, first=True))
        for call in range(calls):
            for m in (model, ref):
                m.layers[layer].weight.data.mul_(0.5)
            assert torch.equal(model(x), ref(x)), f"call {call + 1}"


class TwoLinears(torch.nn.Module):
    """A module of two Linear(16, 16) with a ReLU between: the smallest tensor group
    (groups=) with children a pattern can name."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class TiedHead(torch.nn.Module):
    """emb -> 4 Linear blocks -> head, the head's weight the table's when `tied` (the
    head is the largest layer)."""

    def __init__(self, tied=True):
        super().__init__()
        self.emb = torch.nn.Embedding(1000, 128)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(128, 128) for _ in range(4)])
        self.head = torch.nn.Linear(128, 1000, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)
