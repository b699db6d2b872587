"""The host tier (docs/design/host-tier.md): load_safetensors() into a model built
on the meta device (files written by the safetensors library and by transformers'
save_pretrained, sharded), offload() with host_budget / pinned_budget: weights read
straight into the host store, or left in their file and streamed from disk through
staging entries; outputs and gradients equal the resident model's; the error cases
name the file and tensor and leave the model as it was."""
import copy
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save as save_bytes, save_file

import layerstream
from layerstream import FileWeight, LayerstreamError

D, N = 64, 8


class Net(nn.Module):
    def __init__(self, d=D, n=N):
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 7, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(self.norm(x))


def _reference(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return Net().to(dtype)


def _meta(dtype=torch.float32):
    with torch.device("meta"):
        return Net().to(dtype)


def _save(model, path):
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return str(path)


def _ids():
    return torch.randint(0, 50, (3, 5), generator=torch.Generator().manual_seed(1))


def _layer_bytes(model):
    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, nn.Linear)
               for p in m.parameters())


def _quarter(model):
    """A quarter of the streamed Linear weights, plus the embedding table (in RAM:
    looked up there)."""
    return _layer_bytes(model) // 4 + model.emb.weight.numel() * 4


def test_load_leaves_linear_weights_in_the_file_and_offload_reads_them_into_the_store(tmp_path):
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    model = _meta()
    report = layerstream.load_safetensors(model, path)
    assert sorted(report.in_file) == sorted(n for n, p in ref.named_parameters()
                                            if n.startswith(("layers", "head")))
    assert report.in_file_bytes == _layer_bytes(ref)
    assert set(report.dense) == {"emb.weight", "norm.weight", "norm.bias"}
    assert isinstance(model.layers[0].weight, FileWeight) and model.layers[0].weight.device.type == "cpu"
    assert torch.equal(model.layers[3].weight.read(), ref.layers[3].weight)
    with pytest.raises(LayerstreamError, match="still in its file"):
        model(_ids())
    handle = layerstream.offload(model, device="sim")
    assert not isinstance(model.layers[0].weight, FileWeight)
    assert torch.equal(model.layers[0].weight, ref.layers[0].weight)
    stats = handle.stats()
    assert stats["disk_layers"] == 0 and stats["disk_read_bytes"] == 0
    with torch.no_grad():
        assert torch.equal(model(_ids()), ref(_ids()))
    handle.detach()
    assert torch.equal(model.layers[5].weight, ref.layers[5].weight)


def _lora(model, rank=4):
    """A tiny LoRA beside every streamed Linear (frozen base), the same on any model."""
    torch.manual_seed(3)
    adapters = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            a = nn.Parameter((torch.randn(rank, m.in_features) * 0.1).to(m.weight.dtype))
            b = nn.Parameter((torch.randn(m.out_features, rank) * 0.1).to(m.weight.dtype))
            adapters[name] = (a, b)
            base = m.forward

            def fwd(x, base=base, a=a, b=b):
                return base(x) + (x @ a.t()) @ b.t()
            m.forward = fwd
    return adapters


def assert_lora_steps_equal(model, ref, steps):
    """The same LoRA over both models (_lora): outputs and adapter gradients equal,
    bit for bit, over `steps` steps."""
    ours, theirs = _lora(model), _lora(ref)
    for step in range(steps):
        ids = _ids()
        out, want = model(ids), ref(ids)
        assert torch.equal(out, want), f"step {step}"
        out.square().mean().backward()
        want.square().mean().backward()
        for name in ours:
            for p, q in zip(ours[name], theirs[name]):
                assert torch.equal(p.grad, q.grad), f"step {step}: {name}"
                p.grad = q.grad = None


def test_with_a_host_budget_the_device_plan_says_its_pinned_ram_is_without_one(tmp_path):
    """handle.plan with budget= and host_budget=: the planner's line "host RAM needed
    (pinned): X" read as what is pinned, though the weights stayed in their file (the
    host lines below said so); it says now that X is without a host budget."""
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    model = _meta()
    layerstream.load_safetensors(model, path)
    model.requires_grad_(False)
    budget = _layer_bytes(ref) // 2  # half of the Linear layers stream
    handle = layerstream.offload(model, device="sim", budget=budget, host_budget=_quarter(ref))
    assert handle.host_plan["disk_bytes"] > 0
    assert "without a host budget" in handle.plan and "host RAM (budget" in handle.plan, handle.plan
    handle.detach()
    plain = layerstream.offload(_reference(), device="sim", budget=budget)
    assert "host RAM needed (pinned)" in plain.plan and "without a host budget" not in plain.plan


