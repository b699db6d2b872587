"""Tied weights (one weight parameter of several modules, e.g. an lm_head sharing the
embedding's table, as in GPT-2, Gemma or tie_word_embeddings=True): the modules stream
together from one host copy when all of them stream, and stay resident together
otherwise. On the sim device every number is compared bit for bit with the resident
model; test_parity_layers.py runs the same model on CUDA."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from conftest import tiny_llama
from layerstream import LayerstreamError


class _TiedLM(nn.Module):
    """emb -> fc -> head, head.weight is emb.weight; `head_first` registers the head
    before the table (so the Linear is attached first and the table shares its copy)."""

    def __init__(self, vocab=40, d=12, head_first=False, frozen=False):
        super().__init__()
        if head_first:
            self.head = nn.Linear(d, vocab, bias=False)
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        if not head_first:
            self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.emb.weight.requires_grad_(not frozen)

    def forward(self, ids):
        return self.head(torch.relu(self.fc(self.emb(ids))))


def _ids(vocab=40, shape=(3, 5), seed=1):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _train_and_compare(model, ref, steps=3):
    """`steps` backward passes without zero_grad (the grads accumulate), then one SGD
    step: outputs, every .grad and the updated weights are bit-identical."""
    for i in range(steps):
        out, want = model(_ids(seed=i)), ref(_ids(seed=i))
        assert torch.equal(out, want), f"step {i}: outputs differ"
        out.square().mean().backward()
        want.square().mean().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"{n}: gradient differs"
    for m in (model, ref):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    assert torch.equal(model(_ids(seed=9)), ref(_ids(seed=9))), "after the optimizer step"


@pytest.mark.parametrize("head_first", [False, True], ids=["table-first", "head-first"])
def test_tied_table_and_head_stream_from_one_host_copy(offload_sim, recwarn, head_first):
    """Both modules stream (no warning); the host store holds the shared weight once;
    the trainable tied weight's gradient is the sum of both uses, as autograd's, in
    either registration order; detach() restores one tensor, still tied."""
    torch.manual_seed(0)
    model = _TiedLM(head_first=head_first)
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    assert sorted(handle.layers) == ["emb", "fc", "head"]
    assert not [w for w in recwarn if "layerstream" in str(w.message)]
    assert model.head.weight is model.emb.weight
    table = 40 * 12 * 4
    assert handle.stats()["pinned_bytes"] == table + (12 * 12 + 12) * 4  # the table once, fc
    _train_and_compare(model, ref)
    handle.detach()
    assert model.head.weight is model.emb.weight and model.emb.weight.device.type == "cpu"
    assert torch.equal(model.emb.weight, ref.emb.weight)
    assert torch.equal(model(_ids()), ref(_ids()))


def test_frozen_tied_weight_streams_and_gets_no_gradient(offload_sim):
    """The LoRA / inference case: a frozen tied weight streams; no gradient reaches it
    and no gradient crosses the bus for it."""
    torch.manual_seed(0)
    model = _TiedLM(frozen=True)
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    assert sorted(handle.layers) == ["emb", "fc", "head"]
    with torch.no_grad():
        assert torch.equal(model(_ids()), ref(_ids()))
    _train_and_compare(model, ref)
    assert model.emb.weight.grad is None


def test_hook_on_a_tied_weight_fires_once_with_the_summed_gradient(offload_sim):
    """A gradient hook on the shared weight sees what it sees on the resident model:
    one call per backward, with both uses' sum."""
    torch.manual_seed(0)
    model = _TiedLM()
    ref = copy.deepcopy(model)
    seen, seen_ref = [], []
    model.emb.weight.register_hook(lambda g: seen.append(g.clone()))
    ref.emb.weight.register_hook(lambda g: seen_ref.append(g.clone()))
    offload_sim(model)
    _train_and_compare(model, ref, steps=2)
    assert len(seen) == len(seen_ref) == 2
    assert all(torch.equal(a, b) for a, b in zip(seen, seen_ref))


def test_two_linears_sharing_a_weight_stream_together(offload_sim):
    """A weight shared by two Linear layers (with their own biases) streams for both
    from one host copy; its gradient sums both uses."""

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(0)
    model = Shared()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    assert handle.layers == ["a", "b"]
    assert handle.stats()["pinned_bytes"] == (64 + 8 + 8) * 4
    for i in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        out, want = model(x), ref(x)
        assert torch.equal(out, want)
        out.sum().backward()
        want.sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_tie_with_a_resident_module_keeps_both_resident(offload_sim):
    """When a module that stays resident (here excluded) shares the weight, the streamed
    candidate stays resident too, with a warning naming both; numbers unchanged."""
    torch.manual_seed(0)
    model = _TiedLM()
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match=r"1 layer\(s\) with tied weights stay resident .*"
                                            r"'head' \(weight shared with 'emb.weight'\)"):
        handle = offload_sim(model, exclude=["emb"])
    assert handle.layers == ["fc"]
    _train_and_compare(model, ref)


