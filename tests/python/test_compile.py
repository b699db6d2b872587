"""torch.compile and torch.export of offloaded models (Note [Streamed layers as custom ops],
csrc/torch/ops_compiled.cpp): each streamed layer is one torch.ops.layerstream operator, so
Dynamo traces the whole model (fullgraph=True, zero graph breaks), outputs and gradients equal
the resident model's within fp32 rounding, shapes marked dynamic do not recompile, and the
ordering checker (the offload_sim fixture asserts it at teardown) sees no race.

Most tests compile with backend="aot_eager" (Dynamo and AOTAutograd trace exactly what
Inductor gets, without generating C++ kernels, which takes long on two cores); the
channels_last conv net goes through Inductor itself (whose kernels trust the fake kernels'
strides)."""
from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import layerstream
from conftest import FirstLayerSometimes, assert_grads_match, clone_input, tiny_llama

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def _frames() -> int:
    """Frames Dynamo compiled (a recompile is one more)."""
    return counters["stats"]["unique_graphs"]


def _mlp(bias=True):
    return nn.Sequential(nn.Linear(16, 32, bias=bias), nn.GELU(), nn.Linear(32, 32, bias=bias), nn.Tanh(),
                         nn.Linear(32, 8, bias=bias))


def _ops_in(gm) -> set:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "layerstream" in str(n.target)}


def _step_matches(step, model, ref, x, rtol):
    """One training step of the compiled `step` against the resident `ref`: outputs, the
    input's gradient and every parameter's gradient agree; both zero their gradients."""
    xr = clone_input(x)
    y, yr = step(x), ref(xr)
    torch.testing.assert_close(y, yr, **TOL)
    y.square().sum().backward()
    yr.square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, **TOL)
    assert_grads_match(model, ref, rtol=rtol, atol=1e-5)
    model.zero_grad()
    ref.zero_grad()


def test_mlp_full_finetune_compiles_whole_and_matches_eager(offload_sim):
    """Trainable weights and biases: their gradients come back through autograd; three
    steps of one compiled graph (no recompile), each equal to the resident model's."""
    model = _mlp()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    step = torch.compile(model, fullgraph=True, backend="aot_eager")  # Inductor: the conv net below
    for i in range(3):
        x = torch.randn(4, 16, requires_grad=True)
        _step_matches(step, model, ref, x, rtol=1e-5)
    assert _graph_breaks() == 0
    assert _frames() == 1
    assert handle.stats()["acquires"] > 0  # the engine streamed them


@pytest.mark.parametrize("cache", [False, True], ids=["per-step", "cache_across_steps"])
def test_compiled_steps_that_skip_the_first_layer_and_data_writes_after_them_stay_exact(offload_sim, cache):
    """Under torch.compile offload()'s call hook does nothing: the step begins after the
    compiled backward (the end-of-backward callback its weight gradients queue, and a
    forward fetch after a backward fetch; Note [When a step begins]). Before those,
    training steps that skip the first layer shared one step forever, and `.data`
    writes between later inference calls were not seen. With cache_across_steps the
    weights stay in their slots across steps, and each step that begins samples the
    host bytes (Note [Writes through .data between steps] in csrc/torch/engine.cpp)."""
    torch.manual_seed(0)
    model = FirstLayerSometimes()
    ref = copy.deepcopy(model)
    h = offload_sim(model, slots=6, cache_across_steps=cache)  # every layer stays in its slot
    compiled = torch.compile(model, backend="aot_eager")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for step in range(3):
        x = torch.randn(8, 64)
        for m, o in zip((compiled, ref), opts):
            m(x, first=step == 0).square().mean().backward()
            o.step()
            o.zero_grad()
    x = torch.randn(8, 64)
    with torch.no_grad():
        for call in range(3):
            for m in (model, ref):
                m.layers[1].weight.data.mul_(0.5)
            assert torch.equal(compiled(x), ref(x)), f"call {call}"
    assert h.stats()["steps"] == 6


def test_the_compiled_graph_calls_one_layerstream_operator_per_streamed_layer(offload_sim):
    model = _mlp()
    offload_sim(model)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(model, fullgraph=True, backend=backend)(torch.randn(2, 16))
    assert len(graphs) == 1
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "layerstream" in str(n.target)]
    assert len(calls) == 3 and all(str(n.target) == "layerstream.linear" for n in calls)
    assert torch.Tag.cudagraph_unsafe in torch.ops.layerstream.linear.default.tags


def test_frozen_base_lora_style_gradients_and_no_weight_inputs(offload_sim):
    """Frozen streamed weights are not operator inputs (nothing to differentiate); the
    input gradient flows through the streamed layers to a trainable resident layer."""
    model = nn.Sequential(nn.Linear(8, 16), _mlp())
    for p in model[1].parameters():
        p.requires_grad_(False)
    ref = copy.deepcopy(model)
    offload_sim(model, exclude=["0"])
    step = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 8)
    y, yr = step(x), ref(x)
    torch.testing.assert_close(y, yr, **TOL)
    y.sum().backward()
    yr.sum().backward()
    assert_grads_match(model, ref, rtol=1e-5, atol=1e-6)
    assert model[1][0].weight.grad is None
    assert _graph_breaks() == 0


def test_dynamic_batch_and_sequence_do_not_recompile(offload_sim):
    model = _mlp()
    ref = copy.deepcopy(model)
    offload_sim(model)
    step = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    for shape in [(2, 5, 16), (3, 7, 16), (5, 2, 16), (4, 9, 16)]:  # 0 and 1 specialize (torch)
        x = torch.randn(shape, requires_grad=True)
        xr = clone_input(x)
        y, yr = step(x), ref(xr)
        torch.testing.assert_close(y, yr, **TOL)
        y.sum().backward()
        yr.sum().backward()
        torch.testing.assert_close(x.grad, xr.grad, **TOL)
    assert _frames() == 1
    assert _graph_breaks() == 0


def test_mark_dynamic_dimension_does_not_recompile(offload_sim):
    model = _mlp()
    offload_sim(model)
    step = torch.compile(model, fullgraph=True, backend="aot_eager")
    for batch in (3, 5, 8, 2):
        x = torch.randn(batch, 16)
        torch._dynamo.mark_dynamic(x, 0)
        step(x)
    assert _frames() == 1


def test_the_prefetch_schedule_follows_the_compiled_order(offload_sim):
    """The scheduler's trace, recorded eagerly, gives way to the compiled order (a
    retrace, if it differs), after which a compiled step hits and misses exactly as an
    eager step does (its first layer: prefetches do not cross a step's end)."""
    model = _mlp()
    handle = offload_sim(model, prefetch=2, slots=3)
    x = torch.randn(4, 16, requires_grad=True)
    for _ in range(2):
        model(x).sum().backward()
    eager = handle.step_stats()[-1]
    step = torch.compile(model, fullgraph=True, backend="aot_eager")
    for _ in range(4):
        step(x).sum().backward()
    deviations = handle.stats()["deviations"]
    step(x).sum().backward()
    last = handle.step_stats()[-1]
    assert handle.stats()["deviations"] == deviations  # the compiled order is the trace now
    assert (last["acquires"], last["hits"], last["misses"]) == (eager["acquires"], eager["hits"], eager["misses"])
    assert last["misses"] <= 1, handle.step_stats()


