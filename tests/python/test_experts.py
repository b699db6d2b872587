"""Mixture-of-experts modules (transformers' *Experts: expert weights as 3-D parameters
that the module indexes itself) stream as tensor groups: one slot holds all of a
module's tensors, its own forward runs on the fetched views, and when a gradient is
needed it runs again in backward on the fetched weights. On the sim device every number
is compared bit for bit with the resident model; test_parity_layers.py runs one on CUDA."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from layerstream import LayerstreamError

transformers = pytest.importorskip("transformers")


def _qwen3_moe(**over):
    cfg = transformers.Qwen3MoeConfig(**{**dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64), **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg)


def _gpt_oss(experts=4):
    """GPT-OSS: expert biases, routing ids passed as `router_indices`."""
    cfg = transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=experts, num_experts_per_tok=2,
        max_position_embeddings=64, layer_types=["full_attention", "full_attention"])
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GptOssForCausalLM(cfg)


def _ids(seed=3):
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(seed))


def _train_compare(model, ref, steps=2):
    """`steps` backwards without zero_grad (grads accumulate), then AdamW on both:
    losses, every gradient and the next logits are bit-identical."""
    for i in range(steps):
        loss, loss_r = model(input_ids=_ids(i), labels=_ids(i)).loss, ref(input_ids=_ids(i), labels=_ids(i)).loss
        assert torch.equal(loss, loss_r), f"step {i}"
        loss.backward(), loss_r.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"{n}: gradient differs"
    for m in (model, ref):
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2).step()
    with torch.no_grad():
        assert torch.equal(model(input_ids=_ids(9)).logits, ref(input_ids=_ids(9)).logits)


def _one_step_equal(model, ref):
    """One loss and backward on each: the losses and the gradients of every trainable
    parameter equal bit for bit; returns the trainable parameters' names."""
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    assert torch.equal(loss, want)
    grads = dict(ref.named_parameters())
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    for n in trained:
        assert torch.equal(dict(model.named_parameters())[n].grad, grads[n].grad), n
    return trained


@pytest.mark.parametrize("make", [_qwen3_moe, _gpt_oss], ids=["qwen3-moe", "gpt-oss-biases"])
def test_experts_stream_as_groups_and_train_exactly(offload_sim, recwarn, make):
    """Every experts module streams (one group layer each, no warning); inference and
    full training (the experts' own gradients copied to the host) match the resident
    model bit for bit; detach() restores the parameters."""
    model = make()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    assert not [w for w in recwarn if "layerstream" in str(w.message)]
    groups = [n for n in handle.layers if n.endswith("mlp.experts")]
    assert len(groups) == 2 and handle.stats()["group_layers"] == 2
    experts = model.model.layers[0].mlp.experts
    assert all(p.device.type == "cpu" for p in experts.parameters())
    with torch.no_grad():
        assert torch.equal(model(input_ids=_ids()).logits, ref(input_ids=_ids()).logits)
    _train_compare(model, ref)
    assert experts.gate_up_proj.grad.device.type == "cpu"
    handle.detach()
    assert "forward" not in experts.__dict__
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n


def test_frozen_experts_with_gradient_checkpointing(offload_sim):
    """The LoRA-like case: frozen experts, the rest trains, with transformers' gradient
    checkpointing around the decoder layers (it re-runs the experts' forward itself).
    Exact; the experts get no gradient."""
    model = _qwen3_moe()
    for n, p in model.named_parameters():
        p.requires_grad_("experts" not in n)
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.gradient_checkpointing_enable()
        m.train()
    offload_sim(model)
    _train_compare(model, ref)
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad is None


