"""Training with streamed weights on the sim device, against the same run without offload.

Covers gradient checkpointing (reentrant and not), a real peft LoRA on a tiny
transformers Llama, gradient accumulation, optimizer steps on streamed
weights, clip_grad_norm_, inference, state_dict round trips,
requires_grad toggles, detach() and the transfer statistics.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp
from layerstream import LayerstreamError

from conftest import (CastCounter, FirstLayerSometimes, assert_data_writes_between_calls_are_seen, clone_input,
                      tiny_llama)

TOL = dict(rtol=1e-5, atol=1e-6)



# ---------------------------------------------------------------- models
class Block(nn.Module):
    def __init__(self, d=16, h=32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d=16, n_blocks=3, checkpoint=None):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.head = nn.Linear(d, 4)
        self.checkpoint = checkpoint  # None, "reentrant", "nonreentrant"

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            if self.checkpoint is None:
                x = b(x)
            else:
                x = cp.checkpoint(b, x, use_reentrant=self.checkpoint == "reentrant")
        return self.head(x)


def _assert_params_close(model, ref, exact=False, tol=TOL, what="param"):
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if exact:
            assert torch.equal(p, q), f"{what} {n} differs"
        else:
            torch.testing.assert_close(p, q, **tol, msg=lambda m: f"{what} {n}: {m}")


def _assert_grads(model, ref, exact=False, tol=TOL):
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None, f"{n}: reference has no grad, streamed model has one"
            continue
        assert p.grad is not None, f"{n}: grad missing"
        if exact:
            assert torch.equal(p.grad, q.grad), f"{n}: grad differs"
        else:
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m: f"{n}.grad: {m}")


def _train_exactly(model, ref, steps, run=None, d_in=16):
    """`steps` SGD steps on random inputs, the streamed model (called through `run`,
    default the model itself) against `ref`: outputs and grads bit-identical each step."""
    run = run or model
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for _ in range(steps):
        x = torch.randn(8, d_in)
        y, yr = run(x), ref(x)
        assert torch.equal(y, yr)
        y.square().sum().backward()
        yr.square().sum().backward()
        _assert_grads(model, ref, exact=True)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()


# ---------------------------------------------------------------- checkpointing
@pytest.mark.parametrize("mode", ["reentrant", "nonreentrant"])
def test_gradient_checkpointing(offload_sim, mode):
    model = Net(checkpoint=mode)
    ref = copy.deepcopy(model)
    ref.checkpoint = None  # reference: plain autograd, no offload, no checkpoint
    handle = offload_sim(model, prefetch=1, slots=3)
    x = torch.randn(5, 8, requires_grad=True)
    xr = clone_input(x)
    for _ in range(2):  # second step: grads accumulate, slots reused across steps
        y, yr = model(x), ref(xr)
        torch.testing.assert_close(y, yr, **TOL)
        y.pow(2).mean().backward()
        yr.pow(2).mean().backward()
        # complete on return from backward, without synchronize()
        _assert_grads(model, ref)
        torch.testing.assert_close(x.grad, xr.grad, **TOL)
    assert handle.stats()["d2h_bytes"] > 0


def test_gradient_checkpointing_matches_checkpointed_reference(offload_sim):
    """Same checkpointed model with and without offload: bit-identical grads."""
    model = Net(checkpoint="nonreentrant")
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(5, 8, requires_grad=True)
    model(x).sum().backward()
    ref(clone_input(x)).sum().backward()
    _assert_grads(model, ref, exact=True)


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_non_reentrant_checkpoint_recomputes_a_region_once(offload_sim, frozen):
    """A checkpointed region of three streamed layers runs its forward twice per step
    (forward, one recompute in backward), as the resident one does: the layers' kept
    graphs run in the caller's graph task, by which non-reentrant checkpointing keys its
    recompute (each as a graph task of its own, the region ran once per layer again)."""
    runs = {"n": 0}

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            runs["n"] += 1
            return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for blk in self.blocks:
                x = cp.checkpoint(blk, x, use_reentrant=False)
            return x

    torch.manual_seed(0)
    model = Model().requires_grad_(not frozen)
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(4, 16, requires_grad=True)
    for m in (ref, model):
        runs["n"] = 0
        m(x).sum().backward()
        assert runs["n"] == 4, runs  # 2 blocks x (forward + one recompute)
    _assert_grads(model, ref, exact=True)


# ---------------------------------------------------------------- LoRA (peft + transformers)
def _tiny_llama(bias: bool):
    return tiny_llama(seed=None, attention_bias=bias, mlp_bias=bias)


@pytest.mark.parametrize("bias", [
    pytest.param(False, id="llama-nobias"),  # the real Llama layout
    pytest.param(True, id="llama-bias"),  # attention_bias/mlp_bias=True (lm_head has none: kept resident)
])
def test_peft_lora_training_matches_reference(offload_sim, bias):
    from peft import LoraConfig, get_peft_model

    base = _tiny_llama(bias)
    lcfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, lcfg)
    # LoRA B is zero-initialised: give it values so the adapter path matters from step 0
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    ref = copy.deepcopy(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    exclude = ["*lora_*"] if not bias else ["*lora_*", "*lm_head*"]
    handle = offload_sim(model, exclude=exclude, prefetch=2)
    assert handle.layers, "no base layer streamed"
    assert not any("lora_" in n for n in handle.layers)
    # The frozen embedding table is streamed too (looked up in host memory).
    assert "base_model.model.model.embed_tokens" in handle.layers
    assert all(n.endswith(".base_layer") for n in handle.layers if "lm_head" not in n and "embed" not in n)

    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    opt_r = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    model.train(), ref.train()
    for step in range(4):
        ids = torch.randint(0, 64, (2, 10))
        loss = model(input_ids=ids, labels=ids).loss
        loss_r = ref(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, loss_r, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} loss: {m}")
        opt.zero_grad(), opt_r.zero_grad()
        loss.backward(), loss_r.backward()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if q.requires_grad:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}.grad: {m}")
            else:
                assert p.grad is None, f"frozen base param {n} got a grad"
        opt.step(), opt_r.step()

    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if "lora_" in n:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"adapter {n}: {m}")
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen_before[n]), f"frozen base weight {n} changed"
    stats = handle.stats()
    assert stats["h2d_bytes"] > 0
    assert stats["d2h_bytes"] == 0, "frozen base weights must not copy gradients back"
    # Only the rows looked up crossed the bus for the embedding: 4 steps x 20 ids x 32 fp32.
    assert stats["embedding_layers"] == 1 and stats["gathered_bytes"] == 4 * 20 * 32 * 4


def test_peft_dora_layers_stay_resident(offload_sim):
    """peft DoRA reads base_layer.weight and the lora_A/lora_B weights directly at every
    forward (its weight norm). Streamed, those are host tensors: on CUDA a device
    mismatch at the first call (the sim device computes on the CPU, so it hid it). The
    DoRA layer's modules stay resident with one warning; plain layers still stream, and
    training matches the reference exactly."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["0"], use_dora=True,
                                            init_lora_weights=False))
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning, match=r"3 layer\(s\) of peft adapters that read their base layer's weights "
                                            r"themselves stay resident .*"
                                            r"'base_model.model.0.base_layer' \(DoRA\); "
                                            r"'base_model.model.0.lora_A.default' \(DoRA\); "
                                            r"'base_model.model.0.lora_B.default' \(DoRA\)"):
        handle = offload_sim(model)
    assert handle.layers == ["base_model.model.2", "base_model.model.4"]
    _train_exactly(model, ref, steps=2)