def _convnet():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding="same", dilation=2), nn.ReLU(),   # "same", even total padding
        nn.Conv2d(8, 8, 4, padding="same"), nn.ReLU(),               # "same", odd: one side more
        nn.Conv2d(8, 8, 3, stride=2, groups=2), nn.ReLU(),
        nn.Flatten(), nn.LazyLinear(5))


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_conv_net_training_compiles_with_inductor(offload_sim, channels_last):
    model = _convnet()
    model(torch.randn(2, 3, 12, 12))  # materializes the LazyLinear
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    ref = copy.deepcopy(model)
    offload_sim(model)
    step = torch.compile(model, fullgraph=True, backend="inductor" if channels_last else "aot_eager")
    for _ in range(2):
        x = torch.randn(2, 3, 12, 12, requires_grad=True)
        if channels_last:
            x = x.detach().to(memory_format=torch.channels_last).requires_grad_()
        _step_matches(step, model, ref, x, rtol=1e-4)
    assert _graph_breaks() == 0
    assert _frames() == 1


def test_unbatched_conv1d(offload_sim):
    model = nn.Sequential(nn.Conv1d(4, 6, 3, padding="same"), nn.ReLU(), nn.Conv1d(6, 2, 2))
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(4, 10, requires_grad=True)  # no batch dimension
    xr = clone_input(x)
    y = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(y, ref(xr), **TOL)
    y.sum().backward()
    ref(xr).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, **TOL)
    assert_grads_match(model, ref, rtol=1e-5, atol=1e-5)


def test_trainable_embedding_and_autocast(offload_sim):
    """A streamed table (its gradient through autograd, on the host) and Linear layers
    under torch.autocast(bfloat16): the compiled model equals the same offloaded model
    run eagerly (which casts as the resident module's autocast does)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.mlp = _mlp()

        def forward(self, ids):
            return self.mlp(self.emb(ids))

    model = Net()
    ref = copy.deepcopy(model)
    offload_sim(model)
    ids = torch.randint(0, 50, (3, 7))
    step = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = step(ids)
        yr = ref(ids)
    assert y.dtype == yr.dtype == torch.bfloat16
    torch.testing.assert_close(y, yr, rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    yr.float().sum().backward()
    assert model.emb.weight.grad is not None
    assert_grads_match(model, ref, rtol=5e-2, atol=5e-2)
    assert _graph_breaks() == 0


def test_torch_export_records_the_operators(offload_sim):
    """torch.export works: the exported program calls the layerstream operators, which
    run while the offload handle that made them lives in this process."""
    model = _mlp().eval()
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(2, 16)
    ep = torch.export.export(model, (x,))
    assert {"layerstream.linear.default"} == _ops_in(ep.graph_module)
    torch.testing.assert_close(ep.module()(x), ref(x), **TOL)
    # A tensor group (nn.MultiheadAttention) is its layerstream::group operator there.
    model = _Attention().eval()
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(2, 5, 16)
    ep = torch.export.export(model, (x,))
    assert {"layerstream.group.default", "layerstream.linear.default"} == _ops_in(ep.graph_module)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), ref(x), **TOL)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_an_exported_program_trains_the_parameters_and_exports_quantized_models(offload_sim, strict):
    """Non-strict export (torch's default) swaps the modules' parameters for the program's
    PARAMETER inputs: the operators take those, so every weight gets its gradient from the
    exported module (Linear layers and a group), equal to the resident model's. A model with
    packed (quantized) stand-ins exports too (fakifying parameters reads is_conj/is_neg)."""
    for make in (_mlp, _Attention):
        model = make()
        ref = copy.deepcopy(model)
        offload_sim(model)
        x = torch.randn(2, 5, 16) if make is _Attention else torch.randn(2, 16)
        ep = torch.export.export(model, (x,), strict=strict)
        assert not [s for s in ep.graph_signature.input_specs if s.kind.name == "CONSTANT_TENSOR"]
        ep.module()(x).square().sum().backward()
        ref(x).square().sum().backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad is not None, n
            torch.testing.assert_close(p.grad, q.grad, **TOL)
    for fmt in ("nf4", "lossless"):
        model = _mlp().eval().requires_grad_(False)
        offload_sim(model, quantize=fmt)
        x = torch.randn(2, 16)
        with torch.no_grad():
            want = model(x)
            assert torch.equal(torch.export.export(model, (x,), strict=strict).module()(x), want)


def test_an_operator_of_a_detached_engine_says_what_to_do(offload_sim):
    """...and the registries the traced calls look layers up in keep no entry of it."""
    from layerstream import _forward, _group_op
    model = _mlp().eval()
    handle = offload_sim(model)
    engine = handle._engine.id
    ep = torch.export.export(model, (torch.randn(2, 16),))
    assert f"{engine}:0" in _forward._STREAMED
    handle.detach()
    del handle
    import gc
    gc.collect()
    with pytest.raises(Exception, match="does not exist in this process"):
        ep.module()(torch.randn(2, 16))
    assert not [k for k in _forward._STREAMED if k.startswith(f"{engine}:")]
    model = _Attention().eval()
    handle = offload_sim(model)
    engine = handle._engine.id
    ep = torch.export.export(model, (torch.randn(2, 5, 16),))
    assert (engine, 0) in _group_op._GROUPS
    handle.detach()
    del handle
    gc.collect()
    with pytest.raises(Exception, match="has no tensor group 0 in this process"):
        ep.module()(torch.randn(2, 5, 16))
    assert (engine, 0) not in _group_op._GROUPS


def test_llama_lora_training_compiles_without_graph_breaks(offload_sim):
    from peft import LoraConfig, get_peft_model

    def build():
        m = tiny_llama()
        return get_peft_model(m, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))

    model, ref = build(), build()
    ref.load_state_dict(model.state_dict())
    offload_sim(model)
    step = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, 64, (2, 12))
    for _ in range(2):
        loss = step(input_ids=ids, labels=ids).loss
        loss_ref = ref(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, loss_ref, **TOL)
        loss.backward()
        loss_ref.backward()
        lora = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        lora_ref = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
        assert lora.keys() == lora_ref.keys() and lora
        for n in lora:
            torch.testing.assert_close(lora[n], lora_ref[n], rtol=1e-4, atol=1e-5, msg=n)
        model.zero_grad()
        ref.zero_grad()
    assert _graph_breaks() == 0
    assert _frames() == 1


def test_llama_generate_with_a_compiled_forward(offload_sim):
    """generate() with a static cache and a compiled forward: the same tokens as the resident
    model, no graph break, one graph for the prompt and one for the decode steps."""
    model = tiny_llama().eval()
    ref = copy.deepcopy(model)
    offload_sim(model)
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, 64, (1, 6))
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation="static", pad_token_id=0)
    out = model.generate(ids, **kw)
    want = ref.generate(ids, **kw)
    assert torch.equal(out, want)
    assert _graph_breaks() == 0
    frames = _frames()
    model.generate(ids, **kw)
    assert _frames() == frames  # warmed up: no recompile


@pytest.mark.parametrize("cast", [False, True], ids=["fp32", "layerwise-float8"])
def test_diffusers_flux_transformer_compiles_without_graph_breaks(offload_sim, cast):
    """A tiny diffusers FluxTransformer2DModel: inference and a LoRA step (diffusers'
    add_adapter) compiled whole, equal to the resident model; also in bf16 with diffusers'
    layerwise casting (float8 storage: those layers stream their float8 bytes), against
    the resident model under its hooks."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    config = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8))
    dtype = torch.bfloat16 if cast else torch.float32

    def make():  # twice: a deep copy of diffusers' hooks calls the original module's forward
        torch.manual_seed(0)
        model = FluxTransformer2DModel(**config).to(dtype)
        model.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian"))
        if cast:  # the adapters stay bf16 (diffusers' default patterns, and theirs)
            model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16,
                                           skip_modules_pattern=("pos_embed", "patch_embed", "norm", "^proj_in$",
                                                                 "^proj_out$", "lora_"))
        return model

    model, ref = make(), make()
    handle = offload_sim(model)
    if cast:
        assert model.transformer_blocks[0].attn.to_q.base_layer.weight.dtype == torch.float8_e4m3fn
        assert "transformer_blocks.0.attn.to_q.base_layer" in handle.layers
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 16, 4, generator=g),
                  encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                  img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3), return_dict=False)
    inputs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and k.endswith(("states", "projections", "timestep"))
              else v for k, v in inputs.items()}
    step = torch.compile(model, fullgraph=True, backend="aot_eager")
    y = step(**inputs)[0]
    yr = ref(**inputs)[0]
    tol, grad_tol = (dict(rtol=1.6e-2, atol=1e-2), dict(rtol=5e-2, atol=1e-2)) if cast else (TOL, dict(rtol=1e-4, atol=1e-6))
    torch.testing.assert_close(y, yr, **tol)
    y.float().square().mean().backward()
    yr.float().square().mean().backward()
    lora = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    lora_ref = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert lora.keys() == lora_ref.keys() and lora
    for n in lora:
        torch.testing.assert_close(lora[n], lora_ref[n], **grad_tol, msg=n)
    assert _graph_breaks() == 0


