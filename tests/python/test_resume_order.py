"""Resuming and saving in the orders users write: an optimizer state loaded before
offload() into a model that load_safetensors() gave meta parameters, and
torch.save(model) of an offloaded model."""
from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file

import layerstream
from layerstream.optim import Adafactor, AdamW

# The budget keeps the small layers on the device, whose states it did not count.
pytestmark = pytest.mark.filterwarnings("ignore:layerstream.optim. .* kept on the device:RuntimeWarning")


def _mk():
    return torch.nn.Sequential(torch.nn.LayerNorm(64), *[torch.nn.Linear(64, 64) for _ in range(5)])


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 64, generator=g) for _ in range(n)]


def _train(model, opt, xs):
    for x in xs:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


OPTIMIZERS = {
    "adamw": lambda ps: AdamW(ps, lr=1e-2, max_grad_norm=0.5, seed=1),
    "adamw-8bit": lambda ps: AdamW(ps, lr=1e-2, max_grad_norm=0.5, seed=1, state_precision="8bit"),
    "adafactor": lambda ps: Adafactor(ps, lr=1e-2, relative_step=False, scale_parameter=False, beta1=0.9),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_optimizer_state_loaded_before_offload_into_a_meta_model_resumes_bit_for_bit(kind, offload_sim, tmp_path):
    """A resume that builds the model on meta, gives it its checkpoint with
    load_safetensors() and loads the optimizer state before offload(): the loaded
    moments were adopted in the layout of the meta parameters (meta tensors, the
    values lost), step() refused them without naming the cause and state_dict()
    saved meta tensors. Now they wait for offload() and the run goes on as the
    uninterrupted one, bit for bit."""
    xs = _batches(6)
    ref = _mk()
    model = copy.deepcopy(ref)
    _train(ref, OPTIMIZERS[kind](ref.parameters()), xs)  # the uninterrupted run

    h = offload_sim(model, budget="40KiB")
    opt = OPTIMIZERS[kind](model.parameters())
    _train(model, opt, xs[:3])
    save_file(model.state_dict(), tmp_path / "ck.safetensors")
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    h.detach()

    with torch.device("meta"):
        resumed = _mk()
    layerstream.load_safetensors(resumed, tmp_path / "ck.safetensors")
    opt = OPTIMIZERS[kind](resumed.parameters())
    saved = torch.load(tmp_path / "opt.pt")
    opt.load_state_dict(saved)
    # Until offload() gives the parameters values, the state dict is the loaded one.
    again = opt.state_dict()["state"]
    for i, st in saved["state"].items():
        for key, t in st.items():
            if isinstance(t, torch.Tensor):
                assert not again[i][key].is_meta and torch.equal(again[i][key], t), (i, key)
    offload_sim(resumed, budget="40KiB")
    _train(resumed, opt, xs[3:])
    for k, v in ref.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k


@pytest.mark.parametrize("overlapped", [False, True])
def test_a_torch_adamw_state_loaded_before_offload_is_adopted_as_after_it(overlapped, offload_sim, tmp_path):
    """A torch.optim.AdamW state (fp32 moments) loaded into bf16 states before
    offload(): adopted at the first step, as a load after offload() adopts it
    (before, the meta parameter's layout lost the values; kept as loaded without
    adoption, the fp32 moments do not fit state_precision='bf16')."""
    src = _mk()
    save_file(src.state_dict(), tmp_path / "m.safetensors")
    topt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    src(torch.randn(4, 64)).square().mean().backward()
    topt.step()
    sd = topt.state_dict()
    x = torch.randn(4, 64)

    def run(load_first):
        with torch.device("meta"):
            m = _mk()
        layerstream.load_safetensors(m, tmp_path / "m.safetensors")
        opt = AdamW(m.parameters(), lr=1e-2, state_precision="bf16")
        if load_first:
            opt.load_state_dict(copy.deepcopy(sd))
        h = offload_sim(m, budget="40KiB")
        if not load_first:
            opt.load_state_dict(copy.deepcopy(sd))
        if overlapped:  # the first step's streamed layers stepped during the backward
            with opt.overlap(h):
                m(x).square().mean().backward()
            opt.step()
        else:
            _train(m, opt, [x])
        out = ({k: v.clone() for k, v in m.state_dict().items()},
               {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()})
        h.detach()
        return out

    (w1, s1), (w2, s2) = run(True), run(False)
    for k in w2:
        assert torch.equal(w1[k], w2[k]), k
    for i in s2:
        for k in s2[i]:
            assert s1[i][k].dtype == s2[i][k].dtype and torch.equal(s1[i][k], s2[i][k]), (i, k)


def test_torch_save_of_an_offloaded_model_says_that_the_file_it_writes_is_lost(offload_sim, tmp_path):
    """torch.save(model, path) over a good checkpoint: torch.save truncates `path`
    before it pickles, so the refusal comes after the old checkpoint is gone (a
    70 KB checkpoint left as 665 bytes that do not load), and the message did not
    say so: it now says the file is lost and to save to a new path, then rename."""
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    path = tmp_path / "last.pt"
    torch.save(model.state_dict(), path)
    offload_sim(model, budget="40KiB")
    with pytest.raises(layerstream.LayerstreamError, match=r"cannot be pickled.*state_dict\(\).*has already "
                       r"truncated `path`.*lost: save to a new path and rename"):
        torch.save(model, path)
    with pytest.raises(Exception):  # what the message says: the old checkpoint is gone
        torch.load(path)
    # The way the message gives: the state dict to a new path, renamed over the old one.
    torch.save(model.state_dict(), tmp_path / "last.pt.new")
    (tmp_path / "last.pt.new").replace(path)
    back = torch.load(path)
    for k, v in model.state_dict().items():
        assert torch.equal(back[k], v), k