def test_tied_embeddings_full_finetune_with_budget(offload_sim):
    """Llama with tie_word_embeddings: lm_head shares embed_tokens' weight. With room
    for it, the planner keeps lm_head resident, and the table with it (one tensor,
    counted once); with less, both stream from one host copy. Either way the tied
    weight is trained through both uses and its gradient accumulates exactly over two
    backward passes, and the budget's resident bytes are what is on the device."""
    pytest.importorskip("transformers")
    base = tiny_llama(64, tie_word_embeddings=True)
    # The planner keeps lm_head resident with room for 2 slots and 7 more 8 KiB layers;
    # with room for 2 slots and 1 it keeps smaller layers resident and streams lm_head.
    for budget, head_streams in ((9 * 64 * 32 * 4 + 64 * 4 * 10, False),
                                 (3 * 64 * 32 * 4 + 64 * 4 * 10, True)):
        model, ref = copy.deepcopy(base), copy.deepcopy(base)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        handle = offload_sim(model, budget=budget, prefetch=1)
        assert ("lm_head" in handle.layers) == head_streams
        assert ("model.embed_tokens" in handle.layers) == head_streams
        assert len(handle.layers) >= 2 + 2 * head_streams
        assert model.lm_head.weight is model.model.embed_tokens.weight
        unique = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
        streamed = {id(p) for n, p in model.named_parameters()
                    if n.rsplit(".", 1)[0] in handle.layers}
        on_device = sum(t.numel() * t.element_size() for i, t in unique.items() if i not in streamed)
        assert handle.stats()["resident_bytes"] == on_device
        for _ in range(2):  # no zero_grad: the second backward accumulates
            ids = torch.randint(0, 64, (2, 9))
            loss, loss_r = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
            assert torch.equal(loss, loss_r)
            loss.backward(), loss_r.backward()
        _assert_grads(model, ref, exact=True)
        handle.detach()


# ---------------------------------------------------------------- trace
def test_training_after_an_inference_pass_prefetches_backward_again(offload_sim):
    """The first step is a no_grad forward (its trace has no backward); the first
    training step runs that whole trace and goes on, so the scheduler takes its
    order as the trace and every later step misses only its first fetch. Numbers
    match throughout."""
    model = Net()
    ref = copy.deepcopy(model)
    h = offload_sim(model, trace=True)
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    for i in range(5):
        xi = torch.randn(4, 8)
        model(xi).pow(2).mean().backward()
        ref(xi).pow(2).mean().backward()
    with torch.no_grad():
        model(x)  # closes the last training step
    _assert_grads(model, ref, exact=True)
    steps = h.step_stats()
    acquires = steps[-1]["acquires"]
    # forward + backward fetches ('inp' is not fetched in backward: its input needs no grad)
    assert acquires == 2 * len(h.layers) - 1
    s = h.stats()
    assert s["retraces"] == 1
    # Step 1 extends the trace (its backward is unknown to it); steps 2-5 follow the new one.
    for st in steps[2:]:
        assert st["misses"] == 1, st
        assert st["hits"] == acquires - 1, st


@pytest.mark.parametrize("pattern", ["two_forwards", "layer_twice"])
def test_layer_used_twice_per_backward_accumulates_exactly(offload_sim, pattern):
    """A layer that gets two gradients in one backward (two forwards before one backward,
    or one module called twice) while .grad already holds earlier steps' gradients:
    autograd sums the two first and adds the sum once. layerstream used to add them to
    .grad one by one, which rounds differently (about one ulp); it now keeps one
    staging buffer per use and sums them the same way: bit-identical."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
    ref = copy.deepcopy(model)
    offload_sim(model, prefetch=2)

    def loss(m, a, b):
        if pattern == "two_forwards":
            return (m(a) * m(b)).sum()
        return m(m(a) + b).square().sum()

    for _ in range(4):  # no zero_grad: .grad accumulates across steps
        a, b = torch.randn(4, 16), torch.randn(4, 16)
        loss(model, a, b).backward()
        loss(ref, a, b).backward()
    _assert_grads(model, ref, exact=True)


def test_dpo_like_reference_pass_with_disabled_adapter_keeps_backward_prefetched(offload_sim):
    """DPO-style training over a LoRA model whose reference model is the same base with
    the adapter disabled: each step is a no_grad reference forward, then the policy's
    forward + backward, the very first step being a reference pass. Before, the trace
    kept that first forward-only order (the reference passes, prefixes of the training
    order, kept resetting the retrace count) and every backward fetch was on demand;
    now every training step misses only its first fetch. Numbers match the reference."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(_tiny_llama(False), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                          target_modules=["q_proj", "v_proj"]))
    ref = copy.deepcopy(model)
    handle = offload_sim(model, exclude=["*lora_*"], prefetch=2)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    opt_r = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for step in range(5):
        ids = torch.randint(0, 64, (2, 10))
        for m, o in ((model, opt), (ref, opt_r)):
            with torch.no_grad(), m.disable_adapter():
                ref_logp = m(input_ids=ids).logits.log_softmax(-1)
            logp = m(input_ids=ids).logits.log_softmax(-1)
            loss = (logp - ref_logp).exp().mean()
            o.zero_grad()
            loss.backward()
            o.step()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert torch.equal(p, q), f"step {step}: {n}"
    with torch.no_grad():
        model(input_ids=ids)  # closes the last training step
    steps = handle.step_stats()
    assert len(steps) == 10  # reference pass, training step, alternating
    assert handle.stats()["retraces"] == 1
    for st in steps[3::2]:  # the training steps after the first
        assert st["misses"] == 1, st