@pytest.mark.parametrize("quantize", ["int8", "nf4", "lossless"])
def test_quantized_frozen_layers_compile_to_the_eager_numbers(offload_sim, quantize):
    """Packed weights (data-less stand-ins in the module) are never operator inputs: the
    compiled model computes what the eager offloaded model computes."""
    model = _mlp().requires_grad_(False)
    offload_sim(model, quantize=quantize)
    x = torch.randn(4, 16, requires_grad=True)
    xe = clone_input(x)
    y = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    ye = model(xe)
    torch.testing.assert_close(y, ye, **TOL)
    y.sum().backward()
    ye.sum().backward()
    torch.testing.assert_close(x.grad, xe.grad, **TOL)
    assert _graph_breaks() == 0


class _Attention(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.att = nn.MultiheadAttention(16, 2, batch_first=True, dropout=dropout)
        self.fc = nn.Linear(16, 4)

    def forward(self, x, mask=None):
        return self.fc(self.att(x, x, x, need_weights=False, attn_mask=mask)[0])


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_a_tensor_group_is_one_operator_under_fullgraph(offload_sim, dropout):
    """A tensor group (nn.MultiheadAttention, trainable: full fine-tuning) compiles with
    fullgraph=True as one layerstream::group operator and its backward as one
    group_backward: outputs and every gradient equal the resident model's, over three
    steps of one graph; with dropout, the recompute in backward draws the forward's masks
    (the RNG state is the operator's last output). The ordering checker runs throughout."""
    model = _Attention(dropout)
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    seen = []

    def backend(gm, example_inputs):
        seen.append(_ops_in(gm))
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    step = torch.compile(model, fullgraph=True, backend=backend)
    for i in range(3):
        x = torch.randn(2, 5, 16, requires_grad=True)
        torch.manual_seed(i)
        y = step(x)
        xr = clone_input(x)
        torch.manual_seed(i)
        yr = ref(xr)
        torch.testing.assert_close(y, yr, **TOL)
        y.square().sum().backward()
        yr.square().sum().backward()
        torch.testing.assert_close(x.grad, xr.grad, **TOL)
        assert_grads_match(model, ref, rtol=1e-5, atol=1e-6)
        model.zero_grad()
        ref.zero_grad()
    assert _graph_breaks() == 0
    assert _frames() == 1
    assert seen == [{"layerstream.group", "layerstream.linear"}]
    assert handle.stats()["acquires"] >= 3 * 3  # forward, backward's recompute, fc


def test_a_compiled_eval_without_gradients_streams_attention_groups(offload_sim):
    """Note [MultiheadAttention's fast path in a compiled group] (_group_op.py): torchvision's
    ViT in eval mode without gradients, compiled with fullgraph=True, its attention
    streamed as tensor groups. Before, the group's fake kernel took torch's fused attention
    path, whose meta kernel promises a weights tensor the real one never returns
    ("returned 2 outputs (None at (False, True)) where the traced call returned None at
    (False, False)"). Now two calls give the resident model's outputs (to rounding: the
    compiled graph around the groups is aot_eager's), and torch's switch of that path is on
    again after tracing."""
    vision_transformer = pytest.importorskip("torchvision.models.vision_transformer")
    torch.manual_seed(0)
    model = vision_transformer.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                 hidden_dim=32, mlp_dim=64, num_classes=10).eval()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, budget=60000)
    assert handle.stats()["group_layers"] == 2
    step = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.backends.mha.get_fastpath_enabled()
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 3, 32, 32)
            torch.testing.assert_close(step(x), ref(x), **TOL)
    assert torch.backends.mha.get_fastpath_enabled()
    assert _graph_breaks() == 0


_MARKS_IN_A_FRESH_PROCESS = r"""
import copy, json, sys
import torch, torch.nn as nn
if sys.argv[1] == "dynamo-first":
    import torch._dynamo
import layerstream
from layerstream import _forward, _group_op

def loaded():
    return [m for m in ("torch._dynamo", "sympy") if m in sys.modules]

def marks():
    return [bool(getattr(_group_op._describe, "_dynamo_marked_constant", False)),
            bool(getattr(_group_op._pattern, "_dynamo_marked_constant", False)),
            bool(getattr(_forward._group_eagerly, "_torchdynamo_disable", False))]

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = nn.Linear(16, 4)
    def forward(self, x):
        return self.fc(self.att(x, x, x, need_weights=False)[0])

torch.manual_seed(0)
model = Attention()
ref = copy.deepcopy(model)
out = dict(after_import=loaded(), marks_after_import=marks())
layerstream.offload(model, device="sim", checker=True)
x = torch.randn(2, 5, 16)
model(x).sum().backward()  # an eager training step
out["after_eager_step"] = [m for m in loaded() if m == "torch._dynamo"]  # torch.autograd.grad loads sympy
import torch._dynamo
from torch._dynamo.utils import counters
out["marks_after_dynamo"] = marks()
y = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-5)
out["graph_breaks"] = sum(counters["graph_break"].values())
print(json.dumps(out))
"""