def test_shared_bias_keeps_the_layers_resident(offload_sim):
    class SharedBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 6)
            self.b = nn.Linear(6, 6)
            self.b.bias = self.a.bias

        def forward(self, x):
            return self.b(self.a(x))

    torch.manual_seed(0)
    model = SharedBias()
    with pytest.warns(RuntimeWarning, match=r"2 layer\(s\) with tied weights stay resident .*"
                                            r"'a' \(bias shared with 'b.bias'\); 'b' \(bias shared with 'a.bias'\)"):
        with pytest.raises(LayerstreamError, match="found no Linear"):
            offload_sim(model)


def test_planner_keeping_the_head_resident_keeps_its_table_resident(offload_sim):
    """With a budget that keeps the (largest) tied head resident, the table that shares
    its weight stays resident too (one tensor, on the device once); the numbers and the
    resident bytes agree."""

    class Deep(_TiedLM):
        def __init__(self):
            super().__init__(vocab=400, d=16)
            self.mid = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])

        def forward(self, ids):
            return self.head(self.mid(torch.relu(self.fc(self.emb(ids)))))

    torch.manual_seed(0)
    model = Deep()
    ref = copy.deepcopy(model)
    head = 400 * 16 * 4
    # Room for the head resident and a few small slots, not for slots the head's size.
    handle = offload_sim(model, budget=head + 4096, prefetch=1)
    assert "head" not in handle.layers and "emb" not in handle.layers
    assert len(handle.layers) >= 2  # some of the small layers stream
    assert model.emb.weight is model.head.weight
    assert handle.stats()["resident_bytes"] <= head + 4096 - 2 * handle.stats()["slot_bytes"]
    _train_and_compare(model, ref)


def test_quantize_does_not_apply_to_a_tied_layer(offload_sim):
    """quantize= packs the other layers; the tied head streams unquantized, with a
    warning naming it (its host copy is the table, read dense by the lookups)."""
    torch.manual_seed(0)
    model = _TiedLM(frozen=True, d=64)
    model.fc.requires_grad_(False)
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match=r"quantize='int8' does not apply to 1 layer\(s\) with tied "
                                            r"weights .*: 'head'"):
        handle = offload_sim(model, quantize="int8")
    assert sorted(handle.layers) == ["emb", "fc", "head"]
    assert handle.stats()["quantized_layers"] == 1
    assert model.head.weight is model.emb.weight and model.emb.weight.device.type == "cpu"
    with torch.no_grad():
        ids = _ids()
        # Only fc is quantized: the head's logits from fc's (quantized) output are exact.
        h = torch.relu(model.fc(model.emb(ids)))
        assert torch.equal(model.head(h), ref.head(h))
        torch.testing.assert_close(model(ids), ref(ids), rtol=0.05, atol=0.05)


def test_plan_names_the_table_a_head_shares(offload_sim):
    """handle.plan's table line names the streamed layer that shares the table."""

    class Wide(_TiedLM):  # blocks larger than the head, so that the head streams
        def __init__(self):
            super().__init__()
            self.fc = nn.Sequential(*[nn.Linear(12, 400) if i % 2 == 0 else nn.Linear(400, 12)
                                      for i in range(6)])

    torch.manual_seed(0)
    slot = 400 * 12 * 4 + 1792  # fc.0: weight + bias (256-byte aligned)
    handle = offload_sim(Wide(), budget=3 * slot)  # the slots, nothing left to keep resident
    assert "emb" in handle.layers and "head" in handle.layers, handle.plan
    assert "emb (weight shared with head: its bytes are in the host RAM line above)" in handle.plan
    # The table's bytes are not counted a second time.
    assert "embedding tables:         1 looked up in host memory (pinned unless pinning failed), 0.00 MiB more" \
        in handle.plan


