"""offload(groups=...): any module streamed whole as a tensor group (opt-in, for layers
whose forward reads weights directly): every parameter of it and of its descendants in
one slot, its own forward on the fetched tensors, recomputed in backward. Bit for bit
against the resident model on the sim device."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from layerstream import LayerstreamError


class Custom(nn.Module):
    """Reads its weight directly (no Linear to swap) and calls a child Linear."""

    def __init__(self, d=16, p=0.0):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.b = nn.Parameter(torch.zeros(d))
        self.inner = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.inner(self.drop(torch.tanh(x @ self.w.t() + self.b)))


def _model(p=0.0):
    torch.manual_seed(0)
    return nn.Sequential(Custom(p=p), nn.Linear(16, 16), Custom(p=p))


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["plain", "dropout"])
def test_named_modules_stream_whole_and_train_exactly(offload_sim, p):
    """groups=["0", "2"]: each custom module (its parameters and its child Linear's) is one
    streamed layer, the child no layer of its own; two accumulating backwards (dropout's
    masks reproduced by the recompute), an optimizer step and the next forward match the
    resident model bit for bit; model.to() on the compute device is fine, a dtype change
    of a child refused; detach() restores everything."""
    model, ref = _model(p), None
    ref = copy.deepcopy(model)
    handle = offload_sim(model, groups=["0", "2"])
    assert handle.layers == ["0", "1", "2"] and handle.stats()["group_layers"] == 2
    assert model[0].inner.weight.device.type == "cpu" and hasattr(model[0].inner.weight, "_is_memory_managed")
    model.to("cpu")
    with pytest.raises(LayerstreamError, match=r"'0.inner' keeps its weights in host memory"):
        model[0].inner.half()
    for step in range(2):
        x = torch.randn(4, 16)
        torch.manual_seed(step)
        y = model(x)
        torch.manual_seed(step)
        want = ref(x)
        assert torch.equal(y, want)
        y.square().sum().backward()
        want.square().sum().backward()
    for (n, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(a.grad, b.grad), n
    for m in (model, ref):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    model.eval(), ref.eval()
    with torch.no_grad():
        x = torch.randn(4, 16)
        assert torch.equal(model(x), ref(x))
    handle.detach()
    assert "_apply" not in model[0].inner.__dict__ and not hasattr(model[0].w, "_is_memory_managed")
    for (n, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), n
    handle = offload_sim(model)  # offloaded again without groups=: the child Linears stream alone
    assert handle.layers == ["0.inner", "1", "2.inner"]


def test_transformers_conv1d_streams_as_a_tensor_group(offload_sim):
    """GPT-2's layers are transformers' Conv1D (weight [in, out], its own addmm), not
    nn.Linear: they used to stay resident without a word, only the embeddings and the head
    streaming. Each streams as a tensor group: logits and every gradient (a peft LoRA over
    c_attn and c_fc, fan_in_fan_out) equal the resident model's bit for bit, and greedy
    decoding gives its tokens."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)

    def make():
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg).requires_grad_(False)
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                                                          init_lora_weights="gaussian"))

    model, ref = make(), make()
    handle = offload_sim(model)
    conv1d = [n for n in handle.layers if n.endswith(("c_attn.base_layer", "attn.c_proj", "c_fc.base_layer",
                                                        "mlp.c_proj"))]
    assert len(conv1d) == 8 and handle.stats()["group_layers"] == 8, handle.layers
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    out, want = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert torch.equal(out.logits, want.logits)
    out.loss.backward()
    want.loss.backward()
    trained = [(n, p, q) for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()) if q.grad is not None]
    assert len(trained) == 2 * 2 * 2 and all(torch.equal(p.grad, q.grad) for _, p, q in trained)
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.equal(model.generate(input_ids=ids[:1, :4], max_new_tokens=6, do_sample=False),
                           ref.generate(input_ids=ids[:1, :4], max_new_tokens=6, do_sample=False))