@pytest.mark.parametrize("first", ["layerstream-first", "dynamo-first"])
def test_compile_marks_are_on_before_dynamo_traces_and_eager_runs_do_not_import_it(first):
    """Note [Compile marks without importing dynamo] (_dynamo_marks.py), in a fresh
    process: `import layerstream` loads neither torch._dynamo nor sympy, an eager training
    step no torch._dynamo (torch.autograd.grad loads sympy itself); once torch._dynamo is imported (before or after layerstream), the group
    operator's functions carry their marks and a tensor group compiles with fullgraph=True
    to the resident model's output."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", _MARKS_IN_A_FRESH_PROCESS, first], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if first == "layerstream-first":
        assert out["after_import"] == [] and out["after_eager_step"] == [], out
        assert out["marks_after_import"] == [False, False, False], out
    else:
        assert out["marks_after_import"] == [True, True, True], out
    assert out["marks_after_dynamo"] == [True, True, True], out
    assert out["graph_breaks"] == 0, out


def test_a_tensor_group_under_inductor_with_dynamic_sequence_and_autocast(offload_sim):
    """Inductor compiles around the group operator; a sequence length marked dynamic does
    not recompile, a mask tensor argument is passed through, and autocast entered inside
    the compiled function reaches the group's kernel (which computes in bf16 what the
    eager offloaded model computes). A backward to the input through Inductor: the
    gradient of batch-first attention's input comes back in the input's layout, which
    Inductor's code asserts (as the fake kernel promised)."""
    model = _Attention().requires_grad_(False)
    offload_sim(model)
    x = torch.randn(2, 5, 16, requires_grad=True)
    xr = clone_input(x)
    torch.compile(model, fullgraph=True)(x).square().sum().backward()
    model(xr).square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, **TOL)
    torch._dynamo.reset()
    counters.clear()

    def fn(x, mask):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x, mask)

    step = torch.compile(fn, fullgraph=True, dynamic=False)
    for n in (5, 7, 9):
        x = torch.randn(2, n, 16)
        mask = torch.triu(torch.full((n, n), float("-inf")), 1)
        torch._dynamo.mark_dynamic(x, 1)
        torch._dynamo.mark_dynamic(mask, 0)
        torch._dynamo.mark_dynamic(mask, 1)
        y = step(x, mask)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, fn(x, mask), rtol=2e-2, atol=2e-2)  # Inductor fuses the rest in bf16
    assert _graph_breaks() == 0
    assert _frames() == 1


def test_transformers_experts_compile_whole_with_lora(offload_sim):
    """A transformers mixture-of-experts model (Qwen3-MoE, eager experts implementation,
    whose loop over the experts hit is data-dependent) with frozen streamed experts and
    LoRA on its Linear layers: fullgraph compile, the experts calls are layerstream::group
    operators, loss and LoRA gradients equal the resident model's."""
    from peft import LoraConfig, get_peft_model
    from test_experts import _qwen3_moe

    def build():
        return get_peft_model(_qwen3_moe(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                       lora_dropout=0.0))

    model, ref = build(), build()
    ref.load_state_dict(model.state_dict())
    offload_sim(model)
    assert any(type(m).__name__.endswith("Experts") for m in model.modules())
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    seen = []

    def backend(gm, example_inputs):
        seen.append(_ops_in(gm))
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    loss = torch.compile(lambda i: model(input_ids=i, labels=i).loss, fullgraph=True, backend=backend)(ids)
    assert seen == [{"layerstream.group", "layerstream.embedding", "layerstream.linear"}]
    loss_r = ref(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, loss_r, **TOL)
    loss.backward()
    loss_r.backward()
    assert_grads_match(model, ref, rtol=1e-4, atol=1e-6)
    assert _graph_breaks() == 0


def test_lora_on_expert_parameters_runs_the_group_eagerly_under_compile(offload_sim):
    """peft's LoRA on the experts' tensors (target_parameters) under torch.compile: the
    group call runs eagerly between graphs (the adapter is applied on the fetched tensor,
    Note [Adapters on a streamed group's tensors]); loss and every adapter gradient as
    the eager resident model's; fullgraph=True fails naming the reason."""
    from test_experts import _ids, _param_lora, _qwen3_moe

    model = _param_lora(_qwen3_moe())
    ref = copy.deepcopy(model)
    offload_sim(model)
    loss = torch.compile(lambda i: model(input_ids=i, labels=i).loss, backend="aot_eager")(_ids())
    loss_r = ref(input_ids=_ids(), labels=_ids()).loss
    torch.testing.assert_close(loss, loss_r, **TOL)
    loss.backward()
    loss_r.backward()
    assert_grads_match(model, ref, rtol=1e-4, atol=1e-6)
    assert model.base_model.model.model.layers[0].mlp.experts.lora_A["default"].weight.grad is not None
    assert _graph_breaks() >= 1
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"target_parameters"):
        torch.compile(lambda i: model(input_ids=i).logits, fullgraph=True, backend="aot_eager")(_ids())


@pytest.mark.parametrize("case", ["gpt-oss-full-finetune", "gpt-oss-full-finetune-lossless",
                                  "qwen3-moe-int8-frozen", "qwen3-moe-lossless-frozen"])
def test_transformers_experts_full_finetune_and_packed_compile_whole(offload_sim, case):
    """Trainable experts (GPT-OSS, with expert biases and `router_indices` passed by
    keyword; dense, or lossless-coded on the bus): their gradients come back through the
    group operator's backward, two steps of one graph equal the resident model's. Packed
    (int8) or lossless-coded frozen experts: their stand-ins are never graph inputs, and
    the compiled loss is the eager offloaded one."""
    from test_experts import _gpt_oss, _ids, _qwen3_moe

    model = _gpt_oss() if case.startswith("gpt") else _qwen3_moe().requires_grad_(False)
    ref = copy.deepcopy(model)
    fmt = next((f for f in ("int8", "lossless") if f in case), None)
    offload_sim(model, **({"quantize": fmt} if fmt else {}))
    step = torch.compile(lambda i: model(input_ids=i, labels=i).loss, fullgraph=True, backend="aot_eager")
    for s in range(2):
        ids = _ids(s)
        loss = step(ids)
        if "frozen" in case:
            with torch.no_grad():
                torch.testing.assert_close(loss, model(input_ids=ids, labels=ids).loss, **TOL)
            continue
        loss_r = ref(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, loss_r, **TOL)
        loss.backward()
        loss_r.backward()
        assert_grads_match(model, ref, rtol=1e-4, atol=1e-6)
        assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None
        model.zero_grad()
        ref.zero_grad()
    assert _graph_breaks() == 0
    assert _frames() == 1


class _DataDependentExperts(nn.Module):
    """An experts module (transformers' markers, 3-D weights) whose forward loops over the
    experts a batch hits by their values (.tolist()): fake tensors cannot run it."""
    has_gate, is_transposed = False, False

    def __init__(self, twice=False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 16, 16) * 0.1)
        self.twice = twice

    def forward(self, x, ids):
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            rows = ids == e
            out[rows] = x[rows] @ self.w[e]
        return torch.cat([out, out]) if self.twice else out


class _FakeRefusedExperts(_DataDependentExperts):
    """An experts module whose kernel path fake tensors refuse: transformers picks
    grouped_mm inside a fake kernel (Dynamo is not tracing its frame there), and torch
    2.11's meta grouped_mm refuses fp32."""

    def forward(self, x, ids):
        if isinstance(x, torch._subclasses.FakeTensor):
            raise RuntimeError("Expected inputs of BF16 type but got mat_a.dtype=torch.float32")
        return super().forward(x, ids)


