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