def test_weights_of_modules_of_no_streamed_kind_are_named_when_they_are_many(offload_sim):
    """A custom attention that keeps its projection as its own nn.Parameter streams
    nothing of it: when such weights are a large part of the model (a quarter, 1 MiB or
    more) offload() names the modules and says groups= streams them; with groups= naming
    them, or when they are few (norms), nothing is said."""
    import warnings

    class Attention(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.qkv = nn.Parameter(torch.randn(3 * d, d) * 0.02)
            self.out = nn.Linear(d, d)

        def forward(self, x):
            q, k, v = (x @ self.qkv.t()).chunk(3, -1)
            return self.out(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)

    def said(model, **kw):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = offload_sim(model, **kw)
        return handle, [str(w.message) for w in caught if "of no kind layerstream streams" in str(w.message)]

    make = lambda: nn.Sequential(*(nn.Sequential(Attention(256), nn.Linear(256, 256)) for _ in range(4)))  # noqa: E731
    _, got = said(make())
    assert len(got) == 1 and "3.0 MiB of this model's weights (60%)" in got[0] and "4 module(s)" in got[0], got
    assert "'0.0' (Attention, 0.8 MiB)" in got[0] and "offload(groups=" in got[0]
    handle, got = said(make(), groups=["*.0"])
    assert got == [] and handle.stats()["group_layers"] == 4
    _, got = said(nn.Sequential(*(nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 256)) for _ in range(8))))
    assert got == []


def test_groups_errors(offload_sim):
    """A module that returns a view of its parameter, an RNN (cached weight references),
    a module without parameters: clear errors. A group excluded by exclude= is not one
    (its child Linear streams alone)."""

    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return x @ self.w, self.w.t()

    model = nn.Sequential(Leaky(), nn.Linear(4, 4))
    offload_sim(model, groups="0")
    with pytest.raises(LayerstreamError, match="'0' returned a view of one of its parameters"):
        model[0](torch.randn(2, 4))
    with pytest.raises(LayerstreamError, match="holds a LSTM: its forward reads cached references"):
        offload_sim(nn.Sequential(nn.LSTM(4, 4), nn.Linear(4, 4)), groups="0")
    with pytest.raises(LayerstreamError, match="names module '0', which has no parameters"):
        offload_sim(nn.Sequential(nn.ReLU(), nn.Linear(4, 4)), groups="0")
    handle = offload_sim(_model(), groups=["0", "2"], exclude="2")
    assert handle.layers == ["0", "1", "2.inner"]


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_quantized_group_module(offload_sim, fmt):
    """quantize= packs a groups= module's matrices (frozen), its child's too. Checked
    against an independent reference (tests/python/quant_ref.py, the format's spec in
    torch): the values detach() restores are the reference dequantization of the original
    weights bit for bit (and within the format's stated bound of them), and the streamed
    model computes exactly what the model computes resident with those reference values."""
    from quant_ref import assert_reference_values, ref_dequantize

    model = _model().requires_grad_(False)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if p.dim() == 2:  # the matrices are packed; biases stay dense
                p.copy_(ref_dequantize(fmt, original[n]))
    handle = offload_sim(model, groups=["0", "2"], quantize=fmt)
    assert model[0].w.is_meta and model[0].inner.weight.is_meta
    assert handle.stats()["quantized_layers"] == 3
    x = torch.randn(4, 16)
    with torch.no_grad():
        got = model(x)
        assert torch.equal(got, ref(x)), "streamed packed groups differ from the reference dequantization"
    handle.detach()
    for n, p in model.named_parameters():
        if p.dim() == 2:
            assert_reference_values(fmt, original[n], p, n)
        else:
            assert torch.equal(p, original[n]), n
    with torch.no_grad():
        assert torch.equal(model(x), got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_lossless_group_modules_compute_bit_for_bit(offload_sim, dtype):
    """quantize="lossless" codes a frozen group's matrices (a groups= module's and an
    nn.MultiheadAttention's; biases stay dense): outputs and the input's gradient equal the
    resident model's bit for bit, and detach() restores every tensor bit for bit. (Their
    bytes: tests/python/test_experts.py; these 16 x 16 matrices code larger than dense,
    a coded buffer's header and sections take 256 bytes each.)"""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.attn = _model(), nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x):
            h = self.body(x)
            return self.attn(h, x, x, need_weights=False)[0]

    torch.manual_seed(0)
    model = Net().to(dtype).requires_grad_(False)
    ref = copy.deepcopy(model)
    handle = offload_sim(model, groups=["body.0", "body.2"], quantize="lossless")
    assert handle.stats()["group_layers"] == 3 and handle.stats()["quantized_layers"] == 4  # 3 groups, body.1
    assert model.body[0].w.is_meta and model.attn.in_proj_weight.is_meta and not model.attn.in_proj_bias.is_meta
    for step in range(2):
        x, xr = (torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(step)).to(dtype).requires_grad_()
                 for _ in range(2))
        y, yr = model(x), ref(xr)
        assert torch.equal(y, yr), f"step {step}"
        y.float().square().sum().backward()
        yr.float().square().sum().backward()
        assert torch.equal(x.grad, xr.grad), f"step {step}"
    handle.detach()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert not p.is_meta and torch.equal(p, q), n


