"""nn.MultiheadAttention streams as a tensor group: its forward reads the projection
weights directly (in_proj_weight, or q/k/v_proj_weight, and out_proj.weight) instead of
calling Linear layers, so its tensors and its out_proj's share one slot and its own
forward runs on the fetched views (and again in backward when a gradient is needed). On
the sim device every number is compared bit for bit with the resident module."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from layerstream import LayerstreamError

VARIANTS = {
    "default": dict(),
    "batch-first": dict(batch_first=True),
    "kdim-vdim": dict(kdim=12, vdim=10),
    "bias-kv-zero-attn": dict(add_bias_kv=True, add_zero_attn=True),
    "no-bias": dict(bias=False),
    "dropout": dict(dropout=0.25),
}


def _inputs(kw, L=5, N=3, E=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (N, L) if kw.get("batch_first") else (L, N)
    return (torch.randn(*shape, E, generator=g), torch.randn(*shape, kw.get("kdim", E), generator=g),
            torch.randn(*shape, kw.get("vdim", E), generator=g))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_attention_streams_as_one_group_and_trains_exactly(offload_sim, variant):
    """Every layout of nn.MultiheadAttention: one streamed layer holding its tensors and its
    out_proj's; outputs, attention weights, input and weight gradients (dropout's masks
    too: the recompute restores the RNG) bit-identical to the resident module, with and
    without need_weights, with masks; inference (the fused fast path) too; detach()
    restores everything."""
    kw = VARIANTS[variant]
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 2, **kw)
    ref = copy.deepcopy(m)
    handle = offload_sim(m)
    assert handle.layers == [""] and handle.stats()["group_layers"] == 1
    assert m.out_proj.weight.device.type == "cpu" and hasattr(m.out_proj.weight, "_is_memory_managed")
    q, k, v = _inputs(kw)
    mask = torch.zeros(q.shape[0 if not kw.get("batch_first") else 1], k.shape[0 if not kw.get("batch_first") else 1],
                       dtype=torch.bool)
    mask[0, -1] = True
    for step, need in enumerate((True, False, True)):
        q1, q2 = q.clone().requires_grad_(), q.clone().requires_grad_()
        extra = dict(attn_mask=mask) if step == 2 else {}
        torch.manual_seed(step)
        out, w = m(q1, k, v, need_weights=need, **extra)
        torch.manual_seed(step)
        want, want_w = ref(q2, k, v, need_weights=need, **extra)
        assert torch.equal(out, want) and (w is None) == (want_w is None)
        if w is not None:
            assert torch.equal(w, want_w)
        out.square().sum().backward()
        want.square().sum().backward()
        assert torch.equal(q1.grad, q2.grad)
    for (n, p), (_, r) in zip(m.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, r.grad), n
    m.eval(), ref.eval()
    with torch.no_grad():  # eval + no_grad: torch's fused attention path, where it applies
        assert torch.equal(m(q, k, v)[0], ref(q, k, v)[0])
    handle.detach()
    assert "forward" not in m.__dict__ and "_apply" not in m.out_proj.__dict__
    assert not hasattr(m.out_proj.weight, "_is_memory_managed")
    for (n, p), (_, r) in zip(m.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, r), n


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return self.fc(self.attn(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_quantized_attention_streams_packed(offload_sim, fmt):
    """quantize= packs the attention's projections, out_proj's too (stand-ins on both
    modules). Every output is checked against an independent reference (quant_ref.py, the
    format's spec in torch): the model resident with each packed tensor replaced by its
    reference dequantization, bit for bit; so are the values detach() restores.
    load_state_dict() re-quantizes both (the loaded values' reference), and converting
    the out_proj alone is refused."""
    from quant_ref import assert_reference_values, packed_names, with_reference_values

    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block()).requires_grad_(False)
    other = nn.Sequential(_Block(), _Block())
    original = copy.deepcopy(model)
    handle = offload_sim(model, quantize=fmt)
    attn = model[0].attn
    assert attn.in_proj_weight.is_meta and type(attn.out_proj.weight).__name__ == "_PackedWeight"
    assert sorted(handle.layers) == ["0.attn", "0.fc", "1.attn", "1.fc"]
    packed = packed_names(model)
    assert sorted(packed) == sorted(f"{i}.{n}" for i in (0, 1)
                                    for n in ("attn.in_proj_weight", "attn.out_proj.weight", "fc.weight"))
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        got = model(x)
        assert torch.equal(got, with_reference_values(original, fmt, packed)(x))
    with pytest.raises(LayerstreamError, match=r"'0.attn.out_proj' keeps its weights in host memory"):
        attn.out_proj.half()
    result = model.load_state_dict(other.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    # frozen like `model` (nn.MultiheadAttention picks its path by requires_grad)
    loaded_ref = with_reference_values(other, fmt, packed).requires_grad_(False)
    with torch.no_grad():
        loaded = model(x)
        assert torch.equal(loaded, loaded_ref(x))  # the loaded values, re-quantized
    handle.detach()
    restored, want = dict(model.named_parameters()), dict(other.named_parameters())
    for n in packed:
        assert_reference_values(fmt, want[n], restored[n], n)
    with torch.no_grad():
        assert torch.equal(model(x), loaded)
    assert not torch.equal(got, loaded)


def test_attention_errors_and_ties(offload_sim, recwarn):
    """A replaced out_proj weight is a clear error at the next call; an attention whose
    out_proj weight another module shares stays resident (the tied-weights warning); a
    subclass with its own forward stays resident as before."""
    torch.manual_seed(0)
    model = _Block()
    offload_sim(model)
    model.attn.out_proj.weight = nn.Parameter(torch.randn(32, 32))
    with pytest.raises(LayerstreamError, match="were replaced after offload"):
        model(torch.randn(2, 5, 32))
    tied = nn.Sequential(_Block(), nn.Linear(32, 32))
    tied[0].fc.weight = tied[0].attn.out_proj.weight
    with pytest.warns(RuntimeWarning, match=r"tied weights stay resident .*'0.attn' \(out_proj.weight shared"):
        handle = offload_sim(tied)
    assert handle.layers == ["1"]

    class Custom(nn.MultiheadAttention):
        def forward(self, *a, **k):
            return super().forward(*a, **k)

    block = _Block()
    block.attn = Custom(32, 4, batch_first=True)
    handle = offload_sim(block)
    assert handle.layers == ["fc"]


@pytest.mark.parametrize("nested", [False, True])
def test_transformer_encoder_inference_streams_instead_of_its_fused_path(offload_sim, nested):
    """nn.TransformerEncoderLayer's fused inference path (eval, no gradient) reads the
    weights of its attention and linears itself, which would bypass streaming (on a GPU,
    with host weights: a device mismatch). offload() turns it off on layers that stream:
    the layers are fetched, and the output equals the resident model's unfused path bit
    for bit (and the fused one to rounding); detach() turns it back on."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval()
    ref = copy.deepcopy(enc)
    handle = offload_sim(enc)
    assert handle.layers == [f"layers.{i}.{n}" for i in range(2) for n in ("self_attn", "linear1", "linear2")]
    x = torch.randn(2, 5, 32)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, -2:] = True
    with torch.no_grad():
        fused = ref(x, src_key_padding_mask=pad)
        before = handle.stats()["acquires"]
        got = enc(x, src_key_padding_mask=pad)
        assert handle.stats()["acquires"] - before == 6  # every streamed layer was fetched
        for m in ref.layers:
            m.activation_relu_or_gelu = 0
        want = ref(x, src_key_padding_mask=pad)
    got, want, fused = (t.to_padded_tensor(0.0) if t.is_nested else t for t in (got, want, fused))
    assert torch.equal(got, want)
    torch.testing.assert_close(got, fused, rtol=1e-5, atol=1e-5)
    handle.detach()
    assert all(m.activation_relu_or_gelu == 1 for m in enc.layers)


def test_an_encoder_layer_in_eval_equals_its_fused_path_to_rounding_as_the_design_note_says(offload_sim):
    """torch-glue.md said of nn.TransformerEncoderLayer, whose fused inference path offload()
    turns off: "Tested bit for bit ... masks". A layer called alone in eval with
    src_key_padding_mask equals the resident layer's unfused path bit for bit, and its fused
    kernel only to rounding (3.6e-7 here on some CPUs); the note now says so."""
    from pathlib import Path

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    ref = copy.deepcopy(layer)
    offload_sim(layer)
    x = torch.randn(2, 5, 32)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        got, fused = layer(x, src_key_padding_mask=pad), ref(x, src_key_padding_mask=pad)
        ref.activation_relu_or_gelu = 0
        assert torch.equal(got, ref(x, src_key_padding_mask=pad))
    torch.testing.assert_close(got, fused, rtol=0, atol=1e-6)
    note = (Path(__file__).resolve().parents[2] / "docs" / "design" / "torch-glue.md").read_text()
    said = " ".join(note.split("(`_no_fused_encoder_path`).")[1].split("Otherwise tested bit for bit")[0].split())
    assert "unfused path bit for bit and its fused kernel only to rounding" in said, said[:300]


@pytest.mark.parametrize("backward_in_autocast", [False, True], ids=["backward-outside", "backward-inside"])
def test_transformer_encoder_trains_under_autocast_exactly(offload_sim, backward_in_autocast):
    """nn.TransformerEncoder (dropout on) trained under CPU bf16 autocast with
    compute_dtype=bf16: outputs and every gradient equal the resident model's bit for bit.
    Before, the attention's backward recompute differentiated inside the forward's
    restored autocast state, so its backward ops were autocast too: in_proj_weight's
    gradient was 3.7e-3 relative off. The backward's ops run in the caller's autocast
    state, as the resident backward's do (also when backward is called inside autocast)."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2)
    ref = copy.deepcopy(model)
    handle = offload_sim(model, compute_dtype=torch.bfloat16)
    assert handle.stats()["group_layers"] == 2
    x = torch.randn(4, 10, 64)
    outs = []
    for m in (ref, model):
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
            if backward_in_autocast:
                y.float().square().mean().backward()
        if not backward_in_autocast:
            y.float().square().mean().backward()
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert torch.equal(p.grad, q.grad), f"{n}: gradient differs from the resident model's"


class _SelfAttentionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.att = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        def block(h):
            return h + self.att(h, h, h, need_weights=False)[0]
        return torch.utils.checkpoint.checkpoint(block, self.pre(x), use_reentrant=False)


def test_self_attention_under_non_reentrant_checkpoint_trains_exactly(offload_sim):
    """Non-reentrant torch.utils.checkpoint around a streamed self-attention (query is
    key is value): every gradient equals the resident model's bit for bit. Before, the
    group saved its input once per position and the checkpoint's unpack made each its
    own tensor, so the backward's recompute saw query is not key and took
    nn.MultiheadAttention's separate-projection path: pre's and in_proj_bias's gradients
    were a few ulps off."""
    torch.manual_seed(0)
    model = _SelfAttentionBlock()
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(3, 5, 16)
    for step in range(2):
        y, want = model(x), ref(x)
        assert torch.equal(y, want)
        y.square().sum().backward()
        want.square().sum().backward()
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert torch.equal(p.grad, q.grad), f"{n}: gradient differs from the resident model's"


class _InPlaceResidual(nn.Module):
    """`h += attention(h, h, h)`: its input written in place after the call."""

    def __init__(self, inplace=True):
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.att = nn.MultiheadAttention(16, 2, batch_first=True)
        self.inplace = inplace

    def forward(self, x):
        h = self.pre(x)
        a = self.att(h, h, h, need_weights=False)[0]
        if self.inplace:
            h += a
        else:
            h = h + a
        return h


def test_an_attention_input_written_in_place_before_backward_is_refused_saying_why(offload_sim):
    """`h += attention(h, h, h)`: the resident batch_first attention saves no view of h, so
    its backward works; the streamed one recomputes its forward from its saved inputs in
    backward, and autograd's version check refuses. The error said that autograd raises
    the same for a resident module, which is false here; it says why the streamed group
    needs its inputs and what to write instead, and `h = h + a` trains as resident."""
    torch.manual_seed(0)
    model = _InPlaceResidual()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    x = torch.randn(3, 5, 16)
    ref(x).square().sum().backward()  # the resident model trains
    with pytest.raises(LayerstreamError, match=r"streamed layer 'att': a tensor its backward needs \(an input or a "
                                               r"parameter\) was modified in place.*runs its forward again in "
                                               r"backward.*write `h = h \+ a` instead of `h \+= a`"):
        model(x).square().sum().backward()
    handle.detach()
    model.inplace = ref.inplace = False
    model.zero_grad()
    ref.zero_grad()
    offload_sim(model)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


class _AttendTwice(nn.Module):
    """One attention module called twice in a forward (weights shared across steps)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.att = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        h = self.att(x, x, x, need_weights=False)[0]
        return self.fc(self.att(h, h, h, need_weights=False)[0])


def test_an_exported_attention_called_twice_gets_both_calls_gradients(offload_sim):
    """Non-strict torch.export swaps the modules' parameters for the program's PARAMETER
    inputs while it traces. The group's fake kernel put offload()'s tensors back after its
    trial instead of what the module held, so the second call read those and export lifted
    them as constants: the exported program's attention gradients lacked the second call's
    part (off by 0.3-0.9). Now both calls take the PARAMETER inputs and every gradient
    equals the resident model's (within fp32 rounding: another graph)."""
    model = _AttendTwice()
    ref = copy.deepcopy(model)
    offload_sim(model)
    held = dict(model.named_parameters())
    x = torch.randn(2, 5, 16)
    ep = torch.export.export(model, (x,), strict=False)
    assert not [s for s in ep.graph_signature.input_specs if s.kind.name == "CONSTANT_TENSOR"]
    assert all(p is held[n] for n, p in model.named_parameters())  # offload()'s, after the export
    ep.module()(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=n)


def test_training_steps_with_a_streamed_attention_leave_no_graph_behind(offload_sim):
    """Each training step's autograd graphs are freed with it. Before, the group's forward
    without a graph saved its tensors through a pack hook that returned them as they were:
    attention's kernel saves its own output, which with its grad_fn closed a reference
    cycle through autograd's C++ nodes that Python's collector does not see, so every
    call's graph (its activations, its weights' casts) stayed in memory: 3 graphs a step
    here, 30 MiB a step for 4 layers of width 512."""
    import gc

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.MultiheadAttention(16, 2, batch_first=True) for _ in range(3)])
    offload_sim(model)

    def step():
        x = torch.randn(2, 5, 16)
        for attention in model:
            x = attention(x, x, x, need_weights=False)[0]
        x.sum().backward()

    def recorded():
        gc.collect()
        return sum(1 for t in gc.get_objects() if issubclass(type(t), torch.Tensor) and t.grad_fn is not None)

    step()
    before = recorded()
    for _ in range(3):
        step()
    # At most as many: a tensor another test of this process left may go meanwhile.
    assert recorded() <= before, "tensors of earlier steps' graphs are still alive"