@pytest.mark.parametrize("cache", [False, True], ids=["per-step", "cache_across_steps"])
def test_random_mix_of_step_kinds_stays_exact(offload_sim, cache):
    """Inference, training and checkpointed training steps in a random order:
    whatever the trace is at a given moment (it is re-learned along the way),
    outputs and grads match the resident model bit for bit and the ordering
    checker (asserted at teardown) sees no race."""
    import random
    rnd = random.Random(3)
    model = Net()
    ref = copy.deepcopy(model)
    h = offload_sim(model, cache_across_steps=cache, slots=3, prefetch=2)
    for step in range(16):
        kind = rnd.choice(["infer", "train", "ckpt"])
        model.checkpoint = ref.checkpoint = "nonreentrant" if kind == "ckpt" else None
        x = torch.randn(4, 8)
        if kind == "infer":
            with torch.no_grad():
                assert torch.equal(model(x), ref(x)), f"step {step} ({kind})"
            continue
        y, yr = model(x), ref(x)
        assert torch.equal(y, yr), f"step {step} ({kind})"
        y.pow(2).mean().backward()
        yr.pow(2).mean().backward()
        _assert_grads(model, ref, exact=True)
    assert h.stats()["deviations"] > 0, "the mix really changed the order"


# ---------------------------------------------------------------- a backward that raises
class _FailInBackward(nn.Module):
    """Identity whose backward raises while `fail` is set (a NaN check, a CUDA OOM in
    an attention backward, ... caught by a training loop that skips the batch)."""

    def __init__(self):
        super().__init__()
        self.fail = False

    def forward(self, x):
        if not (self.fail and x.requires_grad):
            return x
        x = x * 1.0

        def boom(g):
            raise RuntimeError("backward failed on purpose")

        x.register_hook(boom)
        return x


class _NetFailingMidBackward(nn.Module):
    def __init__(self, checkpoint):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.fail = _FailInBackward()
        self.c = nn.Linear(16, 16)  # used twice: two staged uses per backward
        self.d = nn.Linear(16, 16)
        self.checkpoint = checkpoint

    def tail(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.c(x)))))

    def forward(self, x):
        x = self.fail(self.b(torch.tanh(self.a(x))))
        if self.checkpoint:
            return cp.checkpoint(self.tail, x, use_reentrant=self.checkpoint == "reentrant")
        return self.tail(x)


@pytest.mark.parametrize("checkpoint", [None, "reentrant", "nonreentrant"])
def test_backward_that_raises_leaves_no_gradient_behind(offload_sim, checkpoint):
    """A backward that raises after the layers behind the failure point staged their
    weight gradients. Before, those staged gradients stayed pending and were added to
    .grad at the end of the *next* backward: a loop that catches the error, calls
    zero_grad() and goes on trained on the failed batch's gradients too. Now the failed
    backward's gradients are dropped (never added; autograd would have added them, so
    .grad of those layers keeps its value from before the failed step, with a warning),
    and the steps after zero_grad() are bit-identical to plain autograd."""
    torch.manual_seed(0)
    model = _NetFailingMidBackward(checkpoint)
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def step(m, x):
        m(x).square().sum().backward()

    x = torch.randn(4, 16)
    step(model, x)
    step(ref, x)
    _assert_grads(model, ref, exact=True)
    before = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.fail.fail = ref.fail.fail = True
    x = torch.randn(4, 16)
    for m in (model, ref):
        with pytest.raises(RuntimeError, match="failed on purpose"):
            step(m, x)
    model.fail.fail = ref.fail.fail = False
    assert not torch.equal(ref.d.weight.grad, before["d.weight"])  # the test's premise
    if checkpoint == "reentrant":
        # c and d ran in the checkpoint's own (nested) backward, which completed and
        # applied their gradients before the outer one failed, as autograd does.
        _assert_grads(model, ref, exact=True)
        assert handle.stats()["failed_backwards"] == 0
    else:
        # c and d ran their backward before the failure: autograd added their
        # gradients; layerstream dropped them and left .grad as it was.
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, before[n]), f"{n}: .grad changed by the failed backward"
        assert handle.stats()["failed_backwards"] == 1

    failed = handle.stats()["failed_backwards"]
    for m in (model, ref):
        m.zero_grad()
    if failed:
        with pytest.warns(RuntimeWarning, match="backward pass through streamed layers raised"):
            y = model(x)
    else:
        y = model(x)
    y.square().sum().backward()
    step(ref, x)
    _assert_grads(model, ref, exact=True)
    for _ in range(2):
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        x = torch.randn(4, 16)
        step(model, x)
        step(ref, x)
        _assert_grads(model, ref, exact=True)
    _assert_params_close(model, ref, exact=True)
    assert handle.stats()["failed_backwards"] == failed


# ---------------------------------------------------------------- accumulation / optimizers
def test_grad_accumulation_three_micro_batches(offload_sim):
    model = Net()
    ref = copy.deepcopy(model)
    offload_sim(model)
    xs = torch.randn(3, 4, 8)
    for i in range(3):
        (model(xs[i]).pow(2).mean() / 3).backward()
        (ref(xs[i]).pow(2).mean() / 3).backward()
    _assert_grads(model, ref, exact=True)


@pytest.mark.parametrize("cache", [False, True], ids=["nocache", "cache_across_steps"])
@pytest.mark.parametrize("opt_name", ["sgd", "sgd-momentum", "adam", "adamw"])
def test_optimizer_steps_on_streamed_weights(offload_sim, opt_name, cache):
    """Host weight updates by the optimizer are seen by the next fetch."""
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.2),
        "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    }[opt_name]
    model = Net()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, prefetch=2, cache_across_steps=cache)
    opt, opt_r = make(model.parameters()), make(ref.parameters())
    n_steps = 5
    for step in range(n_steps):
        x = torch.randn(6, 8)
        loss, loss_r = model(x).pow(2).mean(), ref(x).pow(2).mean()
        assert torch.equal(loss, loss_r), f"step {step}: loss {loss.item()} vs {loss_r.item()}"
        opt.zero_grad(), opt_r.zero_grad()
        loss.backward(), loss_r.backward()
        opt.step(), opt_r.step()
    _assert_params_close(model, ref, exact=True)
    stats = handle.stats()
    assert stats["h2d_bytes"] > 0 and stats["d2h_bytes"] > 0
    assert stats["steps"] >= n_steps - 1, stats