def test_budget_plans_experts_as_one_slot_each(offload_sim):
    """The planner sees each experts module as one layer of all its tensors; with a budget
    below the model's weights they stream through slots of that size and the numbers hold."""
    model = _qwen3_moe()
    ref = copy.deepcopy(model)
    experts = model.model.layers[0].mlp.experts
    group = sum((p.numel() * 4 + 255) // 256 * 256 for p in experts.parameters())
    budget = 2 * group + 4096  # two slots of a group and a little room
    assert budget < sum(p.numel() * 4 for p in model.parameters())
    handle = offload_sim(model, budget=budget, prefetch=1)
    assert "model.layers.0.mlp.experts" in handle.layers and "model.layers.1.mlp.experts" in handle.layers
    _train_compare(model, ref, steps=1)
    stats = handle.stats()
    assert stats["slot_bytes"] >= group and stats["peak_device_bytes"] <= budget
    assert stats["h2d_bytes"] >= 2 * 2 * group  # each group crossed in forward and in backward


def test_experts_errors(offload_sim):
    """Double backward through a group and a replaced parameter are clear errors;
    moving the model to the compute device is fine, changing its dtype is refused."""
    model = _qwen3_moe()
    handle = offload_sim(model)
    model.to("cpu")  # the compute device of "sim": the streamed tensors stay as they are
    with pytest.raises(LayerstreamError, match="'model.layers.1.mlp.experts' keeps its weights in host memory"
                                               ".*gate_up_proj is torch.float32"):
        model.model.layers[1].mlp.experts.half()
    loss = model(input_ids=_ids(), labels=_ids()).loss
    grads = torch.autograd.grad(loss, [model.model.embed_tokens.weight], create_graph=False)
    assert grads[0] is not None
    experts = model.model.layers[1].mlp.experts
    experts.down_proj = nn.Parameter(experts.down_proj.detach().clone())
    with pytest.raises(LayerstreamError, match="were replaced after offload"):
        model(input_ids=_ids())
    del handle
    model = _qwen3_moe()
    offload_sim(model, include=["*experts"])  # only the groups stream
    loss = model(input_ids=_ids(), labels=_ids()).loss
    with pytest.raises(LayerstreamError, match="'model.layers.1.mlp.experts': backward with create_graph=True"):
        loss.backward(create_graph=True)


def test_shared_expert_tensor_keeps_the_module_resident(offload_sim):
    """A tensor of an experts module that another module also holds stays resident with
    the module (one warning), like any tied weight it cannot stream alone."""
    model = _qwen3_moe()
    other = model.model.layers[1].mlp.experts
    other.down_proj = model.model.layers[0].mlp.experts.down_proj
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match=r"tied weights stay resident .*mlp.experts' \(down_proj shared"):
        handle = offload_sim(model)
    assert not [n for n in handle.layers if n.endswith("experts")]
    with torch.no_grad():
        assert torch.equal(model(input_ids=_ids()).logits, ref(input_ids=_ids()).logits)


def _lora_moe(fmt_seed=0):
    peft = pytest.importorskip("peft")
    torch.manual_seed(fmt_seed)
    base = _qwen3_moe(hidden_size=64, moe_intermediate_size=64, head_dim=32)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_quantized_experts_stream_packed(offload_sim, fmt):
    """QLoRA on a mixture-of-experts model: quantize= packs the 3-D expert tensors (as
    matrices of their last dimension), the module keeps data-less stand-ins, and the slot
    holds them dequantized. Checked against an independent reference (quant_ref.py: the
    format's spec in torch): the streamed model computes exactly what the model computes
    resident with every packed tensor replaced by its reference dequantization (loss and
    the adapter's gradients, bit for bit), and detach() restores exactly those values,
    within the format's bound of the original weights."""
    from quant_ref import assert_reference_values, packed_names, with_reference_values

    model = _lora_moe()
    original = copy.deepcopy(model)
    experts_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "experts" in n)
    dense = copy.deepcopy(model)
    pinned_dense = offload_sim(dense, quantize={"*lora_*": None, "*experts": None, "*": fmt}).stats()["pinned_bytes"]
    handle = offload_sim(model, quantize={"*lora_*": None, "*": fmt})
    experts = model.base_model.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.is_meta and type(experts.gate_up_proj).__name__ == "_PackedWeight"
    packed = packed_names(model)
    assert sum("experts" in n for n in packed) == 4  # gate_up_proj and down_proj of both layers
    stats = handle.stats()
    assert stats["group_layers"] == 2
    # Every streamed layer but the table and the adapters' is packed, the two groups included.
    assert stats["quantized_layers"] == len([n for n in handle.layers if "lora_" not in n]) - 1
    # The experts take ~27% (int8) / ~14% (nf4) of their fp32 bytes on the host.
    assert stats["pinned_bytes"] < pinned_dense - experts_bytes * (0.7 if fmt == "int8" else 0.85)
    trained = _one_step_equal(model, with_reference_values(original, fmt, packed))
    assert trained and all("lora_" in n for n in trained)
    handle.detach()
    assert experts.gate_up_proj.device.type == "cpu" and not experts.gate_up_proj.is_meta
    restored, before = dict(model.named_parameters()), dict(original.named_parameters())
    for n in packed:
        assert_reference_values(fmt, before[n], restored[n], n)