def test_lossless_group_of_another_dtype_streams_dense(offload_sim):
    """A float64 group is not coded: quantize="lossless" streams it dense and says why
    (was: the Linear layers' coding raised from inside offload()); a dict naming it is an
    error. (A float64 Linear stays resident: streamed layers compute in float32, bfloat16
    or float16.)"""
    model = _model().double().requires_grad_(False)
    with pytest.warns(RuntimeWarning, match=r"cannot pack 1 layer.*: 0 \(the tensor is torch.float64; only float32, "
                                            r"bfloat16 and float16"):
        handle = offload_sim(model, groups=["0"], quantize="lossless")
    assert not model[0].w.is_meta and handle.stats()["quantized_layers"] == 0
    handle.detach()
    with pytest.raises(LayerstreamError, match="cannot quantize layer '0' to lossless: the tensor is torch.float64"):
        offload_sim(_model().double().requires_grad_(False), groups=["0"], quantize={"0": "lossless"})


@pytest.mark.parametrize("module", ["custom", "attention"])
def test_group_under_autocast_recomputes_in_the_autocast_dtype(offload_sim, module):
    """A tensor group's forward runs under bf16 autocast, and backward (called outside the
    autocast region, as usual) runs the group's forward again: that recompute must see
    the same autocast state, so outputs, input gradients and every fp32 weight gradient
    equal the resident model's under autocast bit for bit (CPU autocast, sim device)."""
    torch.manual_seed(0)
    if module == "custom":
        model, groups, x = _model(), ["0", "2"], torch.randn(4, 16)
    else:
        model = nn.Sequential(nn.Linear(16, 16), nn.MultiheadAttention(16, 2, batch_first=True))
        groups, x = None, torch.randn(2, 5, 16)
    ref = copy.deepcopy(model)
    handle = offload_sim(model, groups=groups)
    assert handle.stats()["group_layers"] >= 1

    def run(m, inp):
        if module == "custom":
            return m(inp)
        h = m[0](inp)
        # key/value distinct from the query: with query is key is value, the recompute
        # (inputs saved and re-made as separate leaves) takes nn.MultiheadAttention's
        # separate-projection path, and the input gradient differs in its last bits.
        kv = inp.detach() * 0.5
        return m[1](h, kv, kv, need_weights=False)[0]

    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, yr = run(model, xs), run(ref, xr)
    assert y.dtype == yr.dtype == torch.bfloat16
    assert torch.equal(y, yr)
    y.float().square().sum().backward()
    yr.float().square().sum().backward()
    assert torch.equal(xs.grad, xr.grad)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad.dtype == q.grad.dtype == torch.float32, n
        assert torch.equal(p.grad, q.grad), f"{n}: gradient differs from the resident model's"


class _Fp32Router(nn.Module):
    """Computes its scores in fp32 under autocast (autocast off inside: a MoE router's or
    attention scores' usual guard)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            return (x.float() @ self.w).softmax(-1)


@pytest.mark.parametrize("backward_in_autocast", [False, True], ids=["backward-outside", "backward-inside"])
def test_a_group_with_an_fp32_region_trains_under_autocast_exactly(offload_sim, backward_in_autocast):
    """A group whose forward turns autocast off for an fp32 region, trained under bf16
    autocast: every gradient equals the resident model's bit for bit. Before, the
    backward's recompute differentiated inside the forward's restored autocast state, so
    the region's backward ran in bf16 and the gradients were 2-4e-3 relative off (the
    group's and the layer's before it). The backward's ops run in the caller's autocast
    state, as the resident backward's do (also when backward is called inside autocast)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), _Fp32Router(), nn.Linear(64, 8))
    ref = copy.deepcopy(model)
    offload_sim(model, groups=["1"], compute_dtype=torch.bfloat16)
    x = torch.randn(16, 64)
    outs = []
    for m in (ref, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
            if backward_in_autocast:
                y.float().square().sum().backward()
        if not backward_in_autocast:
            y.float().square().sum().backward()
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert torch.equal(p.grad, q.grad), f"{n}: gradient differs from the resident model's"


class _Normalizer(nn.Module):
    """Updates its running mean first, then centres its input with it (as observation
    normalizers do): its output reads the buffers its forward has just written."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.count += 1
                self.mean += (x.mean(0) - self.mean) / self.count
        return x - self.mean


class _NormBlock(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.l = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.cumulative = nn.BatchNorm1d(d, momentum=None)  # running stats averaged over num_batches_tracked
        self.norm = _Normalizer(d)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return self.norm(self.cumulative(self.bn(self.l(x)))) * self.scale


def test_a_groups_buffers_are_written_once_per_training_step(offload_sim):
    """A group holding BatchNorm layers (momentum and momentum=None) and a module whose
    output reads the running mean it has just updated, trained two steps (the second
    backward with retain_graph and a third one): every buffer, gradient and parameter,
    and eval outputs after, equal the resident model's bit for bit. Before, the backward's
    recompute ran the forward again on the module's buffers: each batch was counted twice
    (num_batches_tracked 4 after 2 steps, running statistics off, eval outputs off), and
    the normalizer's recompute centred with a mean updated twice (its scale's gradient off)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _NormBlock(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    offload_sim(model, groups=["1"])
    for step in range(2):
        x = torch.randn(6, 8)
        y, want = model(x), ref(x)
        assert torch.equal(y, want)
        for _ in range(2 if step else 1):
            y.square().sum().backward(retain_graph=True)
            want.square().sum().backward(retain_graph=True)
        for m in (model, ref):
            torch.optim.SGD(m.parameters(), lr=0.1).step()
    assert model[1].bn.num_batches_tracked.item() == 2
    for (n, a), (_, b) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(a, b), f"{n}: buffer differs from the resident model's"
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad) and torch.equal(p, q), n
    model.eval(), ref.eval()
    with torch.no_grad():
        x = torch.randn(4, 8)
        assert torch.equal(model(x), ref(x))


