"""Streamed embedding tables (nn.Embedding looked up in host memory): which tables
stream, what the budget counts, and the errors around them. The numbers (exactness
on sim and CUDA, pinned and pageable tables, trainable tables' gradients) are in
test_parity_layers.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from layerstream import LayerstreamError


class _LM(nn.Module):
    def __init__(self, vocab=500, d=32, frozen=True, out=None, **emb_kw):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, **emb_kw)
        self.emb.weight.requires_grad_(not frozen)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, out or vocab)

    def forward(self, ids):
        return self.head(torch.relu(self.fc(self.emb(ids))))


def _ids(vocab=500, shape=(2, 6)):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("frozen,exclude", [(True, None), (False, None), (True, ["emb"])],
                         ids=["frozen", "trainable", "excluded"])
def test_tables_stream_frozen_or_trainable(offload_sim, recwarn, frozen, exclude):
    """Frozen and trainable tables stream (looked up in host memory: counted in
    embedding_layers and gathered_bytes); exclude= keeps one resident. Each computes what
    the resident model computes, bit for bit, and a trainable table's gradient (computed
    on the host) equals the resident table's."""
    torch.manual_seed(0)
    model = _LM(frozen=frozen)
    ref = copy.deepcopy(model)
    handle = offload_sim(model, exclude=exclude)
    streams_table = exclude is None
    assert handle.layers == (["emb", "fc", "head"] if streams_table else ["fc", "head"])
    ids = _ids()
    out, want = model(ids), ref(ids)
    assert torch.equal(out, want)
    stats = handle.stats()
    assert stats["embedding_layers"] == int(streams_table)
    # a lookup reads only the rows its ids name: 12 ids of 32 fp32 values
    assert stats["gathered_bytes"] == (ids.numel() * 32 * 4 if streams_table else 0)
    out.square().sum().backward()
    want.square().sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None) == (n == "emb.weight" and frozen), n
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad), n
    assert not [w for w in recwarn if "layerstream" in str(w.message)]


def test_table_with_max_norm_stays_resident(offload_sim):
    """max_norm renormalizes the rows a lookup reads, in place: such a table stays
    resident, with one warning, and computes as before."""
    torch.manual_seed(0)
    model = _LM(max_norm=1.0)
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match=r"1 embedding layer\(s\) with max_norm stay resident .*'emb'"):
        handle = offload_sim(model)
    assert handle.layers == ["fc", "head"]
    ids = _ids()
    torch.testing.assert_close(model(ids), ref(ids), rtol=0, atol=0)
    torch.testing.assert_close(model.emb.weight, ref.emb.weight, rtol=0, atol=0)  # renormed alike


class _Scaled(nn.Embedding):
    """Like transformers' *ScaledWordEmbedding (Gemma, Bart, M2M100, ...)."""

    def __init__(self, *args, embed_scale=3.0, **kw):
        super().__init__(*args, **kw)
        self.embed_scale = nn.Buffer(torch.tensor(embed_scale), persistent=False)

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


class _ScaledTwice(_Scaled):  # a second level of super() calls
    def forward(self, input_ids):
        return super().forward(input_ids) + 1.0


@pytest.mark.parametrize("cls", [_Scaled, _ScaledTwice])
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
def test_embedding_subclass_that_looks_up_through_super_streams(offload_sim, recwarn, cls, frozen):
    """A subclass whose forward calls super().forward (the scaled word embeddings of
    Gemma, Bart, ...) streams with its own forward kept: the lookup reads the host
    table and the scale applies to its result. Numbers and the table's gradient are
    bit-identical; the module is still an instance of its class; detach() restores
    the class; copying is refused with the usual message."""
    torch.manual_seed(0)
    model = _LM()
    model.emb = cls(500, 32, padding_idx=0)
    model.emb.weight.requires_grad_(not frozen)
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    assert not [w for w in recwarn if "layerstream" in str(w.message)]
    assert handle.layers == ["emb", "fc", "head"]
    assert isinstance(model.emb, cls) and type(model.emb).__name__ == cls.__name__
    assert model.emb.weight.device.type == "cpu" and handle.stats()["embedding_layers"] == 1
    for i in range(2):
        out, want = model(_ids()), ref(_ids())
        assert torch.equal(out, want)
        out.square().mean().backward()
        want.square().mean().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), n
    assert handle.stats()["gathered_bytes"] == 2 * 12 * 32 * 4
    with pytest.raises(LayerstreamError, match="cannot be deep-copied"):
        copy.deepcopy(model)
    handle.detach()
    assert type(model.emb) is cls and "_layerstream_lookup" not in model.emb.__dict__
    assert torch.equal(model(_ids()), ref(_ids()))


def test_embedding_subclass_with_its_own_lookup_stays_resident(offload_sim):
    """A subclass whose forward does its own lookup (no super().forward) would read the
    weight directly: it stays resident, with a warning, and computes as before."""

    class Own(nn.Embedding):
        def forward(self, ids):
            return nn.functional.embedding(ids, self.weight) * 3.0

    torch.manual_seed(0)
    model = _LM()
    model.emb = Own(500, 32)
    model.emb.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match=r"subclass layer\(s\) with their own forward.*'emb' \(.*Own\)"):
        handle = offload_sim(model)
    assert "emb" not in handle.layers
    ids = _ids()
    assert torch.equal(model(ids), ref(ids))