def test_quantized_experts_load_state_dict_requantizes(offload_sim):
    """load_state_dict() into an offloaded model with packed experts re-quantizes the new
    values (no meta-copy warning, no missing keys); the result computes as a fresh offload
    of the loaded model."""
    model, other = _qwen3_moe(), _qwen3_moe(hidden_size=32)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-0.5)
    fresh = copy.deepcopy(other)
    model.requires_grad_(False)
    fresh.requires_grad_(False)
    offload_sim(model, quantize="int8")
    offload_sim(fresh, quantize="int8")
    result = model.load_state_dict(other.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    with torch.no_grad():
        assert torch.equal(model(input_ids=_ids()).logits, fresh(input_ids=_ids()).logits)
    experts = model.model.layers[0].mlp.experts
    with pytest.raises(LayerstreamError, match="cannot be converted or moved"):
        experts.gate_up_proj.half()


def test_quantizing_trainable_experts_is_refused(offload_sim):
    model = _qwen3_moe()
    with pytest.raises(LayerstreamError, match=r"would quantize \d+ trainable layer\(s\), .*mlp.experts"):
        offload_sim(model, quantize="nf4")


def test_writing_experts_between_forward_and_backward_is_an_error(offload_sim):
    """An in-place write to a trainable expert tensor after the forward would make the
    backward's recompute use other values; it raises, as autograd does for a resident
    module."""
    model = _qwen3_moe()
    offload_sim(model)
    loss = model(input_ids=_ids(), labels=_ids()).loss
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj.mul_(2)
    with pytest.raises(LayerstreamError, match="'model.layers.1.mlp.experts': a tensor its backward needs"):
        loss.backward()


def test_requantizing_experts_between_forward_and_backward_is_an_error(offload_sim):
    """Packed experts re-quantized (load_state_dict) after the forward: the backward's
    recompute would use the new values; it raises instead."""
    model = _lora_moe()
    offload_sim(model, quantize={"*lora_*": None, "*": "int8"})
    experts = model.base_model.model.model.layers[1].mlp.experts
    loss = model(input_ids=_ids(), labels=_ids()).loss
    experts.load_state_dict({"gate_up_proj": torch.randn(experts.gate_up_proj.shape),
                             "down_proj": torch.randn(experts.down_proj.shape)})
    with pytest.raises(LayerstreamError, match="mlp.experts': a tensor its backward needs"):
        loss.backward()


# ---- routed fetch: only the experts a call routes to cross the bus ----

def _many_experts(impl="eager", **over):
    """16 experts, 2 per token: one token reads at most 2 of them."""
    model = _qwen3_moe(num_experts=16, num_experts_per_tok=2, **over)
    model.config._experts_implementation = impl
    return model


def _hits(model):
    """Records, per forward of each experts module, how many experts its ids name."""
    seen = []
    for m in model.modules():
        if type(m).__name__.endswith("Experts"):
            m.register_forward_pre_hook(lambda mod, args: seen.append(int(torch.unique(args[1]).numel())))
    return seen


def _expert_bytes(model):
    experts = model.model.layers[0].mlp.experts
    return sum(p.numel() * p.element_size() for p in experts.parameters()) // experts.num_experts


@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
def test_routed_experts_copy_only_the_experts_a_call_reads(offload_sim, monkeypatch, impl):
    """Decoding one token reads 2 of 16 experts per layer: after the first such call
    (whose groups were prefetched whole), only those experts' slices cross the bus,
    exactly the bytes of the experts the router chose, and the logits equal the
    resident model's bit for bit, in each of transformers' experts implementations."""
    model = _many_experts(impl)
    ref = copy.deepcopy(model)
    whole = copy.deepcopy(model)
    handle = offload_sim(model)
    h_all = offload_sim(whole, experts="all")
    hits = _hits(model)
    token = torch.tensor([[5]])
    with torch.no_grad():
        for step in range(3):
            before, before_all = handle.stats()["h2d_bytes"], h_all.stats()["h2d_bytes"]
            hits.clear()
            out = model(input_ids=token + step).logits
            assert torch.equal(out, ref(input_ids=token + step).logits), f"step {step}"
            assert torch.equal(out, whole(input_ids=token + step).logits), f"step {step}"
            moved, moved_all = handle.stats()["h2d_bytes"] - before, h_all.stats()["h2d_bytes"] - before_all
        # The last step: all - routed = the experts not read, in each of the two layers.
        assert len(hits) == 2 and all(h <= 2 for h in hits)
        assert moved_all - moved == sum(16 - h for h in hits) * _expert_bytes(model)
    stats = handle.stats()
    assert stats["routed_fetches"] >= 4 and h_all.stats()["routed_fetches"] == 0
    # A batch of more than 2 x 16 (token, expert) picks fetches the whole group again,
    # without asking the device which experts it reads.
    unique, asked = torch.unique, []
    monkeypatch.setattr(torch, "unique", lambda *a, **k: (asked.append(
        __import__("sys")._getframe(1).f_globals["__name__"]), unique(*a, **k))[1])
    many = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(input_ids=many).logits, ref(input_ids=many).logits)
    assert handle.stats()["routed_fetches"] == stats["routed_fetches"]
    ours = lambda: [n for n in asked if n == "layerstream" or n.startswith("layerstream.")]  # noqa: E731
    assert ours() == []
    with torch.no_grad():
        model(input_ids=token)
    assert ours()  # one token: it does ask