@pytest.mark.parametrize("pinned_budget", [None, 0])
def test_disk_tier_under_a_quarter_of_the_model_equals_the_resident_model(tmp_path, pinned_budget):
    """host_budget = 1/4 of the streamed bytes: the frozen Linear weights stay in the
    file, read on every use into staging entries; LoRA gradients and outputs over
    several steps equal the resident model's, and the entries keep some layers."""
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    model = _meta()
    layerstream.load_safetensors(model, path)
    model.requires_grad_(False)
    ref.requires_grad_(False)
    budget = _quarter(ref)
    handle = layerstream.offload(model, device="sim", host_budget=budget, pinned_budget=pinned_budget)
    assert isinstance(model.layers[0].weight, FileWeight)  # still in the file
    plan = handle.host_plan
    assert plan["disk_bytes"] == _layer_bytes(ref) and plan["store_bytes"] == ref.emb.weight.numel() * 4
    assert plan["staging_bytes"] <= budget
    assert f"disk: {N + 1} layer(s)" in handle.plan and "host RAM (budget" in handle.plan
    assert_lora_steps_equal(model, ref, 4)
    stats = handle.stats()
    assert stats["disk_layers"] == N + 1
    assert stats["disk_read_bytes"] > 0 and stats["staging_entries"] >= 2
    assert stats["staging_entries"] * stats["staging_entry_bytes"] <= budget
    assert stats["staging_hits"] > 0  # an entry still held the layer (backward after forward)
    assert stats["ordering_errors"] == 0
    handle.detach()
    assert isinstance(model.layers[0].weight, FileWeight)


def _frozen_on_disk(tmp_path):
    """A saved reference, its file, and a frozen model loaded from it and offloaded with a
    quarter of its bytes as the host budget (the disk tier): (ref, path, model, handle)."""
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    model = _meta()
    layerstream.load_safetensors(model, path)
    model.requires_grad_(False)
    return ref, path, model, layerstream.offload(model, device="sim", host_budget=_quarter(ref))


def test_a_compiled_model_whose_weights_and_biases_stay_in_the_file(tmp_path):
    """torch.compile over the disk tier: the biases stay in the file too (FileWeight
    stand-ins), which the compiled call must not hand to Dynamo (it failed tracing the
    first call: "computing with it (is_conj()) is not possible"). Outputs and input
    gradients equal the resident model's within rounding, and the graph has no break."""
    from torch._dynamo.utils import counters

    ref, _, model, handle = _frozen_on_disk(tmp_path)
    assert isinstance(model.layers[0].bias, FileWeight)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")

    def body(m, x):
        for layer in m.layers:
            x = torch.relu(layer(x))
        return x
    compiled_body = torch.compile(lambda x: body(model, x), backend="aot_eager")
    for _ in range(2):
        ids = _ids()
        torch.testing.assert_close(compiled(ids), ref(ids), rtol=1e-5, atol=1e-6)
        x, xr = model.emb(ids).detach().requires_grad_(True), ref.emb(ids).detach().requires_grad_(True)
        out, want = compiled_body(x), body(ref, xr)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        out.square().sum().backward()
        want.square().sum().backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    assert sum(counters["graph_break"].values()) == 0
    assert handle.stats()["disk_read_bytes"] > 0
    torch._dynamo.reset()


def test_saving_a_weight_the_disk_tier_streams_says_how(tmp_path):
    """A state dict of a model whose frozen weights stream from their file cannot be
    pickled as it is (no values in memory): the refusal says the weight streams from
    its file (not "call offload()", which already ran) and how to save; the way it
    names gives the file's values. After detach() the weight waits for an offload()
    again, and the refusal says that."""
    import io
    ref, path, model, handle = _frozen_on_disk(tmp_path)
    sd = model.state_dict()
    for save in (lambda: torch.save(sd, io.BytesIO()), lambda: save_bytes(sd)):
        with pytest.raises(LayerstreamError, match=r"streams from its file .*\(the disk tier\).*FileWeight.read"):
            save()
    saved = {k: v.read() if isinstance(v, layerstream.FileWeight) else v for k, v in sd.items()}
    for k, v in ref.state_dict().items():
        assert torch.equal(saved[k].cpu(), v), k
    handle.detach()
    with pytest.raises(LayerstreamError, match="still in its file.*Call layerstream.offload"):
        torch.save(model.state_dict(), io.BytesIO())


def test_pinned_budget_zero_stores_pageable_and_stages_copies(tmp_path):
    ref = _reference()
    model = copy.deepcopy(ref)
    handle = layerstream.offload(model, device="sim", pinned_budget=0)
    stats = handle.stats()
    assert stats["pinned_bytes"] == 0 and stats["pageable_bytes"] >= _layer_bytes(ref)
    with torch.no_grad():
        assert torch.equal(model(_ids()), ref(_ids()))
    assert handle.stats()["staged_read_bytes"] >= _layer_bytes(ref)  # each layer crossed an entry
    assert handle.stats()["ordering_errors"] == 0