@pytest.mark.parametrize("cache", [False, True], ids=["nocache", "cache_across_steps"])
def test_in_place_weight_edit_between_forwards_is_seen(offload_sim, cache):
    """No optimizer: a plain in-place write to the host weight changes the next output."""
    lin = nn.Linear(4, 4)
    ref = copy.deepcopy(lin)
    offload_sim(lin, cache_across_steps=cache)
    x = torch.randn(2, 4)
    assert torch.equal(lin(x), ref(x))
    with torch.no_grad():
        lin.weight.mul_(2)
        ref.weight.mul_(2)
        lin.bias.add_(1)
        ref.bias.add_(1)
    assert torch.equal(lin(x), ref(x))


def test_data_writes_between_calls_with_cache_across_steps_are_seen(offload_sim):
    """Note [Writes through .data between steps] (csrc/torch/engine.cpp): a write through
    .data moves no version counter; with cache_across_steps the next call used the
    weight cached in its slot. Now a step that begins samples the host bytes, and a
    bulk write (a merge, a scale) is seen. A write that misses every sampled word (one
    element here: the 64 sampled words of this weight skip word 1) is the documented
    limit, which handle.synchronize() covers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    ref = copy.deepcopy(model)
    h = offload_sim(model, cache_across_steps=True)
    x = torch.randn(2, 256)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
        model(x)  # second step: both layers now cached across the boundary
        for m in (model, ref):
            m[1].weight.data.mul_(2)
            m[0].bias.data.add_(1)
        assert torch.equal(model(x), ref(x)), "a bulk write through .data is seen at the next call"
        before = model(x)
        for m in (model, ref):
            m[1].weight.data[0, 2] += 1  # word 1 of the weight: not sampled
        assert torch.equal(model(x), before), "the documented limit: a write no sampled word sees"
        h.synchronize()
        assert torch.equal(model(x), ref(x)), "after synchronize() the new weight is read"


def test_a_copy_of_one_streamed_layer_is_a_plain_module_so_peft_modules_to_save_trains(offload_sim):
    """peft's modules_to_save deep-copies the module it wraps (task_type="SEQ_CLS" wraps
    the classification head itself): on a streamed layer that raised "an offloaded model
    cannot be deep-copied". A copy of one streamed layer is now a plain module with its
    values (resident, trained as peft trains it); the original still streams; a whole
    offloaded model still refuses; a layer held packed (quantize=) refuses naming why."""
    import warnings

    import peft
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0)

    def train(offloaded):
        torch.manual_seed(0)
        model = transformers.LlamaForSequenceClassification(cfg)
        handle = offload_sim(model) if offloaded else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(model, peft.LoraConfig(task_type="SEQ_CLS", r=4,
                                                               target_modules=["q_proj", "v_proj"]))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            ids = torch.randint(1, 128, (2, 8), generator=gen)
            loss = model(input_ids=ids, labels=torch.randint(0, 3, (2,), generator=gen)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, model, handle

    want, _, _ = train(False)
    got, model, handle = train(True)
    assert got == want
    assert "score" in handle.layers  # the original head streams (peft's disabled-adapter path)
    head = model.base_model.model.score.modules_to_save["default"]
    assert type(head) is nn.Linear
    assert not {"forward", "_apply", "__deepcopy__", "_layerstream_handle"} & set(head.__dict__)

    layer = model.base_model.model.model.layers[0].mlp.up_proj
    twin = copy.deepcopy(layer)
    assert torch.equal(twin.weight, layer.weight) and twin.weight.data_ptr() != layer.weight.data_ptr()
    with torch.no_grad():
        twin.weight.add_(1.0)  # its own storage
    assert not torch.equal(twin.weight, layer.weight)
    with pytest.raises(LayerstreamError, match="an offloaded model cannot be deep-copied"):
        copy.deepcopy(model)

    torch.manual_seed(0)
    frozen = transformers.LlamaForSequenceClassification(cfg).requires_grad_(False)
    offload_sim(frozen, quantize="int8")
    with pytest.raises(LayerstreamError, match=r"streamed layer 'score' cannot be copied .*modules_to_save.*"
                                               r"quantize=\{'score': None"):
        copy.deepcopy(frozen.score)


@pytest.mark.parametrize("cache", [False, True], ids=["per-step", "cache_across_steps"])
def test_peft_merge_unmerge_and_unload_between_calls_match_the_resident_model(offload_sim, cache):
    """peft's merge_adapter() / unmerge_adapter() / merge_and_unload() (and diffusers'
    fuse_lora(), which calls them) add the LoRA product to the base weight through
    .data. With cache_across_steps the first call after a merge ran with the unmerged
    weight still in its slot (off by 0.97 here), and so did every call of the unwrapped
    model merge_and_unload() returns (an inner module: no call hook, its steps begin at
    its first layer). Each call now equals the resident model's."""
    from peft import LoraConfig, get_peft_model

    def make():
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        return get_peft_model(base.requires_grad_(False),
                              LoraConfig(r=4, target_modules=["0", "2", "4"], init_lora_weights=False))

    ref, model = make(), make()
    offload_sim(model, cache_across_steps=cache, slots=4)
    x = torch.randn(4, 32)
    with torch.no_grad():
        for what in ("plain", "merged", "unmerged", "merged again", "unmerged again", "unloaded"):
            for m in (ref, model):
                if what.startswith("merged"):
                    m.merge_adapter()
                elif what.startswith("unmerged"):
                    m.unmerge_adapter()
            if what == "unloaded":
                ref, model = ref.merge_and_unload(), model.merge_and_unload()
            for call in range(2):
                assert torch.equal(model(x), ref(x)), f"{what}, call {call}"
                if what == "unmerged":
                    with ref.disable_adapter(), model.disable_adapter():
                        assert torch.equal(model(x), ref(x)), f"{what}, adapter disabled"


class _DataWritingSGD(torch.optim.Optimizer):
    """SGD that writes the way optimizers torch's version counters never see write:
    through ``.data`` (Prodigy, older optimizers) or through the raw pointer (as
    bitsandbytes' and DeepSpeed's C++/CUDA kernels do). ".data, one element" changes
    only the element(s) in the weight's second 8-byte word, which the sample a step
    takes skips (Note [Writes through .data between steps]): as a bf16 step whose
    updates mostly round away leaves most of a weight as it was."""

    def __init__(self, params, how, lr=0.1):
        super().__init__(params, dict(lr=lr))
        self.how = how

    @torch.no_grad()
    def step(self):
        import ctypes
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.how == ".data":
                    p.data.add_(p.grad, alpha=-group["lr"])
                elif self.how == ".data, one element":
                    k = 8 // p.element_size()
                    p.data.view(-1)[k:k + 1].add_(p.grad.view(-1)[k:k + 1], alpha=-group["lr"])
                else:
                    new = (p.detach() - group["lr"] * p.grad).contiguous()
                    ctypes.memmove(p.data_ptr(), new.data_ptr(), new.numel() * new.element_size())