def _gpt_oss_many():
    return _gpt_oss(experts=16)


@pytest.mark.parametrize("make", [_many_experts, _gpt_oss_many], ids=["qwen3-moe", "gpt-oss-biases"])
def test_routed_experts_train_exactly(offload_sim, make):
    """Training on a few tokens (forward, and the backward's recompute, each copy the
    experts routed to): the loss and every gradient, the experts' own included (zero for
    the experts not read), match the resident model bit for bit."""
    model = make()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    for step in range(3):
        ids = torch.tensor([[3 + step, 7]])
        loss, want = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
        assert torch.equal(loss, want)
        loss.backward(), want.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    # Steps 2 and 3: forward and recompute of both layers copied some experts only.
    assert handle.stats()["routed_fetches"] >= 2 * 2 * 2


@pytest.mark.parametrize("fmt", ["int8", "fp8", "nf4"])
def test_routed_quantized_experts_dequantize_only_theirs(offload_sim, fmt):
    """Packed experts: the chosen experts' packed bytes (codes and scales) are copied and
    only their rows are dequantized; the logits equal those of the same packed model
    fetching every expert and those of the model resident with the experts' reference
    dequantization (quant_ref.py), bit for bit, with fewer bytes on the bus."""
    from quant_ref import packed_names, with_reference_values

    model = _many_experts(hidden_size=64, moe_intermediate_size=32, head_dim=32)
    model.requires_grad_(False)
    whole = copy.deepcopy(model)
    original = copy.deepcopy(model)
    handle = offload_sim(model, quantize={"*experts": fmt})
    h_all = offload_sim(whole, quantize={"*experts": fmt}, experts="all")
    packed = packed_names(model)
    assert len(packed) == 4 and all("experts" in n for n in packed)
    ref = with_reference_values(original, fmt, packed)  # independent: the format's spec in torch
    token = torch.tensor([[9]])
    with torch.no_grad():
        for step in range(3):
            before, before_all = handle.stats()["h2d_bytes"], h_all.stats()["h2d_bytes"]
            out = model(input_ids=token + step).logits
            assert torch.equal(out, whole(input_ids=token + step).logits)
            assert torch.equal(out, ref(input_ids=token + step).logits), "differs from the reference values"
    assert handle.stats()["h2d_bytes"] - before < (h_all.stats()["h2d_bytes"] - before_all) * 0.8
    assert handle.stats()["routed_fetches"] >= 4


def test_other_experts_implementations_get_every_expert(offload_sim):
    """An experts implementation layerstream does not know (here one that computes every
    expert densely, reading all of them) is given the whole group: same numbers, no routed
    fetch. experts= takes "routed" or "all"."""
    moe = pytest.importorskip("transformers.integrations.moe")

    def dense(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):  # reads every expert
            gate, up = nn.functional.linear(hidden_states, self.gate_up_proj[e]).chunk(2, dim=-1)
            h = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
            w = (top_k_weights * (top_k_index == e)).sum(-1, keepdim=True)
            out = out + h * w
        return out

    moe.ALL_EXPERTS_FUNCTIONS.register("ls_test_dense", dense)
    try:
        model = _many_experts("ls_test_dense")
        ref = copy.deepcopy(model)
        handle = offload_sim(model)
        with torch.no_grad():
            for step in range(3):
                token = torch.tensor([[5 + step]])
                assert torch.equal(model(input_ids=token).logits, ref(input_ids=token).logits)
        assert handle.stats()["routed_fetches"] == 0
    finally:
        del moe.ExpertsInterface._global_mapping["ls_test_dense"]
    with pytest.raises(ValueError, match='experts must be "routed"'):
        offload_sim(_qwen3_moe(), experts="some")