def test_budget_does_not_count_a_streamed_table(offload_sim):
    """The table lives in host memory: a budget far below its size holds the model, and
    the device bytes exclude it; kept resident (exclude=), it must fit in the budget."""
    torch.manual_seed(0)
    table_bytes = 50000 * 32 * 4  # 6.4 MB
    model = _LM(vocab=50000, out=10)
    ref = copy.deepcopy(model)
    budget = 2**20  # 1 MiB
    with pytest.raises(LayerstreamError, match="cannot even hold the always-resident"):
        offload_sim(copy.deepcopy(model), budget=budget, exclude=["emb"])
    handle = offload_sim(model, budget=budget)
    assert "emb" in handle.layers
    ids = _ids(50000)
    assert torch.equal(model(ids), ref(ids))
    assert "embedding tables:         1 looked up in host memory" in handle.plan
    assert "6.10 MiB more, no device memory: emb" in handle.plan
    stats = handle.stats()
    assert stats["peak_device_bytes"] <= budget < table_bytes
    assert stats["gathered_bytes"] == ids.numel() * 32 * 4


def test_writes_to_the_table_reach_the_next_lookup(offload_sim):
    """The parameter's data is the host table: load_state_dict() and in-place copies
    change what the next lookup returns; detach() keeps them."""
    torch.manual_seed(0)
    model = _LM()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    ids = _ids()
    new = torch.randn(500, 32)
    model.load_state_dict({**model.state_dict(), "emb.weight": new})
    ref.load_state_dict({**ref.state_dict(), "emb.weight": new})
    assert torch.equal(model(ids), ref(ids))
    with torch.no_grad():
        model.emb.weight[3].fill_(7.0)
        ref.emb.weight[3].fill_(7.0)
    assert torch.equal(model.emb(torch.tensor([3])), torch.full((1, 32), 7.0))
    handle.detach()
    assert torch.equal(model.emb.weight, ref.emb.weight)


def test_table_made_trainable_after_offload_trains(offload_sim):
    """requires_grad_(True) on a streamed frozen table after offload(): the next lookup
    builds the gradient (as a resident table's would), and gradient hooks fire; made
    frozen again, it gets none."""
    torch.manual_seed(0)
    model = _LM()
    ref = copy.deepcopy(model)
    offload_sim(model)
    for m in (model, ref):
        m.emb.weight.requires_grad_(True)
    seen = []
    model.emb.weight.register_hook(lambda g: seen.append(g.shape))
    ids = _ids()
    model(ids).sum().backward()
    ref(ids).sum().backward()
    assert seen == [torch.Size([500, 32])]
    assert torch.equal(model.emb.weight.grad, ref.emb.weight.grad)
    model.emb.weight.requires_grad_(False)
    model.emb.weight.grad = None
    model(ids).sum().backward()
    assert model.emb.weight.grad is None


def test_bad_ids_are_clear_errors(offload_sim):
    torch.manual_seed(0)
    model = _LM()
    ref = copy.deepcopy(model)
    offload_sim(model)
    with pytest.raises(LayerstreamError, match=r"embedding layer 'emb' got float32 ids; they must be int64 or int32"):
        model(torch.zeros(2, 3))
    with pytest.raises(LayerstreamError, match=r"its ids are on meta; move them to cpu"):
        model(torch.zeros(2, 3, dtype=torch.long, device="meta"))
    # Out of range: the same error as the resident table's lookup.
    with pytest.raises(IndexError, match="index out of range") as want:
        ref(torch.tensor([[500]]))
    with pytest.raises(IndexError, match="index out of range") as got:
        model(torch.tensor([[500]]))
    assert str(want.value).splitlines()[0] == str(got.value).splitlines()[0]


def test_model_of_only_a_table(offload_sim):
    """A model whose only streamable layer is a frozen table can be offloaded."""
    torch.manual_seed(0)
    emb = nn.Embedding(100, 8).requires_grad_(False)
    ref = copy.deepcopy(emb)
    handle = offload_sim(emb, budget="1KiB")
    assert handle.layers == [""]
    ids = _ids(100)
    assert torch.equal(emb(ids), ref(ids))
    assert handle.stats()["peak_device_bytes"] == 0


def test_moving_and_converting_a_model_with_a_streamed_table(offload_sim):
    """model.to(<compute device>) leaves the table in host memory; a dtype change is
    refused before anything changes (as for streamed Linear layers)."""
    torch.manual_seed(0)
    model = _LM()
    ref = copy.deepcopy(model)
    offload_sim(model)
    model.to("cpu")
    assert torch.equal(model(_ids()), ref(_ids()))
    with pytest.raises(LayerstreamError, match=r"streamed layer 'emb' keeps its weights in host memory"):
        model.half()
    assert model.fc.weight.dtype == torch.float32 and model.emb.weight.dtype == torch.float32


def test_double_backward_through_a_trainable_table_is_an_error(offload_sim):
    torch.manual_seed(0)
    model = _LM(frozen=False)
    offload_sim(model, exclude=["fc", "head"])
    loss = model(_ids()).square().sum()
    with pytest.raises(RuntimeError, match=r"layer .emb.: backward with create_graph=True"):
        loss.backward(create_graph=True)


def test_quantizing_a_table_by_name_warns_that_tables_are_not_quantized(offload_sim, recwarn):
    """quantize= packs Linear/conv weights; a table named explicitly for a format gets a
    warning (it streams as it is); a wildcard that also covers it does not warn."""
    torch.manual_seed(0)
    model = _LM()
    ref = copy.deepcopy(model)
    model.fc.requires_grad_(False)
    with pytest.warns(RuntimeWarning, match=r"quantize= names embedding table\(s\) 'emb', but tables are "
                                            r"not quantized"):
        handle = offload_sim(model, quantize={"emb": "int8", "fc": "int8"})
    assert handle.stats()["quantized_layers"] == 1
    ids = _ids()
    assert torch.equal(model.emb(ids), ref.emb(ids))
    recwarn.clear()
    offload_sim(_LM().requires_grad_(False), quantize={"*": "int8"})
    assert not [w for w in recwarn if "embedding table" in str(w.message)]