def test_sharded_checkpoint_of_transformers_save_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path, max_shard_size="20KB", safe_serialization=True)
    assert (tmp_path / "model.safetensors.index.json").exists()
    import accelerate
    with accelerate.init_empty_weights():
        model = transformers.LlamaForCausalLM(cfg).eval()
    report = layerstream.load_safetensors(model, str(tmp_path))
    assert report.in_file and not report.missing and not report.unexpected
    model.requires_grad_(False)
    handle = layerstream.offload(model, device="sim", host_budget=report.in_file_bytes // 2)
    assert handle.stats()["disk_layers"] > 0
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_errors_name_the_file_and_leave_the_model_as_it_was(tmp_path):
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    model = _meta()
    before = dict(model.named_parameters())
    # A tensor of another shape.
    bad = dict(ref.state_dict())
    bad["layers.2.weight"] = torch.zeros(D, D + 1)
    save_file(bad, str(tmp_path / "shape.safetensors"))
    with pytest.raises(LayerstreamError, match=r"shape.safetensors: tensor 'layers.2.weight' has shape \[64, 65\]"):
        layerstream.load_safetensors(model, str(tmp_path / "shape.safetensors"))
    # Integer bytes for a float parameter.
    bad["layers.2.weight"] = torch.zeros(D, D, dtype=torch.int32)
    save_file(bad, str(tmp_path / "dtype.safetensors"))
    with pytest.raises(LayerstreamError, match="is I32 but 'layers.2.weight' in the model is torch.float32"):
        layerstream.load_safetensors(model, str(tmp_path / "dtype.safetensors"))
    # A truncated file (the header's offsets run past its end).
    data = open(path, "rb").read()
    open(tmp_path / "cut.safetensors", "wb").write(data[: len(data) - 100])
    with pytest.raises(LayerstreamError, match="cut.safetensors"):
        layerstream.load_safetensors(model, str(tmp_path / "cut.safetensors"))
    # A missing shard.
    ref.requires_grad_(False)
    import json
    keys = list(ref.state_dict())
    save_file({k: ref.state_dict()[k].contiguous() for k in keys[:5]}, str(tmp_path / "s1.safetensors"))
    json.dump({"metadata": {}, "weight_map": {**{k: "s1.safetensors" for k in keys[:5]},
                                              **{k: "s2.safetensors" for k in keys[5:]}}},
              open(tmp_path / "m.safetensors.index.json", "w"))
    with pytest.raises(LayerstreamError, match="s2.safetensors"):
        layerstream.load_safetensors(model, str(tmp_path / "m.safetensors.index.json"))
    # Strict: a name the model lacks.
    with pytest.raises(LayerstreamError, match="name nothing in the model: extra"):
        save_file({**ref.state_dict(), "extra": torch.zeros(1)}, str(tmp_path / "x.safetensors"))
        layerstream.load_safetensors(model, str(tmp_path / "x.safetensors"))
    assert dict(model.named_parameters()) == before and all(p.is_meta for p in model.parameters())


def test_trainable_weights_must_fit_in_ram(tmp_path):
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    model = _meta()
    layerstream.load_safetensors(model, path)  # parameters keep requires_grad=True
    with pytest.raises(LayerstreamError, match=r"host budget of .* cannot hold .*freeze the model"):
        layerstream.offload(model, device="sim", host_budget=_quarter(ref))
    assert isinstance(model.layers[0].weight, FileWeight)  # nothing changed
    handle = layerstream.offload(model, device="sim", host_budget=2 * _layer_bytes(ref) + ref.emb.weight.numel() * 4)
    assert model.layers[0].weight.requires_grad and handle.stats()["disk_layers"] == 0
    model(_ids()).sum().backward()
    assert model.layers[0].weight.grad is not None



def test_unfreezing_a_weight_the_disk_tier_streams_is_an_error_at_the_next_forward(tmp_path):
    """A weight offload() left in its file (frozen) and unfrozen afterwards gets no
    gradient and never changes: the next forward is an error naming the layer and what
    to do (unfreeze before offload(), or keep it frozen). Frozen again, it runs; unfrozen
    before another offload(), it is read into RAM and trains."""
    ref, path, model, handle = _frozen_on_disk(tmp_path)
    model.layers[2].weight.requires_grad_(True)
    with pytest.raises(LayerstreamError, match=r"'layers.2.weight' requires grad, but offload\(\) left it frozen in "
                                               r"its file .*unfreeze it before offload\(\).*or keep it frozen"):
        model(_ids())
    model.requires_grad_(True)  # every weight: the first streamed one is named
    with pytest.raises(LayerstreamError, match="'layers.0.weight' requires grad"):
        with torch.no_grad():
            model(_ids())
    model.requires_grad_(False)
    with torch.no_grad():
        assert torch.equal(model(_ids()), ref(_ids()))
    handle.detach()
    model.layers[2].requires_grad_(True)
    layerstream.offload(model, device="sim")
    model(_ids()).sum().backward()
    assert model.layers[2].weight.grad is not None and model.layers[1].weight.grad is None


def test_a_pinned_budget_below_the_store_never_plans_less_than_two_staging_entries(tmp_path):
    """host_budget holds the weights and one and a half layers, pinned_budget nothing:
    store tensors would be pageable and cross through staging entries, and one and a
    half entries failed at the first forward (a larger host_budget than the weights
    alone failed where that one worked). The weights go to the disk tier instead, and
    the plan stays within host_budget with what it leaves for activations. Weights not
    from a file have no disk to go to: an error at offload() saying what to raise."""
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    layer = D * D * 4 + D * 4
    budget = _layer_bytes(ref) + ref.emb.weight.numel() * 4 + layer * 3 // 2
    model = _meta()
    layerstream.load_safetensors(model, path)
    model.requires_grad_(False)
    handle = layerstream.offload(model, device="sim", host_budget=budget, pinned_budget=0)
    plan = handle.host_plan
    assert plan["disk_bytes"] > 0 and plan["staging_bytes"] >= 2 * layer, plan
    assert plan["store_bytes"] + plan["staging_bytes"] + plan["grad_staging_bytes"] + plan["spare_host_bytes"] == budget
    with torch.no_grad():
        assert torch.equal(model(_ids()), ref(_ids()))
    with pytest.raises(LayerstreamError, match=r"but not the staging entries the pinned budget of 0 B needs.*Raise "
                                               r"host_budget to at least .*, or pinned_budget to at least"):
        layerstream.offload(copy.deepcopy(ref).requires_grad_(False), device="sim", host_budget=budget, pinned_budget=0)


def test_the_error_of_a_model_in_memory_says_how_weights_can_stay_in_their_file():
    """A model whose weights are all in memory cannot use the disk tier: the error says
    how to load it so that it can, and gives the sizes unambiguously."""
    ref = _reference().requires_grad_(False)
    with pytest.raises(LayerstreamError, match=r"9 frozen Linear layer\(s\) have their weights in memory, e\.g\. "
                                               r"'layers\.0': .* load it with load_safetensors\(\)") as e:
        layerstream.offload(ref, device="sim", host_budget=_quarter(ref))
    assert "load_gguf" not in str(e.value) and "in all. Raise host_budget" in str(e.value)

def _loaded_trainable(path):
    model = _meta()
    layerstream.load_safetensors(model, path)
    return model


def test_the_host_budget_error_of_a_gpt2_loaded_by_load_safetensors_names_what_stays_in_ram(tmp_path):
    """GPT-2 built on the meta device and loaded by load_safetensors(): its Conv1D layers are
    tensor groups and its tables embeddings, read into RAM, and lm_head shares the table's
    weight. Before, the error said this model's weights were all in memory and to build it
    on the meta device and load it with load_safetensors(), which is what had been done."""
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with accelerate.init_empty_weights():
        model = transformers.GPT2LMHeadModel(cfg)
    model.tie_weights()
    layerstream.load_safetensors(model, str(tmp_path))
    model.requires_grad_(False)
    with pytest.raises(LayerstreamError, match=r"Raise host_budget to at least .*\(10 streamed layer\(s\) are not "
                                               r"Linear layers, so their .* stay in RAM however the model is loaded: "
                                               r"8 tensor group\(s\), e\.g\. 'transformer\.h\.0\.attn\.c_attn' "
                                               r"\(modules whose own forward reads their tensors: transformers' "
                                               r"Conv1D.*; 2 embedding table\(s\), e\.g\. 'transformer\.wte'\) "
                                               r"\(1 Linear layer\(s\) share their weight .*'lm_head'\)") as e:
        layerstream.offload(model, device="sim", host_budget="1KiB")
    assert "meta device" not in str(e.value)


def test_offload_of_a_model_built_on_meta_names_load_safetensors_and_load_gguf():
    """Before, the refusal of a model with no weights at all named only from_pretrained and
    to_empty() + load_state_dict(), not layerstream's own loaders for meta models."""
    with pytest.raises(LayerstreamError, match=r"have no data \(meta tensors\): emb\.weight, .*The model was built "
                                               r"without weights .*layerstream\.load_safetensors\(model, path\) .*"
                                               r"layerstream\.load_gguf\(model, path\)"):
        layerstream.offload(_meta(), device="sim")


def test_offload_after_a_partial_load_names_the_weights_the_load_left_out(tmp_path):
    """load_safetensors(strict=False) of a file without 'layers.3.weight' leaves it meta.
    Before, offload() said the model was built without weights and to load real weights
    (from_pretrained, to_empty()), though every other weight had been loaded; now it says
    a load left that one out and how to load it."""
    sd = {k: v.contiguous() for k, v in _reference().state_dict().items() if k != "layers.3.weight"}
    path = tmp_path / "partial.safetensors"
    save_file(sd, str(path))
    model = _meta()
    assert layerstream.load_safetensors(model, str(path), strict=False).missing == ["layers.3.weight"]
    with pytest.raises(LayerstreamError, match=r"^1 parameter\(s\)/buffer\(s\) have no data \(meta tensors\): "
                                               r"layers\.3\.weight\. The model's other weights have values, so a "
                                               r"load left these out \(load_safetensors\(strict=False\) lists them "
                                               r".*load_safetensors\(model, path, strict=False\) of a file that has "
                                               r"them") as e:
        layerstream.offload(model, device="sim")
    assert "built without weights" not in str(e.value)


def test_offload_of_non_persistent_buffers_left_meta_says_to_build_under_init_empty_weights(tmp_path):
    """A model built under torch.device('meta') keeps its non-persistent buffers (no
    checkpoint holds them) meta after load_safetensors(); the refusal says so."""
    class Scaled(Net):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.ones(1), persistent=False)

    path = _save(_reference(), tmp_path / "m.safetensors")
    with torch.device("meta"):
        model = Scaled()
    layerstream.load_safetensors(model, path)
    with pytest.raises(LayerstreamError, match=r"have no data \(meta tensors\): scale\. 'scale' is a non-persistent "
                                               r"buffer, which no checkpoint holds .*init_empty_weights\(\)"):
        layerstream.offload(model, device="sim")