def test_generate_with_routed_experts_matches_resident(offload_sim):
    """transformers' generate() (greedy, KV cache) on a streamed MoE model: after the
    prompt, every new token copies only its experts, and the generated ids equal the
    resident model's."""
    model = _many_experts()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    prompt = torch.tensor([[3, 9, 4]])
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(prompt, **kw), ref.generate(prompt, **kw))
    assert handle.stats()["routed_fetches"] >= 2 * 5


# ---- peft's LoRA on expert parameters (target_parameters) ----

def _param_lora(model, params=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"), seed=1, **kw):
    """peft's LoRA on the experts' 3-D tensors (ParamWrapper, nested: one per tensor) and
    on q_proj; random B factors (peft's default zeros would make every delta zero)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    return peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=list(params),
                                                      init_lora_weights=False, **kw))


def _wrappers(model):
    return [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]


@pytest.mark.parametrize("make", [_qwen3_moe, _gpt_oss], ids=["qwen3-moe", "gpt-oss-biases"])
def test_lora_on_expert_parameters_trains_exactly(offload_sim, recwarn, make):
    """peft's LoRA on expert tensors (LoraConfig(target_parameters=...)) over streamed
    experts: each call's adapted tensors are computed on the compute device from the
    fetched ones (Note [Adapters on a streamed group's tensors]); logits, every gradient
    (the adapters' factors' through the backward's recompute) and the logits after AdamW
    equal the resident peft model's bit for bit. The adapters' own Linear modules stay on
    the device, unwarned (the wrapper reads their weights directly); detach() restores
    peft's wrappers."""
    model = _param_lora(make())
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    assert not [w for w in recwarn if "layerstream" in str(w.message)]
    assert sum(n.endswith("experts.base_layer.base_layer") for n in handle.layers) == 2
    assert not [n for n in handle.layers if "experts.lora_" in n or "base_layer.lora_" in n]
    assert all("_activate_lora" in w.__dict__ for w in _wrappers(model))
    with torch.no_grad():
        assert torch.equal(model(input_ids=_ids()).logits, ref(input_ids=_ids()).logits)
    _train_compare(model, ref)
    lora = [n for n, p in model.named_parameters() if "lora" in n and "experts" in n and p.grad is not None]
    assert len(lora) == 2 * 2 * 2  # layers x tensors x (A, B)
    handle.detach()
    assert not [w for w in _wrappers(model) if "_activate_lora" in w.__dict__]
    with torch.no_grad():
        assert torch.equal(model(input_ids=_ids(5)).logits, ref(input_ids=_ids(5)).logits)


def test_lora_on_expert_parameters_added_after_offload(offload_sim):
    """Adapters added after offload() (get_peft_model on the streamed model, as for Linear
    adapters) are taken over at the first call of the block that holds them; routed calls
    (16 experts, one token) copy only their experts and still match the resident model,
    with gradient checkpointing in training."""
    base = _many_experts()
    ref = _param_lora(copy.deepcopy(base))
    handle = offload_sim(base)
    model = _param_lora(base)
    for m in (model, ref):
        m.gradient_checkpointing_enable()
        m.train()
    with torch.no_grad():
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert torch.equal(p, q), n
        for token in (5, 9, 17):  # the first call's groups come whole (prefetched)
            one = torch.tensor([[token]])
            assert torch.equal(model(input_ids=one).logits, ref(input_ids=one).logits)
    assert handle.stats()["routed_fetches"] >= 2 * 2
    assert all("_activate_lora" in w.__dict__ for w in _wrappers(model))
    _train_compare(model, ref)


def test_lora_on_expert_parameters_with_two_adapters_adds_their_deltas(offload_sim):
    """Two active adapters on one expert tensor: peft adds the sum of their deltas (not
    the factors' baddbmm); the same here, bit for bit, gradients included."""
    model = _param_lora(_qwen3_moe(), params=("mlp.experts.gate_up_proj",))
    peft = pytest.importorskip("peft")
    torch.manual_seed(2)
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                target_parameters=["mlp.experts.gate_up_proj"], init_lora_weights=False))
    model.base_model.set_adapter(["default", "second"])
    for n, p in model.named_parameters():
        p.requires_grad_("lora" in n)
    ref = copy.deepcopy(model)
    offload_sim(model)
    _train_compare(model, ref, steps=1)
    assert model.base_model.model.model.layers[0].mlp.experts.lora_B["second"].weight.grad is not None


def test_a_copy_of_a_lora_wrapper_over_streamed_experts_computes_with_its_own_adapters(offload_sim):
    """copy.deepcopy() of peft's wrapper over streamed experts (its base is copied plain,
    _forward._PlainCopy): the copy activates its own adapters on its own experts, as a
    copy of the resident wrapper does, pickled again too. Before, the copy's
    _activate_lora was the original's patch (it applied the original wrapper's adapters
    through the streamed experts), or one whose group forward was left out of the copy
    (AttributeError). The copy, in a model offloaded anew, streams exactly."""
    import io

    model = _param_lora(_qwen3_moe())
    ref = copy.deepcopy(model)
    offload_sim(model)
    top, ref_top = (m.base_model.model.model.layers[0].mlp.experts for m in (model, ref))
    clone, ref_clone = copy.deepcopy(top), copy.deepcopy(ref_top)
    with torch.no_grad():
        for c in (clone, ref_clone):  # the copies' adapters part from the originals'
            c.lora_B["default"].weight.mul_(3)
    buf = io.BytesIO()
    torch.save(clone, buf)
    buf.seek(0)
    reloaded = torch.load(buf, weights_only=False)
    g = torch.Generator().manual_seed(4)
    x, top_k, weights = torch.randn(9, 32, generator=g), torch.randint(0, 4, (9, 2), generator=g), torch.rand(9, 2)
    with torch.no_grad():
        expected = ref_clone(x, top_k, weights)
        assert not torch.equal(expected, ref_top(x, top_k, weights))
        assert torch.equal(clone(x, top_k, weights), expected)
        assert torch.equal(reloaded(x, top_k, weights), expected)
        assert torch.equal(top(x, top_k, weights), ref_top(x, top_k, weights))
    # The copy in a model offloaded anew activates through its streamed experts again.
    model2, ref2 = copy.deepcopy(ref), copy.deepcopy(ref)
    model2.base_model.model.model.layers[0].mlp.experts = clone
    ref2.base_model.model.model.layers[0].mlp.experts = ref_clone
    offload_sim(model2)
    assert clone.__dict__["_activate_lora"]._fwd is not None
    _train_compare(model2, ref2, steps=1)


@pytest.mark.parametrize("fmt", ["int8", "lossless"])
def test_lora_on_packed_expert_parameters(offload_sim, fmt):
    """QLoRA on the experts' own tensors: packed (int8) or lossless-coded frozen experts
    with peft's adapters on them; the adapter applies to the dequantized / decoded tensor
    in the slot. Loss and adapter gradients equal, bit for bit, the resident model's with
    the experts replaced by their reference dequantization (int8, quant_ref.py) or
    unchanged (lossless)."""
    from quant_ref import packed_names, with_reference_values

    model = _param_lora(_qwen3_moe())
    original = copy.deepcopy(model)
    handle = offload_sim(model, quantize={"*lora_*": None, "*": fmt})
    assert handle.stats()["group_layers"] == 2
    experts = model.base_model.model.model.layers[0].mlp.experts.base_layer.base_layer
    assert type(experts.gate_up_proj).__name__ == "_PackedWeight"
    ref = original if fmt == "lossless" else with_reference_values(original, fmt, packed_names(model))
    trained = _one_step_equal(model, ref)
    assert sum("experts" in n for n in trained) == 2 * 2 * 2


def test_lora_on_a_linear_weight_parameter_keeps_the_layer_resident(offload_sim):
    """target_parameters on a Linear's weight (peft parametrizes it during each call):
    a streamed Linear computes from its own weight, so that layer stays resident with the
    "computed" warning, and the numbers hold."""
    model = _param_lora(_qwen3_moe(), params=("self_attn.o_proj.weight",))
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match=r"not a parameter of their own .*o_proj"):
        handle = offload_sim(model)
    assert not [n for n in handle.layers if "o_proj" in n]
    with torch.no_grad():
        assert torch.equal(model(input_ids=_ids()).logits, ref(input_ids=_ids()).logits)


def test_other_parametrizations_of_expert_tensors_are_a_clear_error(offload_sim):
    """A parametrization layerstream does not know (registered on the streamed module
    itself) would compute from the host tensor: the call says so."""
    model = _qwen3_moe()
    offload_sim(model)
    experts = model.model.layers[0].mlp.experts

    class Twice(nn.Module):
        def forward(self, w):
            return 2 * w

    torch.nn.utils.parametrize.register_parametrization(experts, "gate_up_proj", Twice())
    with pytest.raises(LayerstreamError, match=r"'gate_up_proj' is parametrized during the call .*exclude"):
        model(input_ids=_ids())


# ---- lossless-coded experts: one coded piece per expert ----

def _bits(t):
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_lossless_experts_route_and_decode_bit_for_bit(offload_sim, dtype):
    """quantize="lossless" codes each expert tensor one expert at a time (a coded piece
    per expert, lossless::expert_pieces), so a routed call copies only its experts' coded
    bytes and decodes them alone: the logits equal the resident model's bit for bit,
    routed or fetched whole; fewer bytes cross than with the dense experts routed the same
    way, and the host holds fewer; detach() restores every expert tensor bit for bit."""
    model = _many_experts(hidden_size=64, moe_intermediate_size=32, head_dim=32).to(dtype)
    model.requires_grad_(False)
    ref, whole, dense, original = (copy.deepcopy(model) for _ in range(4))
    handle = offload_sim(model, quantize={"*experts": "lossless"})
    h_all = offload_sim(whole, quantize={"*experts": "lossless"}, experts="all")
    h_dense = offload_sim(dense)
    assert handle.stats()["quantized_layers"] == 2 and handle.stats()["group_layers"] == 2
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.is_meta  # the engine holds the coded bytes only
    token = torch.tensor([[9]])
    with torch.no_grad():
        for step in range(3):
            before = [h.stats()["h2d_bytes"] for h in (handle, h_all, h_dense)]
            out = model(input_ids=token + step).logits
            assert torch.equal(out, ref(input_ids=token + step).logits), f"step {step}"
            assert torch.equal(out, whole(input_ids=token + step).logits), f"step {step}"
            assert torch.equal(out, dense(input_ids=token + step).logits), f"step {step}"
            moved, moved_all, moved_dense = (h.stats()["h2d_bytes"] - b for h, b in zip((handle, h_all, h_dense),
                                                                                        before))
    # The last step: routed copies of the coded experts, fewer bytes than the coded
    # experts fetched whole and than the dense experts routed the same way.
    assert handle.stats()["routed_fetches"] >= 4 and h_all.stats()["routed_fetches"] == 0
    assert moved < moved_all * 0.8
    assert moved < moved_dense
    assert handle.stats()["pinned_bytes"] < h_dense.stats()["pinned_bytes"]
    handle.detach()
    assert not experts.gate_up_proj.is_meta
    restored = dict(model.named_parameters())
    for n, p in original.named_parameters():
        assert torch.equal(_bits(restored[n]), _bits(p)), n


def test_lossless_experts_under_lora_train_exactly(offload_sim):
    """LoRA on attention over lossless-coded frozen experts (and coded frozen Linear
    layers): loss and the adapters' gradients equal the resident model's bit for bit; new
    values cannot be coded into a coded expert tensor's place (clear error)."""
    model = _lora_moe()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, quantize={"*lora_*": None, "*": "lossless"})
    assert handle.stats()["quantized_layers"] >= 2
    ids = _ids()
    loss, want = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    assert torch.equal(loss, want)
    loss.backward(), want.backward()
    grads = dict(ref.named_parameters())
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained
    for n, p in trained:
        assert torch.equal(p.grad, grads[n].grad), n
    experts = model.base_model.model.model.layers[0].mlp.experts
    with pytest.raises(LayerstreamError, match="lossless-coded, whose size depends on its values"):
        with torch.no_grad():
            experts.down_proj.copy_(torch.zeros(experts.down_proj.shape))