@pytest.mark.parametrize("quantize", [None, "lossless"])
@pytest.mark.parametrize("how", [".data", "pointer", ".data, one element"])
def test_an_optimizer_step_writing_behind_the_version_counters_is_seen(offload_sim, how, quantize):
    """Note [An optimizer step is a write] (_calls.py): with cache_across_steps every
    layer stays in its own slot across steps, and an optimizer step that wrote the
    trainable weights through .data or a raw pointer used to leave the old weights
    there: every later loss differed from the resident model's. The step's own writes
    are now seen, also those the sample of a step's beginning misses, and only what it
    wrote is copied again: the frozen layers (in the optimizer too, without gradients)
    stay cached."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if quantize else torch.float32  # lossless codes bf16 weights
    # No bias: a bias is sampled whole, and its change would make the step copy its layer again.
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False, dtype=dtype) for _ in range(4)])
    for layer in model[:2]:
        layer.requires_grad_(False)
    ref = copy.deepcopy(model)
    h = offload_sim(model, cache_across_steps=True, slots=5, quantize=quantize)
    opt, ref_opt = _DataWritingSGD(model.parameters(), how), _DataWritingSGD(ref.parameters(), how)
    trainable = sum(p.numel() * p.element_size() for layer in model[2:] for p in layer.parameters())
    for step in range(4):
        x = torch.randn(8, 32, dtype=dtype)
        before = h.stats()["h2d_bytes"]
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).float().square().mean().backward()
            o.step()
            o.zero_grad()
        _assert_params_close(model[2:], ref[2:], exact=True, what=f"step {step}:")  # frozen lossless: stand-ins
        copied = h.stats()["h2d_bytes"] - before
        if step > 1 and quantize is None:  # from the third step on (the coded size varies with the values)
            assert copied == trainable, f"step {step}: {copied} bytes copied, the trainable layers are {trainable}"
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_bitsandbytes_adamw8bit_with_cache_across_steps_trains_like_the_resident_model(offload_sim):
    """bitsandbytes' 8-bit AdamW writes the weights in its own kernel, which moves no
    version counter: with cache_across_steps the losses left the resident model's at
    the second step (0.0250 vs 0.0222 here). Now its step counts as a write (Note [An
    optimizer step is a write]), and the next step's sample sees the bytes change too
    (Note [Writes through .data between steps])."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    ref = copy.deepcopy(model)
    offload_sim(model, cache_across_steps=True, slots=5)
    opts = [bnb.optim.AdamW8bit(m.parameters(), lr=1e-2, min_8bit_size=1) for m in (model, ref)]
    for step in range(4):
        x = torch.randn(4, 256)
        losses = []
        for m, o in zip((model, ref), opts):
            loss = m(x).square().mean()
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss)
        assert torch.equal(*losses), f"step {step}: {losses[0].item()} vs {losses[1].item()}"
    _assert_params_close(model, ref, exact=True)


# ---------------------------------------------------------------- step boundaries
def test_steps_that_skip_the_first_layer_read_the_weights_the_optimizer_wrote(offload_sim):
    """Note [When a step begins] (core/scheduler.cpp): a step used to begin only when
    the trace's first layer was fetched again; after a first step that ran `pre`, no
    later one began, and the layers still in a slot were served with their weights
    from before the optimizer step (the loss left the resident model's at step 2)."""
    torch.manual_seed(0)
    model = FirstLayerSometimes()
    ref = copy.deepcopy(model)
    h = offload_sim(model, slots=2, prefetch=1)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(6):
        x = torch.randn(8, 64)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x, first=step == 0).square().mean().backward()
            o.step()
            o.zero_grad()
        _assert_params_close(model, ref, exact=True, what=f"step {step}:")
    assert h.stats()["steps"] == 6


def test_a_data_write_between_calls_that_skip_the_first_layer_is_seen(offload_sim):
    """A write through `.data` (peft's merge_adapter(), an EMA swap) between two
    inference calls: no version counter sees it, and the calls skip the layer the
    steps began with, so only the call itself (offload()'s forward pre-hook) says
    that a step begins and the weights cached in the slots are old."""
    torch.manual_seed(0)
    model = FirstLayerSometimes()
    ref = copy.deepcopy(model)
    h = offload_sim(model, slots=6)  # every layer stays in its slot
    assert_data_writes_between_calls_are_seen(model, ref, torch.randn(8, 64))
    assert h.stats()["steps"] == 4


def test_an_inner_module_called_on_its_own_after_training_reads_each_write(offload_sim):
    """After training, the trace names every layer again in its backward. An inner
    module called on its own (no hook sees that call) still begins a step each time:
    the trace does not expect its layer again as a forward fetch (each entry keeps its
    phase; Note [When a step begins]). Writes through `.data` between the calls are
    seen."""
    torch.manual_seed(0)
    model = FirstLayerSometimes()
    ref = copy.deepcopy(model)
    offload_sim(model, slots=6)  # every layer stays in its slot
    x = torch.randn(8, 64, requires_grad=True)
    for _ in range(2):
        for m in (model, ref):
            m(x, first=True).square().sum().backward()
    with torch.no_grad():
        for call in range(3):
            assert torch.equal(model.layers[1](x), ref.layers[1](x)), f"call {call}"
            for m in (model, ref):
                m.layers[1].weight.data.add_(0.25)


@pytest.mark.parametrize("slots", [2, 6])
def test_random_calls_writes_and_inner_modules_stay_exact(offload_sim, slots):
    """Training steps and inference calls that run or skip the first layer, calls of
    one inner module, and writes to a weight through `.data` or in place, in a random
    order after a first training step (which the README's one remaining case needs):
    every output and parameter equals the resident model's, whatever the slots held."""
    import random
    rnd = random.Random(5)
    torch.manual_seed(0)
    model = FirstLayerSometimes()
    ref = copy.deepcopy(model)
    offload_sim(model, slots=slots)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    kinds = ["train", "infer", "inner", "data", "in-place"]
    for i in range(40):
        kind = "train" if i == 0 else rnd.choice(kinds)
        first, k = rnd.random() < 0.3, rnd.randrange(len(model.layers))
        x = torch.randn(8, 64)
        outs = []
        for m, o in zip((model, ref), opts):
            if kind == "train":
                y = m(x, first=first)
                y.square().mean().backward()
                o.step()
                o.zero_grad()
            elif kind in ("data", "in-place"):
                with torch.no_grad():
                    (m.layers[k].weight.data if kind == "data" else m.layers[k].weight).mul_(0.9)
                continue
            else:
                with torch.no_grad():
                    y = m(x, first=first) if kind == "infer" else m.layers[k](x)
            outs.append(y)
        if outs:
            assert torch.equal(outs[0], outs[1]), f"call {i} ({kind})"
    _assert_params_close(model, ref, exact=True)


