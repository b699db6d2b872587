"""Loose ends of offload() and layerstream.optim: a refused offload() that left its
groups= marks behind, a tied table resident with its head that the plan and stats()
did not count, the "budget too small" advice for a layer quantize= cannot pack that
was lost to slots= or a name's escaping, and a step() re-run after a Ctrl-C that
stepped again what the interrupted one had stepped."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import layerstream
from layerstream import LayerstreamError
from layerstream._discovery import _WHOLE_GROUPS
from layerstream.optim import Adafactor, AdamW
from conftest import TiedHead
from ctrl_c import signal_at


# ------------------------------------------------ a refused offload() leaves no groups= marks
class _AttnLstm(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 32)
        self.lstm = nn.LSTM(4, 4)

    def forward(self, x):
        return self.head(self.attn(x, x, x)[0])


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("refusal", ["budget", "share_host_store", "rnn", "ctrl_c"])
def test_a_refused_offload_leaves_no_groups_marks(offload_sim, monkeypatch, refusal):
    """offload(groups=[...]) marks the modules it streams whole as it discovers them; a
    refusal after that (a budget too small, a bad option checked later, a later groups=
    module that holds an RNN, a Ctrl-C before the layers were attached) left the marks,
    and a later offload() of the model without groups= said the attention "streams
    whole because offload(groups=...)" and told the user to leave it out of groups=."""
    torch.manual_seed(0)
    model = _AttnLstm().requires_grad_(False)
    before = copy.deepcopy(model)
    kwargs = {"budget": dict(groups=["attn"], budget="1KiB"),
              "share_host_store": dict(groups=["attn"], share_host_store="bad"),
              "rnn": dict(groups=["attn", "lstm"]),
              "ctrl_c": dict(groups=["attn"])}[refusal]
    if refusal == "ctrl_c":
        monkeypatch.setattr(layerstream._offload, "_split_tied", _interrupt)
    with warnings.catch_warnings(), pytest.raises((LayerstreamError, ValueError, KeyboardInterrupt)):
        warnings.simplefilter("ignore")
        offload_sim(model, **kwargs)
    monkeypatch.undo()
    assert not any(m in _WHOLE_GROUPS for m in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.state_dict().values()))
    with pytest.raises(LayerstreamError, match=r"inside tensor group 'attn' \(nn\.MultiheadAttention's forward") as e:
        offload_sim(model, exclude=["attn.out_proj"])
    assert "groups=" not in str(e.value)
    x = torch.randn(2, 5, 32)
    handle = offload_sim(model)
    assert torch.equal(model(x), before(x))
    handle.detach()