def test_the_gradients_staging_buffers_count_in_the_host_budget(tmp_path):
    """Training: each trainable streamed layer's gradient is copied from the device into
    a host staging buffer the engine keeps; those count against host_budget next to the
    store. A budget that holds the weights but not their gradients' buffers is an error
    that says so; with room for both, the plan shows them."""
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    weights = _layer_bytes(ref) + ref.emb.weight.numel() * 4
    model = _meta()
    layerstream.load_safetensors(model, path)
    with pytest.raises(LayerstreamError, match=r"must be in RAM \(trainable, cast as read, or not loaded from a "
                                               r"file\), .* for the staging buffers of their gradients"):
        layerstream.offload(model, device="sim", host_budget=weights + _layer_bytes(ref) // 2)
    handle = layerstream.offload(model, device="sim", host_budget=weights + _layer_bytes(ref))
    grads = handle.host_plan["grad_staging_bytes"]
    assert grads == _layer_bytes(ref)  # weight + bias per layer; the weights' sizes are 256-byte multiples
    assert "of gradient staging buffers" in handle.plan
    assert handle.host_plan["spare_host_bytes"] == 0
    model(_ids()).sum().backward()
    assert all(m.weight.grad is not None for m in model.layers)
    # A pinned budget that holds the weights but not their gradients' buffers too: the
    # store is partly pageable, so the plan has the staging entries it crosses through.
    pinned = layerstream.offload(_loaded_trainable(path), device="sim", pinned_budget=weights).host_plan
    assert pinned["pageable_store_bytes"] > 0 and pinned["staging_bytes"] > 0, pinned
    assert pinned["staging_pinned"]  # the entries first, then the gradients' buffers, then the store
    assert pinned["grad_pinned_cap"] == min(weights - pinned["staging_bytes"], pinned["grad_staging_bytes"])
    # Frozen (inference, or a LoRA base): no gradient, no buffer.
    frozen = _meta()
    layerstream.load_safetensors(frozen, path)
    frozen.requires_grad_(False)
    assert layerstream.offload(frozen, device="sim", host_budget=weights).host_plan["grad_staging_bytes"] == 0


def test_the_plan_says_the_pageable_bytes_the_store_made():
    """The store pins whole tensors: under a pinned budget below one weight only the
    biases are pinned. handle.plan said the bytes beyond the cap were pageable (a
    weight's worth too few); it says what the store made (stats' pageable_bytes)."""
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).requires_grad_(False)
    weight, bias = 64 * 64 * 4, 64 * 4
    handle = layerstream.offload(model, device="sim", pinned_budget=weight - 1)
    h = handle.host_plan
    assert h["store_bytes"] == 4 * (weight + bias)
    assert h["pageable_store_bytes"] == h["store_bytes"] - (weight - 1)  # the floor the cap gives
    assert handle.stats()["pageable_bytes"] == 4 * weight  # every weight, no bias
    assert f"({4 * weight / 2**20:.2f} MiB pageable)" in handle.plan, handle.plan
    handle.detach()