def _wide_qwen3_moe():
    """Experts of 128 x 128: coded, a piece is smaller than dense (a header and 256-byte
    sections make a tiny expert larger)."""
    return _qwen3_moe(hidden_size=128, moe_intermediate_size=128, head_dim=64)


@pytest.mark.parametrize("make", [_wide_qwen3_moe, _gpt_oss], ids=["qwen3-moe", "gpt-oss-biases"])
def test_lossless_trainable_experts_train_coded_exactly(offload_sim, recwarn, make):
    """Full fine-tuning with quantize="lossless": the trainable expert tensors stay dense
    parameters on the host (backward and the optimizer write them) and cross the bus
    coded, one piece per expert, re-coded before the next copy after each optimizer step
    (Note [Trainable coded weights]). Losses, every gradient and the logits after AdamW
    equal the resident model's bit for bit; fewer bytes cross than dense; the host
    warning says what the dense copies cost; detach() gives back the trained values."""
    model = make().to(torch.bfloat16)
    ref, dense, dense_ref = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    handle = offload_sim(model, quantize={"*experts": "lossless"})
    h_dense = offload_sim(dense)
    warned = [str(w.message) for w in recwarn if "require grad, so each keeps" in str(w.message)]
    assert len(warned) == 1 and warned[0].count("2 lossless layer(s)") == 1, warned
    experts = model.model.layers[0].mlp.experts
    assert type(experts.gate_up_proj) is nn.Parameter and experts.gate_up_proj.requires_grad
    assert handle.stats()["coded_layers"] == 2
    _train_compare(model, ref)
    _train_compare(dense, dense_ref)  # the same work, dense, for the bytes below
    stats = handle.stats()
    assert stats["recoded_bytes"] >= sum(p.numel() * 2 for n, p in model.named_parameters()
                                         if "experts" in n and p.dim() >= 2)
    if make is _wide_qwen3_moe:
        assert stats["h2d_bytes"] < h_dense.stats()["h2d_bytes"] * 0.85
    handle.detach()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(_bits(p), _bits(q)), n