def test_tensors_added_after_offload_are_moved_by_the_next_call(offload_sim, monkeypatch):
    """Note [Tensors added after offload() follow to the compute device], on the sim device
    (its compute device is the host, where added tensors already are: the follower is told
    the device is another, meta, and its moves are recorded). Each call looks; it moves
    exactly what was added, not a streamed layer's tensors nor a parameter replaced on a
    streamed layer, nothing while suspended, and only after something was registered
    since it last looked."""
    import layerstream._calls as calls_module
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    handle = offload_sim(model)
    hook = handle._call_hook.begins
    follow = hook._follow
    calls = []
    hook._follow = lambda: calls.append(1)
    model(torch.randn(2, 8))
    assert calls == [1], "each call looks"
    moved = []
    monkeypatch.setattr(calls_module, "_move_to", lambda module, kind, name, device: moved.append(
        (module, kind, name, device)))
    follow._device = torch.device("meta")
    follow()  # whatever offload() itself registered
    assert moved == []
    model.add_module("extra", nn.BatchNorm1d(8))  # registers 2 parameters and 3 buffers
    handle.suspend()
    follow()
    assert moved == [], "not while suspended"
    handle.resume()
    follow()
    assert [(m, kind, name) for m, kind, name, _ in moved] == [
        (model.extra, "param", "weight"), (model.extra, "param", "bias"), (model.extra, "buffer", "running_mean"),
        (model.extra, "buffer", "running_var"), (model.extra, "buffer", "num_batches_tracked")]
    assert all(device.type == "meta" for *_, device in moved)
    moved.clear()
    model[0].weight = nn.Parameter(torch.zeros(8, 8))  # refused by the layer at its next call
    follow()
    assert [(m, name) for m, _, name, _ in moved] == [(model.extra, "weight"), (model.extra, "bias"),
                                                      (model.extra, "running_mean"), (model.extra, "running_var"),
                                                      (model.extra, "num_batches_tracked")]
    moved.clear()
    model.extra.weight.data = torch.zeros(8)  # no registration: not looked at again
    follow()
    assert moved == []


def test_peft_merge_and_unload_after_training_computes_with_the_merged_weights(offload_sim):
    """LoRA training, then peft's merge_and_unload() (writes through `.data`) and
    inference with the unwrapped model, which offload()'s hook on the peft model does
    not see. The first streamed layer is a LoRA module, gone after the merge: the
    first fetch after the backward begins a step, the next call's first fetch of a
    layer the trace does not expect again begins one (Note [When a step begins])."""
    from peft import LoraConfig, get_peft_model

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    torch.manual_seed(0)
    cfg = LoraConfig(r=4, target_modules=[f"layers.{i}" for i in range(4)], init_lora_weights=False)
    ref = get_peft_model(Stack(), cfg)
    model = copy.deepcopy(ref)
    h = offload_sim(model, exclude=["*layers.0.base_layer"], slots=11)  # every streamed layer stays cached
    assert h.layers[0].endswith("layers.0.lora_A.default")
    _train_exactly(model, ref, steps=2, d_in=64)
    merged, ref_merged = model.merge_and_unload(), ref.merge_and_unload()
    x = torch.randn(8, 64)
    with torch.no_grad():
        for call in range(2):
            assert torch.equal(merged(x), ref_merged(x)), f"call {call}"
            for m in (merged, ref_merged):  # merge another update, as a second adapter would
                m.layers[2].weight.data.add_(0.25)


def test_clip_grad_norm_right_after_backward(offload_sim):
    model = Net()
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(6, 8)
    (model(x).pow(2).sum() * 10).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    (ref(x).pow(2).sum() * 10).backward()
    norm_r = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)
    assert norm_r > 0.5  # clipping is active
    torch.testing.assert_close(norm, norm_r, rtol=1e-6, atol=0)
    _assert_grads(model, ref, tol=dict(rtol=1e-6, atol=1e-7))


# ---------------------------------------------------------------- inference / state
def test_eval_no_grad_inference(offload_sim):
    model = Net().eval()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8)
            y = model(x)
            assert not y.requires_grad
            assert torch.equal(y, ref(x))
    assert all(p.grad is None for p in model.parameters())
    stats = handle.stats()
    assert stats["h2d_bytes"] > 0
    assert stats["d2h_bytes"] == 0


def test_inference_mode(offload_sim):
    model = Net().eval()
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(4, 8)
    with torch.inference_mode():
        assert torch.equal(model(x), ref(x))


def test_state_dict_keys_and_load(offload_sim):
    model = Net()
    ref = copy.deepcopy(model)
    offload_sim(model)
    sd = model.state_dict()
    assert list(sd.keys()) == list(ref.state_dict().keys())
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k

    new = Net()  # different random values
    new_sd = new.state_dict()
    assert not torch.equal(new_sd["inp.weight"], sd["inp.weight"])
    x = torch.randn(3, 8)
    before = model(x).detach()
    model.load_state_dict(new_sd)
    ref.load_state_dict(new_sd)
    after = model(x)
    assert not torch.equal(before, after.detach())
    assert torch.equal(after, new(x))
    assert torch.equal(after, ref(x))
    # and gradients are taken w.r.t. the new values
    after.sum().backward()
    ref(x).sum().backward()
    _assert_grads(model, ref, exact=True)


def test_requires_grad_toggles_after_attach(offload_sim):
    model = Net()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    x = torch.randn(4, 8)

    def step():
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            m(x).pow(2).sum().backward()
        _assert_grads(model, ref, exact=True)

    step()
    d2h_all = handle.stats()["d2h_bytes"]
    for m in (model, ref):
        m.blocks[1].requires_grad_(False)
        m.head.weight.requires_grad_(False)
    step()
    assert model.blocks[1].fc1.weight.grad is None
    assert model.head.weight.grad is None and model.head.bias.grad is not None
    d2h_frozen = handle.stats()["d2h_bytes"] - d2h_all
    assert 0 < d2h_frozen < d2h_all, "frozen layers should not copy weight grads back"
    for m in (model, ref):
        m.requires_grad_(True)
    step()
    assert model.blocks[1].fc1.weight.grad is not None
    # all frozen: forward works, nothing comes back
    for m in (model, ref):
        m.requires_grad_(False)
        m.zero_grad(set_to_none=True)
    before = handle.stats()["d2h_bytes"]
    x_req = torch.randn(4, 8, requires_grad=True)
    xr = clone_input(x_req)
    model(x_req).sum().backward()
    ref(xr).sum().backward()
    assert torch.equal(x_req.grad, xr.grad)
    assert all(p.grad is None for p in model.parameters())
    assert handle.stats()["d2h_bytes"] == before