def test_gradient_staging_buffers_beyond_the_pinned_budget_are_pageable():
    """The gradients' staging buffers are pinned within what the pinned budget leaves
    after the staging entries (host_plan["grad_pinned_cap"]); beyond it they are
    pageable, with a warning, and the gradients are the same. Without a pinned
    budget every buffer is pinned."""
    ref = _reference()
    grads, staged = {}, _layer_bytes(ref)  # a weight and a bias per layer (256-byte multiples)
    for pinned_budget in (0, None):
        model = copy.deepcopy(ref)
        handle = layerstream.offload(model, device="sim", pinned_budget=pinned_budget)
        if pinned_budget == 0:
            assert handle.host_plan["grad_pinned_cap"] == 0
            assert handle.host_plan["grad_staging_bytes"] == staged
            with pytest.warns(RuntimeWarning, match="the pinned budget leaves 0 B for their host staging buffers"):
                model(_ids()).sum().backward()
        else:
            assert handle.host_plan is None  # no budget: nothing planned
            model(_ids()).sum().backward()
        stats = handle.stats()
        assert (stats["grad_staging_pinned_bytes"], stats["grad_staging_pageable_bytes"]) == (
            (0, staged) if pinned_budget == 0 else (staged, 0))
        grads[pinned_budget] = [p.grad for p in model.parameters()]
        handle.detach()
    for a, b in zip(grads[0], grads[None]):
        assert torch.equal(a, b)