def test_routed_lossless_trainable_experts_recode_between_steps(offload_sim):
    """Routed calls of trainable coded experts (16 experts, one token per call) copy the
    chosen experts' current pieces: after each optimizer step the pieces are re-coded
    (their offsets move) before the next routed copy, and the loss, the gradients and the
    next logits stay equal to the resident model's, bit for bit."""
    model = _many_experts(hidden_size=64, moe_intermediate_size=32, head_dim=32).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    handle = offload_sim(model, quantize={"*experts": "lossless"})
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    for step in range(3):
        token = torch.tensor([[3 + step]])
        loss, want = (m(input_ids=token, labels=token).logits.float().square().mean() for m in (model, ref))
        assert torch.equal(loss, want), step
        loss.backward(), want.backward()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), n
        for o in opts:
            o.step()
            o.zero_grad()
    stats = handle.stats()
    assert stats["routed_fetches"] >= 4 and stats["recoded_bytes"] > 0
    with torch.no_grad():
        assert torch.equal(model(input_ids=torch.tensor([[11]])).logits, ref(input_ids=torch.tensor([[11]])).logits)


def test_lossless_on_other_dtypes_of_experts_streams_them_dense_or_refuses(offload_sim):
    """An expert tensor the format cannot code (float64) streams dense with a warning
    that says why, and a dict that names it is an error."""
    model = _qwen3_moe().to(torch.float64)
    with pytest.warns(RuntimeWarning, match=r"cannot pack .*mlp.experts \("):
        offload_sim(model, quantize="lossless")
    with pytest.raises(LayerstreamError, match=r"cannot quantize layer 'model.layers.0.mlp.experts' to lossless"):
        offload_sim(_qwen3_moe().to(torch.float64), quantize={"*experts": "lossless"})