@pytest.mark.parametrize("kind", ["like-its-input", "other-shape", "fake-refused"])
def test_a_group_whose_shapes_depend_on_the_data_is_checked(offload_sim, kind):
    """The fake kernel cannot run a forward whose shapes depend on the data (or whose
    path fake tensors refuse); for an experts module it promises the first input's shape
    and dtype (what transformers' experts return), and the real kernel checks the
    promise: kept, the compiled result is the eager one; broken, a clear error, not a
    wrong shape downstream."""
    twice = kind == "other-shape"
    model = nn.Sequential()
    model.experts = (_FakeRefusedExperts() if kind == "fake-refused"
                     else _DataDependentExperts(twice)).requires_grad_(False)
    offload_sim(model)
    x, ids = torch.randn(6, 16), torch.tensor([0, 2, 2, 1, 0, 3])
    step = torch.compile(lambda x, ids: model.experts(x, ids) * 2, fullgraph=True, backend="aot_eager")
    if twice:
        with pytest.raises(Exception, match="promised one tensor shaped like its first input"):
            step(x, ids)
        return
    torch.testing.assert_close(step(x, ids), model.experts(x, ids) * 2, **TOL)
    assert _graph_breaks() == 0


_Pair = collections.namedtuple("_Pair", "y z")


class _Returns(nn.Module):
    """A groups= module returning its output in the container `kind` names."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.randn(8, 8))
        self.b = nn.Parameter(torch.randn(8))

    def forward(self, x):
        y = x @ self.w + self.b
        z = y.tanh()
        if self.kind == "namedtuple":
            return _Pair(y, z)
        if self.kind == "list":
            return [y, z]
        if self.kind == "dict":
            return {"z": z, "y": y}
        if self.kind == "nested":
            return None, {"pair": _Pair(z, None), "all": [y, y.exp()]}
        if self.kind == "ordered":
            return collections.OrderedDict(y=y)
        return [y, y] if self.kind == "flipped" else _Pair(y, z)


def _tensors(out) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(out) if t is not None]


@pytest.mark.parametrize("kind", ["namedtuple", "list", "dict", "nested"])
def test_a_compiled_group_returns_its_own_container(offload_sim, kind):
    """Note [A compiled group's own container] (_group_op.py): a groups= module returning
    a namedtuple, a list, a dict or a nested structure with Nones gave a plain tuple (a
    namedtuple's fields gone) under torch.compile, and a dict was refused, where the eager
    call returns the module's own container. Compiled with fullgraph=True it now returns
    the eager call's container, values and gradients, bit for bit, over calls of one graph."""
    torch.manual_seed(0)
    model = nn.Sequential(_Returns(kind))
    offload_sim(model, groups=["0"])
    step = torch.compile(model, fullgraph=True, backend="aot_eager")
    for grad in (True, False, True):
        x = torch.randn(3, 8, requires_grad=grad)
        xr = clone_input(x)
        with torch.set_grad_enabled(grad):
            got, want = step(x), model(xr)
        assert torch.utils._pytree.tree_structure(got) == torch.utils._pytree.tree_structure(want)
        assert type(got) is type(want) is {"namedtuple": _Pair, "list": list, "dict": dict, "nested": tuple}[kind]
        if kind == "namedtuple":
            assert torch.equal(got.z, want.z)
        assert all(torch.equal(a, b) for a, b in zip(_tensors(got), _tensors(want), strict=True))
        if not grad:
            continue
        sum((i + 1) * t.square().sum() for i, t in enumerate(_tensors(got))).backward()
        grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        sum((i + 1) * t.square().sum() for i, t in enumerate(_tensors(want))).backward()
        assert all(torch.equal(a, b) for a, b in zip(grads, [xr.grad] + [p.grad for p in model.parameters()]))
        model.zero_grad()
    assert _graph_breaks() == 0
    assert _frames() == 2  # one graph with gradients, one without


def test_a_compiled_group_refuses_a_container_it_cannot_rebuild_and_a_changed_one(offload_sim):
    """A container the compiled call cannot rebuild (an OrderedDict) is refused at trace
    time, saying what to return instead; a module whose container changes between calls of
    one graph is refused at the call, naming both."""
    model = nn.Sequential(_Returns("ordered"))
    offload_sim(model, groups=["0"])
    with pytest.raises(Exception, match=r"returned OrderedDict under torch.compile.*tuple, namedtuple, list or "
                                        r"dict.*torch.compiler.disable"):
        torch.compile(model, fullgraph=True, backend="aot_eager")(torch.randn(3, 8))
    model[0].kind = "namedtuple"
    step = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert step(torch.randn(3, 8)).z.shape == (3, 8)
    model[0].kind = "flipped"  # the operator's body is not traced: no guard sees this
    with pytest.raises(layerstream.LayerstreamError, match=r"returned \[Tensor, Tensor\] where the traced call "
                                                           r"returned _Pair\(y=Tensor, z=Tensor\)"):
        step(torch.randn(3, 8))


def test_a_group_call_that_is_not_one_operator_runs_eagerly(offload_sim, monkeypatch):
    """A call whose arguments the operator cannot describe (here: forced) runs eagerly
    between compiled graphs, exactly; fullgraph=True then fails naming the reason and
    what to do."""
    from layerstream import _group_op

    assert _group_op.describable((torch.ones(1), None, True, 2, 0.5, "x"), {"k": False})
    assert not _group_op.describable(([torch.ones(1)],), {})
    assert not _group_op.describable((torch.float16,), {})
    monkeypatch.setattr(_group_op, "describable", lambda args, kwargs: False)
    model = _Attention()
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(2, 5, 16, requires_grad=True)
    xr = clone_input(x)
    y = torch.compile(model, backend="aot_eager")(x)
    torch.testing.assert_close(y, ref(xr), **TOL)
    y.sum().backward()
    ref(xr).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, **TOL)
    assert_grads_match(model, ref, rtol=1e-5, atol=1e-6)
    assert _graph_breaks() >= 1
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"streamed tensor group .*offload\(exclude="):
        torch.compile(model, fullgraph=True, backend="aot_eager")(x)