def test_detach_restores_forward_and_weights(offload_sim):
    model = Net()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    param_ids = {n: id(p) for n, p in model.named_parameters()}
    forwards_before = {n: m.forward for n, m in model.named_modules()}
    handle = offload_sim(model)
    assert model.inp.forward != forwards_before["inp"]  # swapped
    with torch.no_grad():
        model(torch.randn(2, 8))
    handle.detach()

    for n, m in model.named_modules():
        assert "forward" not in m.__dict__, f"{n}: instance forward left behind"
        assert m.forward == forwards_before[n]
        assert getattr(m, "_layerstream_handle", None) is None
    for n, p in model.named_parameters():
        assert id(p) == param_ids[n], f"{n}: parameter object replaced"
        assert not hasattr(p, "_is_memory_managed")
        assert p.device.type == "cpu"
        assert p.dtype == original[n].dtype
        assert torch.equal(p, original[n]), f"{n}: not bit-identical after detach"
    # the model is an ordinary model again and can be offloaded again
    x = torch.randn(3, 8)
    ref = copy.deepcopy(model)
    assert torch.equal(model(x), ref(x))
    handle2 = offload_sim(model)
    assert torch.equal(model(x), ref(x))
    handle2.detach()


def test_training_then_detach_keeps_trained_weights_and_stats(offload_sim):
    model = Net()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
    n_steps = 4
    for _ in range(n_steps):
        x = torch.randn(4, 8)
        for m, o in ((model, opt), (ref, opt_r)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    handle.synchronize()
    stats = handle.stats()
    assert stats["h2d_bytes"] > 0
    assert stats["d2h_bytes"] > 0
    assert stats["steps"] >= n_steps - 1
    assert stats["layers"] == len(handle.layers) == 8
    handle.detach()
    _assert_params_close(model, ref, exact=True)
    # the optimizer keeps working on the same parameter objects after detach
    x = torch.randn(4, 8)
    for m, o in ((model, opt), (ref, opt_r)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    _assert_params_close(model, ref, exact=True)


# ---------------------------------------------------------------- autograd API variants
def test_autograd_grad_wrt_input_does_not_touch_param_grad(offload_sim):
    model = Net()
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(4, 8, requires_grad=True)
    (gx,) = torch.autograd.grad(model(x).pow(2).sum(), [x])
    (gxr,) = torch.autograd.grad(ref(x).pow(2).sum(), [x])
    torch.testing.assert_close(gx, gxr, **TOL)
    assert all(p.grad is None for p in ref.parameters())
    leaked = [n for n, p in model.named_parameters() if p.grad is not None]
    assert leaked == [], f"param.grad written by autograd.grad: {leaked}"


def test_backward_with_inputs_subset(offload_sim):
    model = Net()
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(4, 8, requires_grad=True)
    xr = clone_input(x)
    model(x).sum().backward(inputs=[x])
    ref(xr).sum().backward(inputs=[xr])
    torch.testing.assert_close(x.grad, xr.grad, **TOL)
    _assert_grads(model, ref)  # all None in the reference


def test_autograd_grad_wrt_streamed_params(offload_sim):
    model = Net()
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(4, 8)
    got = torch.autograd.grad(model(x).pow(2).sum(), list(model.parameters()), allow_unused=True)
    want = torch.autograd.grad(ref(x).pow(2).sum(), list(ref.parameters()))
    for (n, _), g, w in zip(model.named_parameters(), got, want):
        assert g is not None, f"{n}: no gradient returned"
        torch.testing.assert_close(g, w, **TOL)


def test_param_hooks_fire_like_reference(offload_sim):
    """Tensor hooks and post-accumulate-grad hooks (used by DDP/FSDP-style code) fire."""
    model = Net()
    ref = copy.deepcopy(model)
    offload_sim(model)
    fired = {"m": [], "r": []}
    for key, m in (("m", model), ("r", ref)):
        for n, p in m.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, n=n, key=key: fired[key].append((n, p.grad.clone())))
    x = torch.randn(4, 8)
    model(x).sum().backward()
    ref(x).sum().backward()
    got = dict(fired["m"])
    want = dict(fired["r"])
    assert sorted(got) == sorted(want)
    assert len(fired["m"]) == len(fired["r"])
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=lambda m: f"{n}: {m}")


def test_param_hooks_registered_after_the_forward_fire_like_reference(offload_sim):
    """A hook registered between the forward and the backward: the layer's forward had
    chosen to stage its gradients (no hook then), so register_hook got None and
    post-accumulate-grad hooks read .grad None; a None-tolerant hook that doubles the
    gradient left it undoubled, silently. The backward routes them through autograd now."""
    model = Net()
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(4, 8)
    seen = {"m": [], "r": []}
    for key, m in (("m", model), ("r", ref)):
        loss = m(x).square().sum()
        for n, p in m.named_parameters():
            p.register_hook(lambda g, n=n, key=key: (seen[key].append((n, g is None)), None if g is None else g * 2)[1])
            p.register_post_accumulate_grad_hook(lambda p, n=n, key=key: seen[key].append((n, p.grad is None)))
        loss.backward()
    assert sorted(seen["m"]) == sorted(seen["r"]) and not any(none for _, none in seen["m"])
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["cast-at-use", "compute_dtype"])
def test_autocast_bf16_mixed_precision_training(offload_sim, compute_dtype):
    """fp32 weights under bf16 autocast: streamed layers compute in bf16 exactly as
    autocast's nn.Linear does (the input is cast as autocast would), so outputs
    and fp32 grads are bit-identical to the resident model. With
    compute_dtype=bf16 the weights are cast in their slots, never at use."""
    model = Net()
    ref = copy.deepcopy(model)
    offload_sim(model, compute_dtype=compute_dtype)
    x = torch.randn(5, 8)  # batch 5: no activation has a weight's shape
    streamed = [p for n, p in model.named_parameters() if "norm" not in n]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with CastCounter(p.shape for p in streamed) as casts:
            y = model(x)
        yr = ref(x)
    assert y.dtype == yr.dtype == torch.bfloat16
    if compute_dtype is None:
        assert casts.casts >= len(streamed)
    else:
        assert casts.casts == 0, "weights were cast at use despite compute_dtype"
    assert torch.equal(y, yr)
    y.float().pow(2).mean().backward()
    yr.float().pow(2).mean().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, q.grad), f"{n}.grad differs"