# ------------------------------------------------ a tied table resident with its head is counted
@pytest.mark.parametrize("budget", ["8MiB", "700KiB"])
def test_a_table_resident_with_its_tied_head_is_in_the_plan_and_stats(offload_sim, budget):
    """A budget that keeps the tied head resident keeps its table resident too (one
    tensor on the device): stats()["resident_layers"] left the table out (5 of the 6
    layers resident with 8 MiB) and handle.plan did not name it at all."""
    torch.manual_seed(0)
    model = TiedHead().requires_grad_(False)
    ref = copy.deepcopy(model)
    handle = offload_sim(model, budget=budget, prefetch=1)
    ids = torch.randint(0, 1000, (2, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(ids), ref(ids))
    layers = {"emb": model.emb, "head": model.head, **{f"blocks.{i}": b for i, b in enumerate(model.blocks)}}
    resident = [n for n in layers if n not in handle.layers]
    assert "emb" in resident and "head" in resident
    s = handle.stats()
    assert s["resident_layers"] == len(resident)
    # The shared weight is on the device once, in the head's bytes.
    tensors = {id(p): p.numel() * p.element_size() for n in resident for p in layers[n].parameters()}
    assert s["resident_bytes"] == sum(tensors.values())
    assert "embedding tables:         1 resident with the layer that shares its weight (its bytes are that " \
           "layer's above): emb (weight shared with head)" in handle.plan
    assert s["peak_device_bytes"] <= s["budget_bytes"]


def test_a_gpt2_tied_head_kept_resident_counts_its_table(offload_sim):
    """The same with transformers' GPT-2 (tie_word_embeddings): wte is resident with
    lm_head, wpe is looked up in host memory; the plan says both."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=2000, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                  tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval().requires_grad_(False)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = offload_sim(model, budget="700KiB", prefetch=1)
    ids = torch.randint(0, 2000, (1, 8), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(ids).logits, ref(ids).logits)
    assert "lm_head" not in handle.layers and "transformer.wte" not in handle.layers
    planned = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"] + ["lm_head"]
    assert handle.stats()["resident_layers"] == len([n for n in planned if n not in handle.layers]) + 1
    assert ("1 looked up in host memory (pinned unless pinning failed), 0.01 MiB more, no device memory: "
            "transformer.wpe; 1 resident with the layer that shares its weight (its bytes are that layer's "
            "above): transformer.wte (weight shared with lm_head)") in handle.plan


# ------------------------------------------------ "budget too small" for a layer quantize= cannot pack
class _NamedTiedHead(TiedHead):
    def __init__(self, name):
        super().__init__()
        head = self._modules.pop("head")
        self.add_module(name, head)
        self.name = name

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = torch.relu(b(x))
        return getattr(self, self.name)(x)


@pytest.mark.parametrize("name, options", [("head", {"slots": 2}), ("head", {"slots": 3, "quantize": "nf4"}),
                                           ("tête", {}), ("tête", {"quantize": "nf4"})])
def test_a_budget_too_small_for_a_tied_head_never_suggests_quantizing_it(name, options):
    """The planner's error suggested "or quantize the weights" for a largest layer that
    streams as stored (a head tied to the table) when slots= wrapped the error in more
    words, or when the layer's name is not ASCII (escaped byte by byte in the text):
    offload() rewrote the advice by reading the name back from the text."""
    model = _NamedTiedHead(name).requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied head stays unquantized: warned
        with pytest.raises(LayerstreamError, match="is too small: the largest layer") as e:
            layerstream.offload(model, device="sim", budget="300KiB", prefetch=1, **options)
    text = str(e.value)
    assert "quantize the weights" not in text, text
    assert "(it streams as stored: quantization does not apply to it)" in text, text


# ------------------------------------------------ a re-run step() after a Ctrl-C completes it once
def _signal_at(name: str):
    """While the block runs: SIGINT raised once, as the first C function `name` returns."""
    return signal_at("c_return", name)


_XS = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def _train(opt_cls, options, keep_grads, interrupt_at=None):
    """3 overlapped steps of Linear, LayerNorm (resident), Linear; the second step() is
    interrupted as `interrupt_at` returns, then run again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16))
    handle = layerstream.offload(model, device="sim")
    opt = opt_cls(model.parameters(), **options)
    for i, x in enumerate(_XS):
        with opt.overlap(handle, keep_grads=keep_grads):
            model(x).square().mean().backward()
        if i == 1 and interrupt_at is not None:
            with _signal_at(interrupt_at) as sent, pytest.raises(KeyboardInterrupt):
                opt.step()
            assert sent
        opt.step()
        opt.zero_grad()
    handle.detach()
    return [p.detach().clone() for p in model.parameters()], [int(opt.state[p]["step"]) for p in model.parameters()]


@pytest.mark.parametrize("opt_cls, options", [(AdamW, {}), (AdamW, {"max_grad_norm": 0.01}), (Adafactor, {})],
                         ids=["adamw", "adamw-clip", "adafactor"])
@pytest.mark.parametrize("keep_grads", [True, False], ids=["keep_grads", "drop_grads"])
@pytest.mark.parametrize("where", ["settle", "kernel"])
def test_a_step_rerun_after_a_ctrl_c_completes_it_once(opt_cls, options, keep_grads, where):
    """A Ctrl-C lands in step() between its held parts: after the overlapped backward's
    steps were settled and counted, or after a group's kernel. Running step() again (as
    after any step() that raised) stepped the overlapped layers a second time with the
    gradients overlap(keep_grads=True) kept (their counts 4 after 3 steps), the groups
    already stepped a second time, and clipped the rest by their norm alone. Now the
    re-run finishes the interrupted step: the uninterrupted run's numbers and counts."""
    kernel = {AdamW: "optim_adamw_step", Adafactor: "optim_adafactor_step"}[opt_cls]
    want, want_steps = _train(opt_cls, options, keep_grads)
    got, got_steps = _train(opt_cls, options, keep_grads, interrupt_at="settle" if where == "settle" else kernel)
    assert got_steps == want_steps == [3] * 6
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_new_backward_after_an_interrupted_step_is_a_new_step():
    """What the re-run finishes is the interrupted step only: after zero_grad() and a new
    backward, step() steps every parameter with the new gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16))
    handle = layerstream.offload(model, device="sim")
    opt = AdamW(model.parameters())
    with opt.overlap(handle, keep_grads=True):
        model(_XS[0]).square().mean().backward()
    with _signal_at("settle"), pytest.raises(KeyboardInterrupt):
        opt.step()
    streamed = [p for a in handle._attached for p in a.module.parameters()]
    counts = lambda: [int(opt.state[p]["step"]) if p in opt.state else 0 for p in model.parameters()]  # noqa: E731
    assert counts() == [1 if any(p is q for q in streamed) else 0 for p in model.parameters()]
    opt.zero_grad()
    model(_XS[1]).square().mean().backward()
    opt.step()
    assert counts() == [2 if any(p is q for q in streamed) else 1 for p in model.parameters()]
    handle.detach()