def test_lossless_expert_tensor_of_unaligned_experts_is_coded_whole(offload_sim):
    """An expert tensor whose experts decode to a size that is not a multiple of 16 bytes
    (down_proj [16, 28, 7] in bf16: 392 bytes each) is one coded piece, copied whole by a
    routed call, while gate_up_proj ([16, 14, 28]: 784 bytes) is coded per expert; the
    logits equal the resident model's bit for bit and detach() restores every tensor."""
    model = _qwen3_moe(hidden_size=28, moe_intermediate_size=7, num_experts=16).to(torch.bfloat16)
    model.config._experts_implementation = "eager"  # grouped_mm needs 16-byte strides
    model.requires_grad_(False)
    ref = copy.deepcopy(model)
    handle = offload_sim(model, quantize={"*experts": "lossless"})
    with torch.no_grad():
        for step in range(3):
            token = torch.tensor([[5 + step]])
            assert torch.equal(model(input_ids=token).logits, ref(input_ids=token).logits), f"step {step}"
    assert handle.stats()["routed_fetches"] >= 4
    handle.detach()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n


def test_routed_lossless_experts_under_training_recompute_exactly(offload_sim):
    """Training on a few tokens with frozen lossless-coded experts and everything else
    trainable: the forward and the backward's recompute each copy and decode only the
    routed experts' pieces; the loss and every gradient equal the resident model's."""
    model = _many_experts()
    for n, p in model.named_parameters():
        if ".experts." in n:
            p.requires_grad_(False)
    ref = copy.deepcopy(model)
    handle = offload_sim(model, quantize={"*experts": "lossless"})
    for step in range(3):
        ids = torch.tensor([[3 + step, 7]])
        loss, want = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
        assert torch.equal(loss, want), f"step {step}"
        loss.backward(), want.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), n
    assert handle.stats()["routed_fetches"] >= 2 * 2 * 2 and handle.stats()["quantized_layers"] == 2