class _Twice(nn.Module):
    """Layer `a` runs twice per forward: two gradients per backward, summed."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return self.b(torch.relu(self.a(torch.relu(self.a(x)))))


def test_a_layer_used_twice_takes_its_extra_gradient_buffer_from_what_the_budget_leaves():
    """A layer called twice in one backward needs a second gradient staging buffer (its
    uses are summed in autograd's order) that the plan, made before any step, does not
    count: it takes what the host budget leaves (with saved activations' buffers). With
    room for it, no warning; with none, a warning says by how much host memory goes over
    host_budget. The gradients equal the resident model's either way."""
    import warnings
    from layerstream import _C
    torch.manual_seed(0)
    ref = _Twice()
    x = torch.randn(3, D)
    ref(x).sum().backward()
    probe = layerstream.offload(copy.deepcopy(ref), device="sim", host_budget="1GiB")
    needed = probe.host_plan["host_budget"] - probe.host_plan["spare_host_bytes"]
    probe.detach()
    extra = _C.gradient_staging_bytes(D * D * 4, D * 4)
    for budget, over in ((needed + extra, False), (needed + extra - 1, True)):
        model = copy.deepcopy(ref)
        for p in model.parameters():
            p.grad = None
        h = layerstream.offload(model, device="sim", host_budget=budget)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x).sum().backward()
        said = [str(w.message) for w in caught if "used more than once in one backward" in str(w.message)]
        assert len(said) == (1 if over else 0), said
        if over:
            assert "layer 'a'" in said[0] and "goes over host_budget by 1 B" in said[0]
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), n
        h.detach()


_RSS_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.nn as nn
    import layerstream
    d, n, budget, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dtype = getattr(torch, sys.argv[5]) if len(sys.argv) > 5 else torch.float32  # the model's
    def rss(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(n)]).to(dtype)
    model.requires_grad_(False)
    base = rss("VmRSS")
    layerstream.load_safetensors(model, path)
    handle = layerstream.offload(model, device="sim", host_budget=budget if budget > 0 else None, prefetch=1)
    with torch.no_grad():
        model(torch.ones(2, d, dtype=dtype))
        model(torch.ones(2, d, dtype=dtype))
    s = handle.stats()
    print(json.dumps({"base": base, "peak": rss("VmHWM"), "slots": s["slots"] * s["slot_bytes"],
                      "disk": s["disk_read_bytes"]}))