class _WritesInput(nn.Module):
    """Doubles its input in place before using it; `clone`: on a copy of it."""

    def __init__(self, clone=False, d=16):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.clone = clone

    def forward(self, x):
        x = x.clone() if self.clone else x
        x.mul_(2)
        return torch.tanh(x @ self.w)


@pytest.mark.parametrize("input_grad", [True, False], ids=["activation", "data"])
def test_a_group_that_writes_its_input_in_place_is_refused_when_it_trains(offload_sim, input_grad):
    """A groups= module whose forward writes its input in place trained fine resident. Streamed,
    an input that requires grad (an activation) raised torch's "a leaf Variable that requires
    grad is being used in an in-place operation", naming neither the group nor layerstream; one
    that does not (the data) trained silently wrong: the backward's recompute doubled the
    already doubled input, and the weight's gradient differed. Both are now an error naming the
    group and what to do; without a gradient the write is fine, and with the clone it says to
    add, training matches the resident model bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _WritesInput(), nn.Linear(16, 16))
    model[0].requires_grad_(input_grad)
    handle = offload_sim(model, groups=["1"])
    x = torch.randn(4, 16)
    with pytest.raises(LayerstreamError, match=r"streamed tensor group '1' modifies an input in place in its "
                                               r"forward.*runs its forward again in backward.*Clone the input in "
                                               r"its forward.*offload\(exclude=\['1'\]\)"):
        model(x)
    handle.detach()
    with torch.no_grad():
        ref = copy.deepcopy(model)
        handle = offload_sim(model, groups=["1"])
        assert torch.equal(model(x), ref(x))
    handle.detach()
    model[1].clone = True
    ref = copy.deepcopy(model)
    offload_sim(model, groups=["1"])
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (n, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), n


class _ClampsWeight(nn.Module):
    """Clamps its Linear's weight in place in its forward (weight clipping, a WGAN critic's)."""

    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.clamp_(-0.1, 0.1)
        return self.lin(x)


class _Renormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16, max_norm=1.0)

    def forward(self, ids):
        return self.emb(ids)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_group_that_writes_its_own_tensor_in_place_is_refused(offload_sim, grad):
    """A groups= module whose forward writes one of its parameters in place (a weight's
    clamp_(); nn.Embedding(max_norm=...) renormalizing the rows it reads) wrote the slot's
    copy: the parameter, state_dict() and detach() never saw the write, and training went on
    from the unclamped weights, without a word. The call is now refused naming the group and
    the tensor, the parameters left as they were; offload(exclude=[...]) as it advises trains
    as the resident model does. A max_norm table inside a groups= module is refused at
    offload(), the model left as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _ClampsWeight(), nn.Linear(16, 2))
    ref = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    handle = offload_sim(model, groups=["1"])
    x = torch.randn(4, 16)
    with torch.set_grad_enabled(grad), pytest.raises(
            LayerstreamError, match=r"streamed tensor group '1' writes its tensor 'lin\.weight' in place in its "
                                    r"forward.*lost\. Leave the module out of the group: offload\(exclude=\['1'\]\)"):
        model(x)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    handle.detach()
    offload_sim(model, exclude=["1"])
    with torch.set_grad_enabled(grad):
        for _ in range(2):
            y, want = model(x), ref(x)
            assert torch.equal(y, want)
            if grad:
                y.square().sum().backward()
                want.square().sum().backward()
    for (n, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b) and (a.grad is None) == (b.grad is None), n
        assert a.grad is None or torch.equal(a.grad, b.grad), n
    table = nn.Sequential(_Renormed(), nn.Linear(16, 2))
    with pytest.raises(LayerstreamError, match=r"names module '0', which holds an nn\.Embedding with max_norm "
                                               r"\('0\.emb'\).*leave it out of groups="):
        offload_sim(table, groups=["0"])
    assert all("forward" not in m.__dict__ for m in table.modules())