def test_llama_with_gradient_checkpointing_compiles_with_only_transformers_own_breaks(offload_sim):
    """transformers' non-reentrant checkpointing with peft LoRA: transformers and peft break
    the graph themselves (a logger call, requires_grad_ on the embeddings' output); no
    break is layerstream's, and the numbers are the resident model's."""
    from peft import LoraConfig, get_peft_model

    def build():
        m = tiny_llama()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
        m.train()
        return get_peft_model(m, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))

    model, ref = build(), build()
    ref.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (2, 12))
    inputs = dict(input_ids=ids, labels=ids, use_cache=False)
    offload_sim(model)
    loss = torch.compile(model, backend="aot_eager")(**inputs).loss
    loss_ref = ref(**inputs).loss
    reasons = list(counters["graph_break"])
    assert reasons and all("logging.Logger" in r or "requires_grad_" in r for r in reasons), reasons
    loss.backward()
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, **TOL)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_layerstream_adamw_steps_a_compiled_model_like_the_resident_one(offload_sim):
    """The compiled layers' weight gradients come back through autograd; the host
    optimizer, inside opt.overlap(handle) or not, steps them as it steps the resident
    model's (clipping over all of them)."""
    model = _mlp()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    opt = layerstream.optim.AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    opt_ref = layerstream.optim.AdamW(ref.parameters(), lr=1e-2, max_grad_norm=1.0)
    step = torch.compile(model, fullgraph=True, backend="aot_eager")
    for i in range(3):
        x = torch.randn(4, 16)
        if i % 2:
            with opt.overlap(handle):
                step(x).square().sum().backward()
        else:
            step(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().sum().backward()
        opt_ref.step()
        opt_ref.zero_grad()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


class _Stack(nn.Module):
    """Four streamed Linear layers, the second one called twice per forward."""

    def __init__(self, d=16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        x = torch.tanh(self.layers[0](x))
        for i in (1, 1, 2, 3):
            x = torch.tanh(self.layers[i](x))
        return x


def test_compiled_weight_gradients_are_staged_and_stepped_during_the_backward(offload_sim):
    """Note [Compiled weight gradients are staged] (csrc/torch/ops_compiled.cpp): a
    compiled layer whose input gradient is computed stages its weight gradients as the
    eager path does (copied to the host on the gradient stream, added to .grad when
    the backward ends), so opt.overlap() steps those layers during the backward (it
    stepped none under torch.compile before: each gradient went to autograd after a
    blocking copy). The first layer (its input needs no gradient) returns its own to
    autograd. Parameters equal the resident model's after each step."""
    model = _Stack()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, sim_link_gbps=0.05)  # copies still in flight when backwards end
    opts = [layerstream.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    step = torch.compile(model, fullgraph=True, backend="aot_eager")
    for i in range(4):
        x = torch.randn(4, 16)
        for m, opt in zip((step, ref), opts):
            loss = m(x).square().mean()
            if m is step and i % 2:
                with opt.overlap(handle):
                    loss.backward()
            else:
                loss.backward()
            opt.step()
            if m is step and i % 2:
                assert opts[0].last_overlap_params == 6  # layers 1-3, weight and bias
            opt.zero_grad()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    assert handle.stats()["grad_staging_pinned_bytes"] == 3 * (16 * 16 + 16) * 4 + (16 * 16 + 16) * 4  # layer 1: 2 uses
    assert _graph_breaks() == 0


def test_compiled_gradient_hooks_fire_and_late_ones_are_refused(offload_sim):
    """A parameter with a gradient hook when the graph is traced keeps the autograd
    path under compile (the hook fires, as eager); one registered after tracing would
    not fire on the staged path: the backward says so instead of skipping it."""
    model = _Stack()
    ref = copy.deepcopy(model)
    offload_sim(model)
    seen = []
    model.layers[2].weight.register_hook(lambda g: seen.append("pre") or g * 2)
    model.layers[3].bias.register_post_accumulate_grad_hook(lambda p: seen.append("post"))
    ref.layers[2].weight.register_hook(lambda g: g * 2)
    step = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 16)
    step(x).square().mean().backward()
    ref(x).square().mean().backward()
    assert seen == ["post", "pre"]
    assert_grads_match(model, ref, rtol=1e-5, atol=1e-6)
    model.layers[1].weight.register_hook(lambda g: g)
    with pytest.raises(RuntimeError, match=r"hook was registered on the weight of streamed layer 'layers\.1' "
                                           r"after torch\.compile traced it.*torch\._dynamo\.reset\(\)"):
        step(x).square().mean().backward()


def test_a_removed_gradient_hook_is_no_hook(offload_sim):
    """torch keeps a parameter's hook object registered, its dict emptied, after
    handle.remove(); it holds no hook (set_grad_hook_probe, engine.h). Before, a compiled
    backward raised "registered after torch.compile traced it" for a hook registered and
    removed again, and a layer once hooked sent its gradients through autograd for good."""
    model = _Stack()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    engine = handle._engine
    step = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 16)
    step(x).square().mean().backward()
    weight, bias = model.layers[3].weight, model.layers[3].bias
    for p, register in ((weight, lambda p: p.register_hook(lambda g: g)),
                        (bias, lambda p: p.register_post_accumulate_grad_hook(lambda q: None))):
        hook = register(p)
        assert engine.op_spec(3).endswith(" grads=autograd")
        hook.remove()
        assert engine.op_spec(3) == "linear w=16x16 Float b=16 Float"
    step(x).square().mean().backward()  # the staged backward traced first, without raising
    for _ in range(2):
        ref(x).square().mean().backward()
    assert_grads_match(model, ref, rtol=1e-5, atol=1e-6)


def test_compiled_autograd_grad_for_the_input_leaves_weight_grads_alone(offload_sim):
    """torch.autograd.grad(loss, x) through a compiled model with trainable streamed
    weights: the input's gradient is the resident model's and no .grad is written, as
    autograd does; asking for a staged weight's gradient there is a clear error."""
    model = _Stack()
    ref = copy.deepcopy(model)
    offload_sim(model)
    step = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    step(x).square().mean().backward()  # traced with every weight trainable
    model.zero_grad()
    (gx,) = torch.autograd.grad(step(x).square().mean(), x)
    (gr,) = torch.autograd.grad(ref(xr).square().mean(), xr)
    torch.testing.assert_close(gx, gr, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"asked for the weight gradient of streamed layer 'layers\.\d' through "
                                           r"a compiled graph.*loss\.backward\(\)"):
        torch.autograd.grad(step(x).square().mean(), model.layers[2].weight)


def test_a_compiled_backward_waits_for_unused_copies_before_the_optimizer_writes(offload_sim):
    """Note [No copy in flight at a step's end] (csrc/core/scheduler.cpp) under compile:
    the first layer's backward reads no weight (its input needs no gradient), so the copy
    of it the backward guessed is never taken; only that layer trains and returns its
    gradient to autograd, so nothing is staged. The compiled backward still ends as a
    step (its operator queues the engine's end-of-backward callback): the copy is waited
    for and the optimizer's writes are declared to the checker (offload_sim asserts it saw
    no race; without the wait it sees one). Before, the compiled backward declared
    nothing and waited for nothing (ThreadSanitizer's stage of tools/sanitize.sh sees that
    race between the copy and layerstream.optim's step)."""
    model = _Stack()
    for layer in model.layers[1:]:
        layer.requires_grad_(False)
    ref = copy.deepcopy(model)
    offload_sim(model, slots=2, sim_link_gbps=0.05)
    opts = [layerstream.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, ref)]
    step = torch.compile(model, backend="aot_eager")
    for i in range(4):
        x = torch.randn(4, 16)
        for m, opt in zip((step, ref), opts):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_compiled_autograd_is_refused_for_staged_gradients_and_runs_frozen_layers(offload_sim):
    """torch._dynamo's compiled autograd runs the backward as a graph of its own and never
    ends the autograd engine's backward, so staged weight gradients were lost (`.grad`
    stayed as it was: found on 2026-12-06). Compiling that backward now fails with what to
    do; frozen streamed layers (LoRA) train under it, equal to the resident model."""
    from torch._dynamo import compiled_autograd

    enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
    model = _Stack()
    frozen_ref = copy.deepcopy(model).requires_grad_(False)
    handle = offload_sim(model)
    step = torch.compile(model, backend="aot_eager")
    with pytest.raises(Exception, match=r"compiled autograd cannot trace the backward of a compiled model whose "
                                         r"streamed weights train.*without compiled autograd"):
        with enable(torch.compile(backend="aot_eager")):
            step(torch.randn(4, 16)).square().mean().backward()
    torch._dynamo.reset()
    model.requires_grad_(False)
    x = torch.randn(4, 16, requires_grad=True)
    xr = clone_input(x)
    with enable(torch.compile(backend="aot_eager")):
        torch.compile(model, backend="aot_eager")(x).square().mean().backward()
    frozen_ref(xr).square().mean().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    assert handle.stats()["acquires"] > 0