""")


def test_peak_rss_of_load_and_offload_stays_within_the_host_budget(tmp_path):
    """A model 4x larger than host_budget: peak RSS (VmHWM) minus what the process
    held before loading stays within host_budget + the sim device's slots (host
    memory too, on the sim device) + 64 MiB."""
    d, n = 1024, 32  # 32 x 4 MiB = 128 MiB
    torch.manual_seed(0)
    path = str(tmp_path / "big.safetensors")
    save_file({f"{i}.weight": torch.randn(d, d) for i in range(n)}, path)
    budget = d * d * 4 * n // 4
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(d), str(n), str(budget), path],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    import json
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["disk"] > 0
    grew = r["peak"] - r["base"]
    assert grew <= budget + r["slots"] + (64 << 20), r


@pytest.mark.parametrize("file_dtype,dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.float16)])
def test_a_checkpoint_in_another_float_dtype_is_cast_as_offload_reads_it(tmp_path, file_dtype, dtype):
    """An fp32 checkpoint for a bf16 model (and the other way): the Linear weights
    still stay in the file until offload() (never a dense copy in the file's dtype),
    which casts them as it reads them into the host store, rounded as Tensor.to()
    rounds: weights, outputs and LoRA gradients equal the resident model cast to that
    dtype, bit for bit. They cannot stream from the file (its bytes are not the
    model's): a host budget that cannot hold them is an error that says why."""
    ref = _reference(file_dtype)
    path = _save(ref, tmp_path / "m.safetensors")
    ref = ref.to(dtype)
    model = _meta(dtype)
    report = layerstream.load_safetensors(model, path)
    assert sorted(report.in_file) == sorted(n for n, p in ref.named_parameters() if n.startswith(("layers", "head")))
    w = model.layers[2].weight
    assert isinstance(w, FileWeight) and w.dtype == dtype and w.file_dtype == file_dtype
    assert f"read from {file_dtype}" in repr(w)
    assert torch.equal(w.read(), ref.layers[2].weight)
    model.requires_grad_(False)
    with pytest.raises(LayerstreamError, match=rf"cast as read, e.g. 'layers.0' from the file's {file_dtype} to "
                                               rf"the model's {dtype}, so they must be in RAM"):
        layerstream.offload(model, device="sim", host_budget=_quarter(model))
    assert isinstance(model.layers[0].weight, FileWeight)  # the refusal changed nothing
    handle = layerstream.offload(model, device="sim", budget=3 * D * D * dtype.itemsize + 4096)
    assert handle.stats()["layers"] > 0 and handle.stats()["disk_layers"] == 0
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.dtype == dtype and torch.equal(p, q), n
    ref.requires_grad_(False)
    assert_lora_steps_equal(model, ref, 2)
    handle.detach()


def test_a_weight_cast_as_read_crosses_the_chunks_of_the_temporary(tmp_path):
    """The cast goes through a temporary of at most 64 MiB of the file's dtype: a
    weight larger than that (16.8M fp32 values) comes out equal to Tensor.to()'s."""
    torch.manual_seed(0)
    big = nn.Linear(4096, 4100, bias=False)
    path = str(tmp_path / "big.safetensors")
    save_file({"weight": big.weight.detach()}, path)
    with torch.device("meta"):
        model = nn.Linear(4096, 4100, bias=False).to(torch.bfloat16)
    model.requires_grad_(False)
    assert layerstream.load_safetensors(model, path).in_file == ["weight"]
    handle = layerstream.offload(model, device="sim")
    assert torch.equal(model.weight, big.weight.detach().to(torch.bfloat16))
    handle.detach()


def test_peak_rss_of_a_checkpoint_cast_as_read_stays_near_the_models_size(tmp_path):
    """An fp32 file (128 MiB) into a bf16 model (64 MiB), all in RAM: peak RSS
    growth stays within the model's bytes + the slots + 48 MiB (reading the fp32
    tensors dense first would hold all 128 MiB of them beside the model)."""
    d, n = 1024, 32
    torch.manual_seed(0)
    path = str(tmp_path / "fp32.safetensors")
    save_file({f"{i}.weight": torch.randn(d, d) for i in range(n)}, path)
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(d), str(n), "0", path, "bfloat16"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    import json
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["disk"] == 0
    assert r["peak"] - r["base"] <= d * d * 2 * n + r["slots"] + (48 << 20), r


def test_suspend_and_resume_with_the_disk_tier(tmp_path):
    """suspend() between calls frees the slots (the staging entries go with the
    scheduler that owns them); after resume() the layers are read from the file
    again, into new entries, with the same outputs."""
    ref, path, model, handle = _frozen_on_disk(tmp_path)
    ids = _ids()
    with torch.no_grad():
        want = ref(ids)
        assert torch.equal(model(ids), want)
        read = handle.stats()["disk_read_bytes"]
        handle.suspend()
        assert handle.stats()["device_bytes"] == 0
        handle.resume()
        assert torch.equal(model(ids), want)
    stats = handle.stats()
    assert stats["disk_read_bytes"] > read and stats["device_bytes"] > 0
    assert stats["ordering_errors"] == 0
    handle.detach()
    assert isinstance(model.layers[0].weight, FileWeight)


def test_each_weight_left_in_the_file_is_read_in_its_own_dtype(tmp_path):
    """A bf16 checkpoint with one fp16 buffer, which safetensors sorts last: every
    FileWeight took the dtype of the checkpoint's last tensor (fp16), not its own, so
    offload() decoded the bf16 bytes as fp16 (the byte counts match): wrong weights and
    outputs, no error. Each now carries its own, and the model equals the resident one."""
    class WithHalf(Net):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale16", torch.ones(4, dtype=torch.float16))

    torch.manual_seed(0)
    ref = WithHalf().to(torch.bfloat16).requires_grad_(False)
    ref.scale16 = ref.scale16.half()
    path = _save(ref, tmp_path / "mixed.safetensors")
    with torch.device("meta"):
        model = WithHalf().to(torch.bfloat16)
    model.scale16 = torch.empty(4, dtype=torch.float16, device="meta")
    report = layerstream.load_safetensors(model, path)
    assert "layers.0.weight" in report.in_file
    model.requires_grad_(False)
    for n, p in model.named_parameters():
        if isinstance(p, FileWeight):
            assert p.file_dtype == torch.bfloat16, n
    assert torch.equal(model.layers[0].weight.read(), ref.layers[0].weight)
    handle = layerstream.offload(model, device="sim")
    assert torch.equal(model.layers[0].weight, ref.layers[0].weight)
    with torch.no_grad():
        assert torch.equal(model(_ids()), ref(_ids()))
    handle.detach()


def test_file_weight_read_refuses_a_byte_count_its_dtype_does_not_need(tmp_path):
    """FileWeight.read() read out.nbytes bytes whatever its range held: a stand-in
    whose file_dtype disagrees with its file (fp32 bytes read as bf16) gave the first
    half of them decoded as bf16, silently. It now refuses, naming both counts."""
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    model = _meta()
    layerstream.load_safetensors(model, path)
    w = model.layers[0].weight
    wrong = FileWeight(tuple(w.shape), torch.bfloat16, w.file_range, w.file_name, file_dtype=torch.bfloat16)
    with pytest.raises(LayerstreamError, match=rf"has {D * D * 4} bytes in .*needs {D * D * 2}; this FileWeight "
                                               r"does not describe its file"):
        wrong.read()
    assert torch.equal(w.read(), ref.layers[0].weight)


@pytest.mark.parametrize("make_optimizer", [lambda ps: torch.optim.SGD(ps, lr=0.1),
                                            lambda ps: torch.optim.AdamW(ps, lr=1e-2)], ids=["sgd", "adamw"])
def test_an_optimizer_built_before_offload_steps_the_weights_read_from_the_file(tmp_path, make_optimizer):
    """Parameters keep their identity: an optimizer built after load_safetensors() and
    before offload() holds the FileWeight stand-ins. offload() put new Parameters in
    their place, so the optimizer stepped stand-ins that never get a gradient: the
    Linear weights never trained, silently. Now each stand-in becomes the parameter it
    read, in place, and two steps equal the resident model's bit for bit."""
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    model = _meta()
    layerstream.load_safetensors(model, path)
    before = dict(model.named_parameters())
    opt, opt_ref = make_optimizer(model.parameters()), make_optimizer(ref.parameters())
    handle = layerstream.offload(model, device="sim")
    for n, p in model.named_parameters():
        assert p is before[n] and not isinstance(p, FileWeight), n
    for _ in range(2):
        model(_ids()).square().mean().backward()
        ref(_ids()).square().mean().backward()
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    assert not torch.equal(model.layers[0].weight, _reference().layers[0].weight)  # it did train
    with torch.no_grad():
        assert torch.equal(model(_ids()), ref(_ids()))
    handle.detach()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p is before[n] and torch.equal(p, q), n


def test_a_weak_reference_to_a_weight_still_in_its_file_is_refused_by_offload_naming_it(tmp_path):
    """Reading a stand-in in place (torch.utils.swap_tensors) cannot keep a weak
    reference to it right: offload() refuses, naming the weight (never a silent new
    Parameter beside it); the weights read before keep their values, and offload()
    works once the reference is gone."""
    import weakref
    ref = _reference()
    path = _save(ref, tmp_path / "m.safetensors")
    model = _meta()
    layerstream.load_safetensors(model, path)
    held = weakref.ref(model.layers[3].weight)
    with pytest.raises(LayerstreamError, match=r"offload\(\): cannot read 'layers.3.weight' .*weak"):
        layerstream.offload(model, device="sim")
    assert isinstance(model.layers[3].weight, FileWeight)
    assert torch.equal(model.layers[0].weight, ref.layers[0].weight)
    del held
    handle = layerstream.offload(model, device="sim")
    with torch.no_grad():
        assert torch.equal(model(_ids()), ref(_ids()))
    handle.detach()


def test_offload_of_a_file_loaded_model_walks_it_as_often_whatever_its_layer_count(tmp_path, monkeypatch):
    """offload() of a model loaded by load_safetensors() walked the whole model once for
    every weight it read from the file (to find who holds it): time quadratic in the
    layer count (800 layers: 16 s). Counted here as walks of the root module, which
    must not grow with the layers."""
    walks = []
    plain = nn.Module.named_modules

    def counted(self, *args, **kwargs):
        walks[-1] += self is model
        return plain(self, *args, **kwargs)

    counts = []
    for n in (4, 16):
        torch.manual_seed(0)
        ref = Net(n=n)
        path = _save(ref, tmp_path / f"m{n}.safetensors")
        with torch.device("meta"):
            model = Net(n=n)
        layerstream.load_safetensors(model, path)
        walks.append(0)
        monkeypatch.setattr(nn.Module, "named_modules", counted)
        handle = layerstream.offload(model, device="sim")
        monkeypatch.setattr(nn.Module, "named_modules", plain)
        counts.append(walks[-1])
        with torch.no_grad():
            assert torch.equal(model(_ids()), ref(_ids()))
        handle.detach()
    assert counts[0] == counts[1], counts