class _ClampsWithGrad(nn.Module):
    """Normalizes and drops out its input (a buffer write, random draws), then clamps its
    Linear's weight in place with grad enabled (no torch.no_grad() around it)."""

    def __init__(self, d=16, norm=True):
        super().__init__()
        self.norm = nn.BatchNorm1d(d) if norm else nn.Identity()
        self.drop, self.lin = nn.Dropout(0.5), nn.Linear(d, d)

    def forward(self, x):
        x = self.drop(self.norm(x))
        self.lin.weight.clamp_(-0.1, 0.1)
        return self.lin(x)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("input_grad", [True, False], ids=["activation", "data"])
def test_a_group_that_writes_its_own_parameter_with_grad_enabled_is_named_as_such(offload_sim, input_grad,
                                                                                  compiled):
    """A groups= module whose forward writes its own trainable weight in place with grad
    enabled (torch refuses that resident too: "a leaf Variable that requires grad is being
    used in an in-place operation") was reported as modifying an input in place ("Clone the
    input"), or, with an input that requires no grad, as torch's bare error. It is named now:
    the group's own parameter, written in place, and what to do. Finding it runs the forward
    once more on copies: the random state, buffers and parameters after the refused call are
    the resident model's after its refused call. (Compiled without the BatchNorm: a compiled
    group's trial on fake tensors meets its real buffers.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _ClampsWithGrad(norm=not compiled), nn.Linear(16, 2))
    model[0].requires_grad_(input_grad)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16)
    torch.manual_seed(1)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place"):
        ref(x)
    rng = torch.get_rng_state()
    offload_sim(model, groups=["1"])
    call = torch.compile(model, backend="aot_eager") if compiled else model
    torch.manual_seed(1)
    with pytest.raises(LayerstreamError, match=r"streamed tensor group '1' writes its own parameter 'lin\.weight' in "
                                               r"place in its forward with grad enabled .*under torch\.no_grad\(\) "
                                               r".*offload\(exclude=\['1'\]\)") as err:
        call(x)
    assert "an input" not in str(err.value)
    assert torch.equal(torch.get_rng_state(), rng)
    want = ref.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_offload_docstring_names_no_rnn_among_what_groups_streams(offload_sim):
    """offload()'s docstring listed "RNNs" among the layers groups= streams, while groups= on a
    module holding an nn.LSTM is refused: every sentence of its groups= entry that names an
    RNN says it is refused, as offload() does."""
    import re

    import layerstream

    entry = layerstream.offload.__doc__.split("\n    groups:")[1].split("\n    cache_across_steps:")[0]
    said = [s for s in re.split(r"(?<=[.)])\s+(?=[A-Z])", " ".join(entry.split())) if "RNN" in s]
    assert said and all("refused" in s for s in said), said
    with pytest.raises(LayerstreamError, match="holds a LSTM"):
        offload_sim(nn.Sequential(nn.LSTM(4, 4), nn.Linear(4, 4)), groups="0")


@pytest.mark.parametrize("kind", ["dict", "namedtuple", "list"])
def test_a_group_returns_its_own_container_when_it_trains(offload_sim, kind):
    """A groups= module returning a namedtuple or a list gave a plain tuple when a gradient
    was needed (its own type without one), and a dict was refused only then. It now returns
    the module's own container either way, with the resident model's values and gradients."""
    import collections

    pair = collections.namedtuple("Pair", "y z")

    class Out(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            y = x @ self.w
            return {"y": y, "z": y.tanh()} if kind == "dict" else pair(y, y.tanh()) if kind == "namedtuple" \
                else [y, y.tanh()]

    torch.manual_seed(0)
    model = Out()
    ref = copy.deepcopy(model)
    wrapper = nn.Sequential(model)
    offload_sim(wrapper, groups=["0"])
    x = torch.randn(3, 8)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            got, want = model(x), ref(x)
        assert type(got) is type(want)
        got, want = (list(o.values()) if kind == "dict" else list(o) for o in (got, want))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    sum(o.square().sum() for o in got).backward()
    sum(o.square().sum() for o in want).backward()
    assert torch.equal(model.w.grad, ref.w.grad)