def test_hf_tied_lm_with_lora_streams_the_tied_head(offload_sim):
    """A Llama with tie_word_embeddings=True and a LoRA adapter: embed_tokens and
    lm_head stream from one host copy (frozen), the adapter trains exactly as on the
    resident model."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(96, tie_word_embeddings=True)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    names = handle.layers
    assert any(n.endswith("embed_tokens") for n in names) and any(n.endswith("lm_head") for n in names)
    inner = model.base_model.model
    assert inner.lm_head.weight is inner.model.embed_tokens.weight
    table = 96 * 32 * 4
    assert handle.stats()["pinned_bytes"] < 2 * table + sum(
        p.numel() * 4 for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    opt_r = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for i in range(2):
        ids = _ids(vocab=96, shape=(2, 9), seed=i)
        loss, loss_r = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
        assert torch.equal(loss, loss_r), f"step {i}"
        loss.backward(), loss_r.backward()
        opt.step(), opt_r.step()
        opt.zero_grad(), opt_r.zero_grad()


@pytest.mark.parametrize("arch", ["gemma", "gemma2"])
def test_hf_gemma_scaled_tied_embedding_streams_and_trains_exactly(offload_sim, recwarn, arch):
    """Gemma: a scaled word embedding (an nn.Embedding subclass calling super().forward)
    tied to lm_head. Both stream from one host copy, no warning; a full fine-tuning step
    with AdamW gives the resident model's loss, gradients and weights bit for bit."""
    import transformers

    cfg_cls = {"gemma": transformers.GemmaConfig, "gemma2": transformers.Gemma2Config}[arch]
    lm_cls = {"gemma": transformers.GemmaForCausalLM, "gemma2": transformers.Gemma2ForCausalLM}[arch]
    cfg = cfg_cls(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  max_position_embeddings=64, tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = lm_cls(cfg)
    assert type(model.model.embed_tokens).forward is not nn.Embedding.forward  # the scaled subclass
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    assert not [w for w in recwarn if "layerstream" in str(w.message)]
    assert "model.embed_tokens" in handle.layers and "lm_head" in handle.layers
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for i in range(2):
        ids = _ids(vocab=80, shape=(2, 7), seed=i)
        loss, loss_r = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
        assert torch.equal(loss, loss_r), f"step {i}"
        loss.backward(), loss_r.backward()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert torch.equal(p.grad, q.grad), f"step {i}: {n}"
        opt.step(), opt_r.step()
        opt.zero_grad(), opt_r.zero_grad()
    with torch.no_grad():
        assert torch.equal(model(input_ids=_ids(vocab=80)).logits, ref(input_ids=_ids(vocab=80)).logits)


def test_hf_t5_four_way_tie_trains_exactly(offload_sim, recwarn):
    """T5 (v1.0): `shared`, the encoder's and the decoder's embed_tokens and lm_head are four
    modules with one weight. All four stream from one host copy; the weight's gradient sums
    three lookups and the head through autograd, in autograd's order: bit-identical over
    two accumulating backwards, and greedy generation gives the same tokens."""
    import transformers

    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2,
                                tie_word_embeddings=True, decoder_start_token_id=0, pad_token_id=0,
                                eos_token_id=1, dropout_rate=0.0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg)
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    assert not [w for w in recwarn if "layerstream" in str(w.message)]
    tied = ["shared", "encoder.embed_tokens", "decoder.embed_tokens", "lm_head"]
    assert [n for n in handle.layers if n in tied] == tied
    # One host copy: what is pinned is at most every (distinct) parameter once.
    assert handle.stats()["pinned_bytes"] <= sum(p.numel() * 4 for p in model.parameters())
    ids, labels = _ids(vocab=64, shape=(2, 7)), _ids(vocab=64, shape=(2, 5), seed=2)
    for i in range(2):
        loss, loss_r = model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss
        assert torch.equal(loss, loss_r), f"step {i}"
        loss.backward(), loss_r.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False),
                       ref.generate(ids, max_new_tokens=5, do_sample=False))


def test_tie_partner_of_a_resident_layer_stays_resident(offload_sim):
    """A head whose bias is shared stays resident; the table it shares its weight with
    must then stay resident too (streaming it would move the head's weight to the host)."""

    class Twisted(_TiedLM):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(12, 40)
            self.head.weight = self.emb.weight
            self.other = nn.Linear(12, 40)
            self.other.bias = self.head.bias

        def forward(self, ids):
            h = torch.relu(self.fc(self.emb(ids)))
            return self.head(h) + self.other(h)

    torch.manual_seed(0)
    model = Twisted()
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match=r"tied weights stay resident .*'emb' \(weight shared with 'head.weight'\)"):
        handle = offload_sim(model)
    assert handle.layers == ["fc"]
    assert model.emb.weight.data_ptr() == model.head.weight.data_ptr()
    _train_and_compare(model, ref)


def test_a_tie_inside_one_group_says_so(offload_sim):
    """groups=["0"] naming a module whose two Linears share a weight (b.weight = a.weight in
    it) kept it resident with the reason "another module that stays resident, or a bias,
    shares the tensor", true of neither. The warning now says the tie is inside the group and
    how to stream it (leave it out of groups=), which, followed, streams the two Linears
    from one host copy, bit for bit."""

    class Tied(nn.Module):
        def __init__(self, d=6):
            super().__init__()
            self.a = nn.Linear(d, d)
            self.b = nn.Linear(d, d)
            self.b.weight = self.a.weight
            self.scale = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return self.b(torch.relu(self.a(x))) * self.scale

    torch.manual_seed(0)
    model = nn.Sequential(Tied(), nn.Linear(6, 6))
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning) as caught:
        handle = offload_sim(model, groups=["0"])
    said = [str(w.message) for w in caught if "tied" in str(w.message)]
    assert len(said) == 1 and "1 tensor group(s) with a weight tied inside them stay resident" in said[0], said
    assert "a tensor held twice inside one group" in said[0] and "leave the group out of groups=" in said[0]
    assert "'0' (a.weight shared with '0.b.weight'" in said[0] and "stays resident, or a bias" not in said[0]
    assert handle.layers == ["1"]
    handle.detach()
    handle = offload_sim(model)
    assert handle.layers == ["0.a", "0.b", "1"] and model[0].a.weight is model[0].b.weight
    x = torch.randn(3, 6)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