@pytest.mark.parametrize("optimizer", ["torch", "layerstream"])
def test_an_accelerate_training_loop_equals_the_resident_one(offload_sim, optimizer):
    """The loop of diffusers', kohya's and ai-toolkit's training scripts: accelerate's
    Accelerator (bf16 mixed precision, gradient accumulation over 2 micro-batches)
    prepares the offloaded model and its optimizer (torch's AdamW or layerstream's),
    then accumulate(), backward(), clip_grad_norm_() at each sync, step(). Losses and
    the unwrapped model's weights are bit-identical to the same loop on the resident model."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    import layerstream.optim

    def run(streamed):
        acc = Accelerator(mixed_precision="bf16", cpu=True, gradient_accumulation_steps=2)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8))
        if streamed:
            offload_sim(model, compute_dtype=torch.bfloat16)
        cls = layerstream.optim.AdamW if optimizer == "layerstream" else torch.optim.AdamW
        model, opt = acc.prepare(model, cls(model.parameters(), lr=1e-2))
        torch.manual_seed(1)
        losses = []
        for _ in range(6):
            with acc.accumulate(model):
                loss = model(torch.randn(16, 64)).float().square().mean()
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        return losses, {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}

    try:
        (want, ref), (got, out) = run(False), run(True)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert got == want
    assert ref.keys() == out.keys() and all(torch.equal(out[k], ref[k]) for k in ref)
    assert not torch.equal(out["0.weight"], _initial_first_weight()), "the loop trained"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_hf_trainer_trains_an_offloaded_llama_like_the_resident_one(offload_sim, tmp_path, bf16):
    """transformers' Trainer (its own AdamW, gradient accumulation, max_grad_norm, linear
    schedule; bf16 autocast or not) over an offloaded Llama: the logged losses and the
    trained weights are the resident model's, bit for bit."""
    import transformers

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    def run(streamed):
        model = tiny_llama()
        if streamed:
            offload_sim(model)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / f"run{int(streamed)}"), per_device_train_batch_size=4, max_steps=4,
            gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=1e-3, bf16=bf16, use_cpu=True,
            report_to=[], save_strategy="no", logging_steps=1, seed=3, dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

    (want, ref), (got, out) = run(False), run(True)
    assert len(got) == 4 and got == want
    assert ref.keys() == out.keys() and all(torch.equal(out[k], ref[k]) for k in ref)
    assert not torch.equal(out["lm_head.weight"], tiny_llama().lm_head.weight.detach()), "it trained"


def _initial_first_weight():
    torch.manual_seed(0)
    return nn.Linear(64, 128).weight.detach()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_of_an_offloaded_model_trains_exactly(offload_sim, backend):
    """torch.compile(model) after offload(): each streamed layer is one layerstream
    operator in the graph (test_compile.py), its weight gradients returned through the
    compiled backward (aot_eager: AOTAutograd's graphs). On these 2-D inputs the
    operator's backward issues the resident Linear's own mm calls: results and
    gradients are exact."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    _train_exactly(model, ref, steps=3, run=compiled)
    _assert_params_close(model, ref, exact=True)
    assert handle.stats()["misses"] < handle.stats()["acquires"]
    torch._dynamo.reset()


def test_autocast_conv_computes_in_the_autocast_dtype(offload_sim):
    """A streamed Conv2d under autocast runs in bf16 like autocast's own conv2d
    (same numbers, bit for bit on the CPU), with gradients in the parameters' fp32."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3))
    ref = copy.deepcopy(model)
    offload_sim(model, compute_dtype=torch.bfloat16)
    x = torch.randn(2, 3, 9, 9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, yr = model(x), ref(x)
    assert y.dtype == yr.dtype == torch.bfloat16
    assert torch.equal(y, yr)
    y.float().square().sum().backward()
    yr.float().square().sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, q.grad), f"{n}.grad differs"


def test_retain_graph_double_backward_pass(offload_sim):
    model = Net()
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(4, 8)
    for m in (model, ref):
        loss = m(x).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    _assert_grads(model, ref, exact=True)


# ---------------------------------------------------------------- lifetime
_LIFETIME_SCRIPT = r"""
import gc, torch, layerstream
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
expected = m[0].weight.detach().clone()
h = layerstream.offload(m, device="sim")
m(torch.randn(2, 8))
w = m[0].weight                  # e.g. still held by an optimizer
del m, h
gc.collect()                     # the engine is gone, the parameter is not
assert torch.equal(w.detach(), expected), "parameter data changed after the engine was destroyed"
for _ in range(3):               # other engines come and go
    m2 = torch.nn.Linear(4, 4)
    h2 = layerstream.offload(m2, device="sim")
    m2(torch.randn(1, 4))
del w
gc.collect()
print("OK")
"""


def test_parameter_outlives_engine():
    """engine.h: 'parameters keep the host memory alive even after the Engine is gone'.

    Run in a subprocess: the failure mode is a crash of the interpreter.
    """
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    pkg = os.path.dirname(os.path.dirname(__import__("layerstream").__file__))
    env["PYTHONPATH"] = pkg + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _LIFETIME_SCRIPT], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0 and "OK" in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])


def test_a_models_device_property_reports_the_compute_device(offload_sim):
    """transformers' `model.device` is its first parameter's device: the host, once the
    embedding table streams. generate() moves every decode step's inputs to it
    (prepare_inputs_for_generation), which the streamed lookup refuses on a GPU. offload()
    makes each module with such a property and streamed weights below it report the
    compute device (the class swapped for a subclass of the same name); detach() restores
    the class. On sim both devices are the CPU: the property is shown to follow the
    engine's device, not the parameters', by pointing it elsewhere."""
    from transformers import LlamaForCausalLM, LlamaModel

    model = tiny_llama()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    assert isinstance(model, LlamaForCausalLM) and type(model).__name__ == "LlamaForCausalLM"
    assert type(model) is not LlamaForCausalLM and isinstance(model.model, LlamaModel)
    assert model.device == model.model.device == handle.compute_device
    model.__dict__["_layerstream_device"] = torch.device("meta")
    assert model.device == torch.device("meta") and next(model.parameters()).device.type == "cpu"
    model.__dict__["_layerstream_device"] = handle.compute_device
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=6, do_sample=False)
        out_r = ref.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, out_r)
    handle.detach()
    assert type(model) is LlamaForCausalLM and type(model.model) is LlamaModel
    assert "_layerstream_device" not in model.__dict__