def test_compiled_autograd_over_an_eager_streamed_backward_says_what_to_do(offload_sim):
    """Note [An eager streamed layer refuses compiled autograd] (ops_streamed.cpp): an
    eagerly called streamed layer's backward runs a graph of its own, which compiled
    autograd can neither trace nor call (torch said only "unhashable type: 'Capsule'").
    It is refused before anything ran, naming the layer and what to do; the same
    backward then runs without compiled autograd, equal to the resident model's."""
    from torch._dynamo import compiled_autograd

    enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
    model = _Stack()
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(4, 16, requires_grad=True)
    xr = clone_input(x)
    loss = model(x).square().mean()
    with pytest.raises(RuntimeError, match=r"compiled autograd \(torch._dynamo.compiled_autograd\) cannot run the "
                                           r"backward of streamed layer 'layers.3' called eagerly.*without compiled "
                                           r"autograd, or torch.compile the model first"):
        with enable(torch.compile(backend="aot_eager")):
            loss.backward(retain_graph=True)
    assert all(p.grad is None for p in model.parameters())
    loss.backward()
    ref(xr).square().mean().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    assert_grads_match(model, ref, rtol=1e-5, atol=1e-6)


_ANOTHER_LAYOUT_IN_A_FRESH_PROCESS = r"""
import copy, json, sys
import torch, torch.nn as nn
import layerstream
from torch._dynamo.utils import counters

width, padding = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 8)).requires_grad_(False)
conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=padding), nn.Tanh()).requires_grad_(False)


class Heads(nn.Module):  # nn.MultiheadAttention streams as a tensor group; per-head attention weights out
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2 if width == 32 else 4, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=True, average_attn_weights=False)[1]


heads = Heads().requires_grad_(False)
trained = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))
refs = [copy.deepcopy(m) for m in (mlp, conv, heads, trained)]
for m in (mlp, conv, heads, trained):
    layerstream.offload(m, device="sim")
x, img, seq = torch.randn(4, 16), torch.randn(2, 3, 12, 12), torch.randn(2, 5, 16)
out = {}
for name, model, ref, inp in (("mlp", mlp, refs[0], x), ("conv", conv, refs[1], img), ("heads", heads, refs[2], seq)):
    y, yr = torch.compile(model, backend="inductor")(inp), ref(inp)
    out[name] = list(y.shape) == list(yr.shape) and torch.allclose(y, yr, rtol=1e-5, atol=1e-5)
out["cache_hits"] = counters["inductor"]["fxgraph_cache_hit"]
# Trained, with a gradient hook on one weight in the processes of width 64: its backward
# returns that gradient to autograd, the others' stage it (same layout, other graph).
fired, before = [], counters["aot_autograd"]["autograd_cache_hit"]
if width == 64:
    trained[2].weight.register_hook(lambda g: fired.append(1) or g * 2)
    refs[3][2].weight.register_hook(lambda g: g * 2)
torch.compile(trained, backend="inductor")(x).square().mean().backward()
refs[3](x).square().mean().backward()
out["trained"] = all(torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
                     for p, q in zip(trained.parameters(), refs[3].parameters()))
out["hook_fired"] = len(fired)
out["trained_cache_hits"] = counters["aot_autograd"]["autograd_cache_hit"] - before
print(json.dumps(out))
"""


def test_inductors_cache_serves_no_graph_of_another_layout_to_another_process(tmp_path):
    """Note [An operator call names its layer's layout] (ops_spec.cpp): Inductor's
    on-disk cache is shared by processes, and every process numbers its engines and
    layers from the start. Before, a frozen Linear stack of another width, a conv of
    another padding or a multi-head attention (a tensor group) of another head count was
    served the graph compiled for the first (Inductor's size assertion failed: "incorrect
    fake kernel"), and a trained stack with a gradient hook the backward traced without
    it (the hook check raised); now each gets its own, equal to its resident model, and
    the same models again still find their graphs in the cache."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))

    def run(width, padding):
        r = subprocess.run([sys.executable, "-c", _ANOTHER_LAYOUT_IN_A_FRESH_PROCESS, str(width), str(padding)],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    same = {"mlp": True, "conv": True, "heads": True, "trained": True}
    assert run(32, 1) == dict(same, cache_hits=0, hook_fired=0, trained_cache_hits=0)
    assert run(64, 0) == dict(same, cache_hits=0, hook_fired=1, trained_cache_hits=0)
    assert run(32, 1) == dict(same, cache_hits=3, hook_fired=0, trained_cache_hits=1)


def test_an_operator_call_of_another_layout_is_refused(offload_sim):
    """Every kernel of the operators, the fake ones too, checks the call's spec against
    the layer's (Engine::op_spec): a graph traced for another layout cannot compute."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding="same"), nn.Flatten(), nn.Linear(8 * 36, 4, bias=False))
    handle = offload_sim(model)
    engine = handle._engine
    conv_spec, linear_spec = engine.op_spec(0), engine.op_spec(1)
    assert conv_spec == "conv2d w=8x3x3x3 Float b=8 Float stride=1,1 padding=same dilation=1,1 groups=1"
    assert linear_spec == "linear w=4x288 Float"
    x = torch.randn(2, 3, 6, 6)
    y = torch.ops.layerstream.conv(x, None, None, engine.id, 0, conv_spec)
    torch.testing.assert_close(y, model[0](x), rtol=0, atol=0)
    wrong = r"this call of streamed layer '0' was traced for a layer of another layout \(conv2d w=8x3x3x3 Float b=8 " \
            r"Float stride=1,1 padding=0,0 .*; this one is conv2d .* padding=same .*Compile or export the model again"
    with pytest.raises(layerstream.LayerstreamError, match=wrong):
        torch.ops.layerstream.conv(x, None, None, engine.id, 0, conv_spec.replace("same", "0,0"))
    with pytest.raises(layerstream.LayerstreamError, match=r"streamed layer '2' was traced for a layer of another "
                                                           r"layout \(linear w=4x300 Float"):
        torch.ops.layerstream.linear_shape(torch.randn(2, 288), engine.id, 1, "linear w=4x300 Float")
    with pytest.raises(layerstream.LayerstreamError, match="another layout"):
        torch.ops.layerstream.layer_backward(torch.randn(2, 4), torch.randn(2, 288), engine.id, 1, "linear",
                                             [True, False, False], False)
    # Where the weight gradients go is named too (a hooked weight's go back to
    # autograd), and is no layout: both routes are accepted.
    model[2].weight.register_hook(lambda g: g)
    assert engine.op_spec(1) == linear_spec + " grads=autograd" and engine.op_spec(0) == conv_spec
    for spec in (linear_spec, linear_spec + " grads=autograd"):
        assert torch.ops.layerstream.linear_shape(torch.randn(2, 288), engine.id, 1, spec).shape == (2, 4)
    for ask in (engine.op_spec, engine.layer_name, engine.layer_format):
        with pytest.raises(layerstream.LayerstreamError, match="no streamed layer #7"):
            ask(7)


_REPLACED = r"parameters of streamed layer '\w+' were replaced after offload\(\)"


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("make", [_mlp, _Attention], ids=["linear", "group"])
@pytest.mark.parametrize("how", ["load_state_dict_assign", "new_parameter_after_tracing", "functional_call"])
def test_parameters_replaced_after_offload_raise_under_compile_as_eagerly(offload_sim, make, how, grad):
    """Parameters replaced after offload() (load_state_dict(assign=True), a new nn.Parameter
    assigned after the graph was traced, torch.func.functional_call) raise under
    torch.compile as the eager call does. Before, only the eager call checked: the compiled
    graph streamed the original weights (outputs off, the new parameters' .grad None, nothing
    trained), for Linear layers and tensor groups (nn.MultiheadAttention; with gradients the
    group's operator happened to run the eager check). The check adds no graph break: a
    normal compiled call is one graph, equal to the resident's (the group's operator within
    fp32 rounding, as in the tests above)."""
    with torch.set_grad_enabled(grad):  # inference: eval() too (nn.MultiheadAttention's fast path)
        _replaced_under_compile(offload_sim, make().train(grad), how)


def _replaced_under_compile(offload_sim, model, how):
    ref = copy.deepcopy(model)
    offload_sim(model)
    group = isinstance(model, _Attention)
    x = torch.randn(2, 5, 16) if group else torch.randn(4, 16)
    step = torch.compile(model, backend="aot_eager")
    new = {k: v + 1 for k, v in ref.state_dict().items()}
    if how == "load_state_dict_assign":  # before the first trace (a checkpoint loaded after offload())
        model.load_state_dict(new, assign=True)
    else:
        torch.testing.assert_close(step(x), ref(x), **(TOL if group else dict(rtol=0, atol=0)))
        assert (_frames(), _graph_breaks()) == (1, 0)
    if how == "functional_call":
        compiled = torch.compile(lambda p, x: torch.func.functional_call(model, p, (x,)), backend="aot_eager")
        calls = [lambda: torch.func.functional_call(model, new, (x,)), lambda: compiled(new, x)]
    else:
        if how == "new_parameter_after_tracing":
            key = "att.in_proj_weight" if group else "0.weight"
            module, name = key.rsplit(".", 1)
            setattr(model.get_submodule(module), name, nn.Parameter(new[key].clone()))
        calls = [lambda: model(x), lambda: step(x)]
    held = dict(model.named_parameters())
    for call in calls:  # eagerly, then compiled
        with pytest.raises(layerstream.LayerstreamError, match=_REPLACED):
            call()
    # The group's traced call had put the original parameters back into the module.
    assert all(p is held[n] for n, p in model.named_parameters())


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_exporting_a_model_whose_parameters_were_replaced_raises(offload_sim, strict):
    """torch.export after load_state_dict(assign=True) raises (strict export: torch's
    error carries layerstream's message). Before, the program exported and streamed the
    original weights while its state_dict held the new ones (outputs off)."""
    for make in (_mlp, _Attention):
        model = make()
        ref = copy.deepcopy(model)
        offload_sim(model)
        model.load_state_dict({k: v + 1 for k, v in ref.state_dict().items()}, assign=True)
        x = torch.randn(2, 5, 16) if make is _Attention else torch.randn(2, 16)
        with pytest.raises(layerstream.LayerstreamError if not strict else Exception, match=_REPLACED):
            torch.export.export(model, (x,), strict=strict)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_exporting_a_model_with_activation_offload_says_to_offload_it_without(offload_sim, strict):
    """torch.export of a model offloaded with activations= raises layerstream's error, which
    says to export it offloaded without activations= (strict export: torch's error carries
    it), and the model still trains exactly eagerly afterwards. Before, non-strict export
    failed with torch's "Cannot access data pointer of Tensor (e.g. FakeTensor...)" (the
    scope read the fake parameters' data pointers) and strict export with the advice for
    torch.compile (compile the blocks), which does not apply to export."""
    model = _mlp()
    ref = copy.deepcopy(model)
    offload_sim(model, activations="host")
    x = torch.randn(4, 16)
    says = r"torch\.export cannot export a model offloaded with activations=.*offload the model without activations="
    with pytest.raises(layerstream.LayerstreamError if not strict else Exception, match=says):
        torch.export.export(model, (x,), strict=strict)
    y, yr = model(x), ref(x)
    assert torch.equal(y, yr)
    y.square().sum().backward()
    yr.square().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))


class _Block(nn.Module):
    """A small pre-norm transformer block (attention by scaled_dot_product_attention)."""

    def __init__(self, d, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.f1, self.f2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        y = self.ln1(x)
        q, k, v = (p(y).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.f2(torch.nn.functional.gelu(self.f1(self.ln2(x))))


def test_compiled_models_offload_their_saved_tensors_and_a_whole_graph_takes_them_back_at_once(offload_sim):
    """What the README says of activations= under torch.compile (the sim's numbers): the
    compiled regions' saved tensors go to the host, compiled whole or block by block (the
    same bytes as eagerly, where a tensor several ops save crosses once), but a whole-model
    graph's backward takes them all back
    at once, so its peak on the device is higher than by block. Before, the README said a
    whole-model graph kept them on the device. Outputs and gradients equal the resident's."""
    torch.manual_seed(0)
    base = nn.Sequential(_Block(128), _Block(128))
    x = torch.randn(4, 64, 128)
    ref = copy.deepcopy(base)
    yr = ref(x)
    yr.square().mean().backward()
    seen = {}
    for how in ("eager", "whole", "blocks"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        handle = offload_sim(model, activations="host")
        step = torch.compile(model, backend="aot_eager") if how == "whole" else model
        if how == "blocks":
            for block in model:
                block.compile(backend="aot_eager")
        y = step(x)
        sent = handle.stats()["activation_d2h_bytes"]
        y.square().mean().backward()
        assert torch.equal(y, yr)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
        seen[how] = (sent, handle.stats()["peak_activation_device_bytes"])
        handle.detach()
    assert seen["whole"][0] == seen["blocks"][0] == seen["eager"][0] > 0
    assert seen["whole"][1] >= seen["whole"][0] > seen["blocks"][1] > seen["eager"][1]


def test_blocks_compiled_one_by_one_are_a_graph_each(offload_sim):
    """What the README says of compiling an offloaded model's blocks: each block is a graph
    of its own (the resident blocks share one, plus one for the first block's input, which
    needs no gradient), so past torch's recompile_limit the remaining blocks run
    uncompiled, with the same numbers."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_Block(32) for _ in range(4)))
    ref = copy.deepcopy(model)
    resident = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(2, 5, 32)
    for m in (resident, model):
        for block in m:
            block.compile(backend="aot_eager")
    assert torch.equal(resident(x), ref(x))
    assert _frames() == 2
    torch._dynamo.reset()  # the limit counts the graphs of the same code (Block.forward)
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=3):
        y = model(x)
    assert _frames() == 3  # the 4th block ran uncompiled
    assert torch.equal(y, ref(x))
    torch._dynamo.reset()
    counters.clear()
    assert torch.equal(model(x), ref(x))
    assert _frames() == 4  # recompile_limit (8) is more than the blocks: one graph each
