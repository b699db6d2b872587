"""layerstream.optim against torch and transformers (host and streamed parameters, sim device).

Tolerances (stated once here):

* fp32 AdamW vs ``clip_grad_norm_`` + ``torch.optim.AdamW``: every element
  within 1e-6 relative, i.e. ``|a - b| <= 1e-6 * |b| + 1e-6 * max|b|`` (the
  second term covers elements that cancel to ~0, where a relative error is
  meaningless). Not bit for bit: torch's CPU ``sqrt`` (its AVX2 vector path)
  is off by one ulp in ~15% of elements, ours is IEEE's correctly rounded one
  (docs/design/optim.md, "Agreement with torch").
* Adafactor vs ``transformers.optimization.Adafactor``: 1e-5 relative to the
  tensor's scale (its sums run in another order).
* bf16 + stochastic rounding: the mean update is unbiased to 5 standard
  deviations of the rounding noise; on a small regression model (60 steps)
  the loss of bf16 weights + bf16 states stays within 10% of fp32's plus
  1e-3 (bf16's own forward/backward resolution), and so does fp32 weights +
  8-bit states.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import layerstream
from layerstream.optim import Adafactor, AdamW

REL = 1e-6


def assert_rel_close(a, b, rel=REL, what=""):
    a, b = a.detach().float(), b.detach().float()
    scale = b.abs().max().item()
    torch.testing.assert_close(a, b, rtol=rel, atol=rel * scale, msg=lambda m: f"{what}: {m}")


class Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.norm = nn.LayerNorm(d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.norm(torch.tanh(self.inp(x))))))


def _groups(model):
    """Two param groups with different lr and weight decay (weights / the rest)."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    return [{"params": weights, "lr": 2e-2, "weight_decay": 0.1}, {"params": rest, "lr": 5e-3, "weight_decay": 0.0}]


def _batches(steps, k, gen):
    # Input scales vary so that the gradient norm is above the clip on some
    # steps and below it on others.
    return [[torch.randn(4, 8, generator=gen) * (3.0 if s % 3 == 0 else 0.3) for _ in range(k)]
            for s in range(steps)]


@pytest.mark.parametrize("streamed", [False, True], ids=["host", "streamed"])
def test_adamw_fp32_matches_torch(offload_sim, streamed):
    """20 steps of 3 accumulated micro-batches, clip active on some steps, two
    param groups, a scheduler, and a state_dict round trip into a new
    optimizer at step 10: equal to clip_grad_norm_ + torch.optim.AdamW."""
    model = Net()
    ref = copy.deepcopy(model)
    if streamed:
        handle = offload_sim(model)
        assert handle.stats()["layers"] == 3
    max_norm = 0.2  # the norms run from ~0.4 down to ~0.08 here
    opt = AdamW(_groups(model), betas=(0.9, 0.99), max_grad_norm=max_norm)
    ref_opt = torch.optim.AdamW(_groups(ref), betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=4, gamma=0.5)
    clipped = []
    for step, micro in enumerate(_batches(20, 3, torch.Generator().manual_seed(1))):
        if step == 10:  # round trip: a new optimizer and scheduler from state dicts
            sd, ssd = copy.deepcopy(opt.state_dict()), sched.state_dict()
            opt = AdamW(_groups(model), betas=(0.9, 0.99), max_grad_norm=max_norm)
            opt.load_state_dict(sd)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
            sched.load_state_dict(ssd)
        for x in micro:
            (model(x).square().mean() / 3).backward()
            (ref(x).square().mean() / 3).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        clipped.append(norm.item() > max_norm)
        opt.step()
        ref_opt.step()
        assert opt.last_grad_norm == pytest.approx(norm.item(), rel=1e-6)
        opt.zero_grad()
        ref_opt.zero_grad()
        sched.step()
        ref_sched.step()
        assert all(p.grad is None for p in model.parameters())
    assert any(clipped) and not all(clipped), clipped
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_rel_close(p, q, what=n)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_rel_close(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"], rel=1e-5, what="exp_avg_sq")
        assert opt.state[p]["step"].item() == ref_opt.state[q]["step"].item() == 20


def test_accumulation_over_three_micro_batches_equals_one_batch(offload_sim):
    """Streamed: k = 3 micro-batches of 4 (loss / 3 each) give the parameters of
    one batch of 12 (to fp32 summation order)."""
    model = Net()
    big = copy.deepcopy(model)
    offload_sim(model)
    offload_sim(big)
    opt = AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    opt_big = AdamW(big.parameters(), lr=1e-2, max_grad_norm=1.0)
    gen = torch.Generator().manual_seed(2)
    for _ in range(8):
        x = torch.randn(12, 8, generator=gen)
        for part in x.split(4):
            (model(part).square().mean() / 3).backward()
        big(x).square().mean().backward()
        opt.step(), opt_big.step()
        opt.zero_grad(), opt_big.zero_grad()
    for (n, p), q in zip(model.named_parameters(), big.parameters()):
        assert_rel_close(p, q, rel=1e-5, what=n)


_CONTINUE = textwrap.dedent("""
    import sys, torch, layerstream
    torch.set_num_threads(1)  # as conftest.py: the bf16 forward's sums in the same order
    sys.path.insert(0, {testdir!r})
    from test_optim import Net
    model = Net().to(torch.bfloat16)
    model.load_state_dict(torch.load({path!r} + ".model"))
    opt = layerstream.optim.AdamW(model.parameters(), lr=1e-2, state_precision="8bit", max_grad_norm=1.0, seed=5)
    opt.load_state_dict(torch.load({path!r} + ".opt"))
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 8, generator=gen) for _ in range(10)]
    for x in batches[5:]:
        model(x.bfloat16()).float().square().mean().backward()
        opt.step(); opt.zero_grad()
    torch.save(model.state_dict(), {path!r} + ".out")
""")


def test_state_dict_round_trip_into_a_fresh_process(tmp_path):
    """bf16 parameters with 8-bit states (the dtypes torch's load_state_dict
    would cast) saved after 5 steps and continued in a new process: the same
    bits as 10 steps in one go (stochastic rounding is seeded per step)."""
    model = Net().to(torch.bfloat16)
    start = copy.deepcopy(model.state_dict())
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 8, generator=gen) for _ in range(10)]

    def run(m, opt, xs):
        for x in xs:
            m(x.bfloat16()).float().square().mean().backward()
            opt.step()
            opt.zero_grad()

    opt = AdamW(model.parameters(), lr=1e-2, state_precision="8bit", max_grad_norm=1.0, seed=5)
    run(model, opt, batches[:5])
    st = opt.state[model.inp.weight]
    assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg_absmax"].dtype == torch.float32
    path = str(tmp_path / "ckpt")
    torch.save(model.state_dict(), path + ".model")
    torch.save(opt.state_dict(), path + ".opt")
    run(model, opt, batches[5:])

    script = tmp_path / "cont.py"
    script.write_text(_CONTINUE.format(testdir=os.path.dirname(__file__), path=path))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(layerstream.__file__)))
    subprocess.run([sys.executable, str(script)], check=True, env=env, timeout=120)
    out = torch.load(path + ".out")
    for k, v in model.state_dict().items():
        assert torch.equal(out[k], v), k
    assert not torch.equal(start["inp.weight"], out["inp.weight"])


def test_torch_adamw_state_dict_loads_and_continues_equal():
    """A torch.optim.AdamW state dict loads into the fp32 optimizer (same state
    names) and continues like torch."""
    model = Net()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(4, 8, generator=gen) for _ in range(6)]
    for x in xs[:3]:
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model.load_state_dict(ref.state_dict())
    opt = AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    for x in xs[3:]:
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_rel_close(p, q, what=n)


def _stepped_adamw(precision, steps=3, seed=0):
    """A parameter of 600 elements (8-bit states: 3 blocks) and its AdamW after a few steps."""
    gen = torch.Generator().manual_seed(seed)
    p = nn.Parameter(torch.randn(3, 200, generator=gen))
    opt = AdamW([p], lr=1e-2, state_precision=precision)
    for _ in range(steps):
        p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return p, opt


def test_load_state_dict_keeps_the_constructed_state_precision():
    """The checkpoint's state_precision replaced the constructor's: an optimizer made
    with "8bit" (or "bf16") to save host memory kept a checkpoint's fp32 states, 4x (2x)
    the bytes, and an "fp32" one kept 8-bit codes, without a word. As the C++
    AdamW::load (docs/design/optim.md): the loaded states are converted into the group's
    precision, the step count kept."""
    p, opt = _stepped_adamw("fp32")
    saved = copy.deepcopy(opt.state_dict())
    for mine, dtype in (("bf16", torch.bfloat16), ("8bit", torch.uint8)):
        q = nn.Parameter(p.detach().clone())
        narrow = AdamW([q], lr=1e-2, state_precision=mine)
        narrow.load_state_dict(copy.deepcopy(saved))
        st = narrow.state[q]
        assert narrow.param_groups[0]["state_precision"] == mine and float(st["step"]) == 3.0
        for k in ("exp_avg", "exp_avg_sq"):
            assert st[k].dtype == dtype, k
            if mine == "bf16":
                assert torch.equal(st[k], saved["state"][0][k].bfloat16()), k


def _q8_values(opt, p):
    """The float values of p's 8-bit states in opt, as an fp32 layerstream AdamW loads them."""
    clones = {id(x): nn.Parameter(x.detach().clone()) for g in opt.param_groups for x in g["params"]}
    wide = AdamW([{"params": [clones[id(x)] for x in g["params"]]} for g in opt.param_groups], state_precision="fp32")
    wide.load_state_dict(copy.deepcopy(opt.state_dict()))
    st = wide.state[clones[id(p)]]
    return st["exp_avg"], st["exp_avg_sq"], wide


def _near_codes(got, want, what):
    """got within 8-bit rounding of want: 1/16 of the value (3 mantissa bits, to nearest),
    or the codes' resolution below their block's largest value."""
    err = (got.float() - want.float()).abs()
    bound = want.float().abs() / 16 + want.float().abs().max() * 2.0 ** -16
    assert bool((err <= bound).all()), f"{what}: worst {float((err - bound).max())} over the bound"


def test_8bit_states_convert_to_float_and_back():
    """8-bit states were refused by an fp32 or bf16 optimizer and float states by an
    8-bit one: a run could not change its state precision on resume (more host memory,
    or less), nor hand 8-bit states to torch. They convert now (optim::q8_decode /
    q8_encode): decoded as the step reads them, encoded to the nearest codes. A step's
    codes come back unchanged through fp32, so the 8-bit run continues bit for bit."""
    p, opt = _stepped_adamw("8bit", steps=4)
    m, v, wide = _q8_values(opt, p)
    assert m.dtype == v.dtype == torch.float32 and float(wide.state[wide.param_groups[0]["params"][0]]["step"]) == 4
    st = opt.state[p]
    for values, absmax in ((m, st["exp_avg_absmax"]), (v, st["exp_avg_sq_absmax"])):
        flat = values.reshape(-1)
        tops = torch.stack([flat[i:i + 256].abs().max() for i in range(0, flat.numel(), 256)])
        assert torch.equal(tops, absmax)  # each block's top code is its absmax, exactly
    back = AdamW([nn.Parameter(p.detach().clone())], lr=1e-2, state_precision="8bit")
    back.load_state_dict(copy.deepcopy(wide.state_dict()))
    r = back.param_groups[0]["params"][0]
    for k in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
        assert torch.equal(back.state[r][k], st[k]), k
    grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(11))
    p.grad, r.grad = grad, grad.clone()
    opt.step()
    back.step()
    assert torch.equal(r, p)

    # torch's fp32 states into an 8-bit optimizer: within the codes' rounding, and it trains on.
    gen = torch.Generator().manual_seed(12)
    t = nn.Parameter(torch.randn(3, 200, generator=gen))
    theirs = torch.optim.AdamW([t], lr=1e-2)
    for _ in range(3):
        t.grad = torch.randn(t.shape, generator=gen)
        theirs.step()
    u = nn.Parameter(t.detach().clone())
    eight = AdamW([u], lr=1e-2, state_precision="8bit")
    eight.load_state_dict(copy.deepcopy(theirs.state_dict()))
    m8, v8, _ = _q8_values(eight, u)
    _near_codes(m8, theirs.state[t]["exp_avg"], "exp_avg")
    _near_codes(v8, theirs.state[t]["exp_avg_sq"], "exp_avg_sq")
    bad = copy.deepcopy(theirs.state_dict())
    bad["state"][0]["exp_avg_sq"][0, 0] = -1.0
    fresh = AdamW([nn.Parameter(t.detach().clone())], state_precision="8bit")
    with pytest.raises(RuntimeError, match=r"'exp_avg_sq' of parameter 0.* negative values"):
        fresh.load_state_dict(bad)
    assert not fresh.state


def test_an_8bit_state_dict_does_not_load_into_torch_adamw_as_moments():
    """8-bit codes were saved under torch's names (exp_avg, exp_avg_sq): torch's AdamW
    loaded them, cast the codes (0..255) to floats as moments, ignored the absmax
    values and stepped with them, silently. They have keys of their own now: torch's
    step finds no moments and raises, changing nothing; layerstream loads both the new
    layout and the old one (the codes under exp_avg) and continues alike."""
    p, opt = _stepped_adamw("8bit")
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd["state"][0]) == {"step", "exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax",
                                   "exp_avg_sq_absmax"}
    assert set(opt.state[p]) >= {"exp_avg", "exp_avg_sq"}  # the live states keep their names
    q = nn.Parameter(p.detach().clone())
    theirs = torch.optim.AdamW([q], lr=1e-2)
    theirs.load_state_dict(copy.deepcopy(sd))
    q.grad = torch.ones_like(q)
    with pytest.raises(KeyError, match="exp_avg"):
        theirs.step()
    assert torch.equal(q, p)
    old = copy.deepcopy(sd)
    old["state"][0] = {{"exp_avg_codes": "exp_avg", "exp_avg_sq_codes": "exp_avg_sq"}.get(k, k): v
                       for k, v in old["state"][0].items()}
    grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(9))
    for loaded in (sd, old):
        r = nn.Parameter(p.detach().clone())
        mine = AdamW([r], lr=1e-2, state_precision="8bit")
        mine.load_state_dict(copy.deepcopy(loaded))
        for k in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
            assert torch.equal(mine.state[r][k], opt.state[p][k]), k
        assert mine.state_dict()["state"][0].keys() == sd["state"][0].keys()
        r.grad = grad
        mine.step()
        assert not torch.equal(r, p)
    _, fp32 = _stepped_adamw("fp32")
    assert set(fp32.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}  # torch's own names


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, maximize=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),  # L2 added to the gradient, not AdamW's
], ids=["maximize", "amsgrad", "adam-coupled-weight-decay"])
def test_a_torch_state_dict_with_options_it_lacks_is_refused_before_anything_loads(make):
    """maximize / amsgrad / Adam's coupled weight decay in a loaded state dict (or a
    param-group dict) were kept in the group and ignored by the step: the run went on
    minimizing (maximize) or without the max of the second moments, with no word."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(8))
    ref = make([p])
    p.grad = torch.randn(8)
    ref.step()
    q = nn.Parameter(p.detach().clone())
    opt = AdamW([q], lr=1e-3)
    with pytest.raises(ValueError, match=r"param group 0 of the state dict turns on .*does not implement"):
        opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["lr"] == 1e-3 and "maximize" not in opt.param_groups[0] and not opt.state
    with pytest.raises(ValueError, match=r"param group 1 turns on maximize"):
        AdamW([{"params": [q]}, {"params": [nn.Parameter(torch.randn(2))], "maximize": True}])
    plain = torch.optim.Adam([p], lr=1e-2)  # no weight decay: the same step as AdamW's without it
    plain.step()
    AdamW([q]).load_state_dict(plain.state_dict())


def test_adafactor_refuses_maximize():
    """torch.optim.Adafactor(maximize=True) ascends; ours minimized with the group's
    maximize=True, silently."""
    p = nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match="param group 0 turns on maximize"):
        Adafactor([{"params": [p], "maximize": True}], lr=1e-2, relative_step=False)
    opt = Adafactor([p], lr=1e-2, relative_step=False)
    opt.param_groups[0]["maximize"] = True
    p.grad = torch.ones(4)
    with pytest.raises(ValueError, match="param group 0 turns on maximize"):
        opt.step()
    assert torch.equal(p, torch.ones(4))


@pytest.mark.parametrize("key", ["amsgrad", "maximize"])
def test_an_option_it_lacks_set_through_param_groups_later_is_refused_at_the_step(key, offload_sim):
    """opt.param_groups[0]["amsgrad"] = True after construction (a config loader, a
    trainer copying torch's group keys) was ignored: every step went on without it,
    silently. step() and overlap() refuse it as add_param_group() does, before
    anything is stepped or counted."""
    model = Deep()
    handle = offload_sim(model)
    opt = AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    model(x).square().mean().backward()
    opt.param_groups[0][key] = True
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=f"param group 0 turns on {key}"):
        opt.step()
    with pytest.raises(ValueError, match=f"param group 0 turns on {key}"):
        with opt.overlap(handle):
            pass
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and not opt.state
    opt.param_groups[0][key] = False
    opt.step()
    assert all(int(opt.state[p]["step"]) == 1 for p in model.parameters())


# ---------------------------------------------------------------- bf16 and 8-bit
def test_bf16_stochastic_rounding_is_unbiased():
    """bf16 weights at 1.0, a constant gradient, an update of 1/40 of a bf16 ulp
    per step: after 100 steps the mean weight equals the fp32 trajectory.
    Each weight is the sum of 100 independent roundings of variance <= ulp^2/4
    (ulp <= 2^-7 near 1), so the mean over n = 65536 weights has a standard
    deviation <= 2^-8 * sqrt(100 / 65536) = 1.5e-4; the bound is 5 sigma.
    Rounding to nearest (torch.optim.AdamW on bf16) never moves them."""
    n, steps, lr = 65536, 100, 2e-4
    p16 = nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    p32 = nn.Parameter(torch.ones(n))
    rn = nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opts = [AdamW([p16], lr=lr, weight_decay=0.0, seed=1), torch.optim.AdamW([p32], lr=lr, weight_decay=0.0),
            torch.optim.AdamW([rn], lr=lr, weight_decay=0.0)]
    for _ in range(steps):
        for p, o in zip((p16, p32, rn), opts):
            p.grad = torch.full_like(p, 0.5)
            o.step()
    mean16 = p16.detach().double().mean().item()
    mean32 = p32.detach().double().mean().item()
    assert mean32 < 1 - 0.019  # it moved by 100 * lr
    assert abs(mean16 - mean32) < 5 * 1.5e-4, (mean16, mean32)
    assert torch.all(rn == 1.0)


def _train_loss(precision, dtype, steps=60):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).to(dtype)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(256, 16, generator=gen)
    y = torch.sin(x.sum(1, keepdim=True))
    opt = AdamW(model.parameters(), lr=3e-3, state_precision=precision, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        loss = (model(x.to(dtype)).float() - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_bf16_and_8bit_states_train_like_fp32():
    """A small regression model, 60 full-batch steps (the loss falls 20x): at
    every step the loss of bf16 weights + bf16 states (stochastic rounding),
    and of 8-bit states, is within 10% + 1e-3 of fp32's."""
    ref = _train_loss("fp32", torch.float32)
    bf16 = _train_loss("bf16", torch.bfloat16)
    q8 = _train_loss("8bit", torch.float32)
    assert ref[-1] < ref[0] / 15
    for name, got in (("bf16", bf16), ("8bit", q8)):
        for step, (a, b) in enumerate(zip(got, ref)):
            assert abs(a - b) <= 0.1 * b + 1e-3, (name, step, a, b)


def test_state_bytes_per_precision():
    p = nn.Parameter(torch.zeros(1000))
    p.grad = torch.ones(1000)
    for precision, per_elem in (("fp32", 8), ("bf16", 4), ("8bit", 2)):
        opt = AdamW([p], state_precision=precision)
        opt.step()
        st = opt.state[p]
        nbytes = sum(t.numel() * t.element_size() for k, t in st.items() if k != "step")
        blocks = math.ceil(1000 / layerstream._C.optim_q8_block())
        assert nbytes == 1000 * per_elem + (8 * blocks if precision == "8bit" else 0), precision


@pytest.mark.parametrize("spec,make", [
    ("adamw", lambda ps: AdamW(ps)), ("adamw-bf16", lambda ps: AdamW(ps, state_precision="bf16")),
    ("adamw-8bit", lambda ps: AdamW(ps, state_precision="8bit")), ("adafactor", lambda ps: Adafactor(ps)),
    ("adafactor-beta1", lambda ps: Adafactor(ps, beta1=0.9)),
    ("8", lambda ps: torch.optim.AdamW(ps)), ("grads", lambda ps: torch.optim.SGD(ps, lr=0.1)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_train_bytes_are_what_the_optimizers_allocate(spec, make, dtype):
    """offload(train=spec) budgets, per trainable tensor, what its gradient and its
    optimizer's states take (core/optim/optim.h train_bytes); here measured on the
    tensors the optimizers hold after a step, for 1-D to 3-D shapes ("8": torch's
    AdamW on fp32 weights; its states take the weight's dtype, so 4 on bf16)."""
    if spec == "8" and dtype == torch.bfloat16:
        spec = "4"
    ps = [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in ((300,), (7, 40), (3, 5, 20))]
    for p in ps:
        p.grad = torch.ones_like(p)
    opt = make(ps)
    opt.step()
    for p in ps:
        held = sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k not in ("step", "RMS"))
        grad = p.grad.numel() * p.grad.element_size()
        assert layerstream._C.optim_train_bytes(spec, list(p.shape), p.element_size()) == grad + held, (spec, p.shape)


class _NormedStack(nn.Module):
    """Six Linear(256, 256) fp32 layers (257 KiB each) and a LayerNorm (always resident)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
        self.norm = nn.LayerNorm(256)

    def forward(self, x):
        return self.norm(self.layers(x))


def test_8bit_states_of_another_memory_layout_are_reencoded():
    """8-bit states keep a scale per block of consecutive elements in memory order. Loaded
    into a parameter of another layout (a checkpoint of a contiguous conv into a
    channels_last one), the codes were copied element by element and decoded with other
    blocks' scales: the moments silently wrong (weight moves 0.77x to 1.3x what they
    should be); then refused. Now decoded in their own order and encoded in the
    parameter's: each moment within the codes' rounding of what was saved. Float
    states and the same layout load as they are."""
    def net(channels_last):
        torch.manual_seed(0)
        m = nn.Conv2d(16, 32, 3, padding=1)
        return m.to(memory_format=torch.channels_last) if channels_last else m

    for precision in ("8bit", "fp32"):
        model = net(False)
        opt = AdamW(model.parameters(), lr=1e-2, state_precision=precision)
        model(torch.randn(2, 16, 8, 8)).square().mean().backward()
        opt.step()
        saved = copy.deepcopy(opt.state_dict())
        for channels_last in (False, True):
            other = net(channels_last)
            loads = AdamW(other.parameters(), lr=1e-2, state_precision=precision)
            loads.load_state_dict(copy.deepcopy(saved))
            state = loads.state[other.weight]
            if precision == "8bit" and channels_last:
                assert state["exp_avg"].is_contiguous(memory_format=torch.channels_last)
                for got, want in zip(_q8_values(loads, other.weight)[:2], _q8_values(opt, model.weight)[:2]):
                    _near_codes(got, want, "channels_last")
            else:
                assert torch.equal(state["exp_avg"], opt.state[model.weight]["exp_avg"])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_train_budget_covers_the_resident_weights_gradients_and_states(offload_sim, precision):
    """offload(budget, train="adamw"): 3 MiB holds all six layers as weights, but
    with their gradients and AdamW states (4x the weight in fp32) only two stay
    resident beside the 3 slots; after full fine-tuning steps, the gradients and
    states layerstream.optim holds for the resident parameters are the plan's
    train_bytes, and everything the plan counts stays within the budget."""
    torch.manual_seed(0)
    frozen_plan = offload_sim(_NormedStack(), budget="3MiB")._plan
    assert len(frozen_plan["resident"]) == 6 and frozen_plan["train_bytes"] == 0
    model = _NormedStack()
    spec = "adamw" if precision == "fp32" else "adamw-bf16"
    handle = offload_sim(model, budget="3MiB", train=spec)
    plan = handle._plan
    assert plan["resident"] == ["layers.0", "layers.1"], plan["explain"]
    opt = AdamW(model.parameters(), lr=1e-3, state_precision=precision)
    for _ in range(2):
        model(torch.randn(4, 256)).square().mean().backward()
        opt.step()
    streamed = {id(p) for a in handle._attached for p in a.module.parameters()}
    on_device = [p for p in model.parameters() if id(p) not in streamed]
    assert len(on_device) == 2 * 2 + 2  # two resident layers' weight and bias, the norm's
    held = sum(p.grad.numel() * p.grad.element_size()
               + sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k != "step")
               for p in on_device)
    assert held == plan["train_bytes"]
    assert plan["device_bytes"] == (plan["resident_bytes"] + plan["fixed_resident_bytes"] + plan["train_bytes"]
                                    + plan["num_slots"] * plan["slot_bytes"])
    assert plan["device_bytes"] <= 3 * 2**20
    assert "+ gradients and optimizer states " in handle.plan
    # A training step's copies: the streamed weights cross again in the backward (the plan said
    # an inference pass's copies).
    assert "per step, training)" in handle.plan and "per step, training)" not in offload_sim(
        _NormedStack(), budget="1MiB").plan
    assert "gradients" not in frozen_plan["explain"]


@pytest.mark.parametrize("make,spec", [(lambda ps: AdamW(ps), "adamw-fp32"),
                                       (lambda ps: AdamW(ps, state_precision="bf16"), "adamw-bf16"),
                                       (lambda ps: Adafactor(ps, beta1=0.9), "adafactor-beta1")])
def test_a_budget_that_did_not_count_training_is_named_once(make, spec):
    """offload(budget=...) without train= kept trainable layers on the device: the
    optimizer's first step says once how much their gradients and states take beyond
    the budget and what to pass; with train=, after detach(), or for frozen layers, nothing."""
    import warnings

    def first_steps(model, opt):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(2):
                model(torch.randn(4, 256)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        return [str(x.message) for x in w if "beyond the budget" in str(x.message)]

    model = _NormedStack()
    handle = layerstream.offload(model, device="sim", budget="3MiB")  # every layer resident
    opt = make(list(model.parameters()))
    said = first_steps(model, opt)
    assert len(said) == 1, said
    held = sum(p.grad.numel() * p.grad.element_size() if p.grad is not None else p.numel() * p.element_size()
               for p in model.parameters())
    held += sum(t.numel() * t.element_size() for p in model.parameters()
                for k, t in opt.state[p].items() if k not in ("step", "RMS"))
    assert f"{len(list(model.parameters()))} parameter(s)" in said[0]
    assert f"take {held / 2**20:.2f} MiB beyond the budget" in said[0]
    assert f"offload(..., train={spec!r})" in said[0]
    handle.detach()
    assert first_steps(model, make(list(model.parameters()))) == []  # detached: no budget any more
    counted = _NormedStack()
    layerstream.offload(counted, device="sim", budget="3MiB", train=spec)
    assert first_steps(counted, make(list(counted.parameters()))) == []
    frozen = _NormedStack()
    frozen.layers.requires_grad_(False)
    layerstream.offload(frozen, device="sim", budget="3MiB")  # the handle dropped: the plan still holds
    assert not any(layerstream._C.optim_uncounted(p) for p in frozen.layers.parameters())  # frozen: nothing to train
    assert len(first_steps(frozen, make(list(frozen.norm.parameters())))) == 1  # the norm trains on the device


def test_train_needs_a_budget_and_a_known_footprint():
    model = _NormedStack()
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match="needs budget= too"):
        layerstream.offload(model, device="sim", train="adamw")
    with pytest.raises(ValueError, match="train='sgd' is not a training footprint: use 'grads'"):
        layerstream.offload(model, device="sim", budget="3MiB", train="sgd")
    assert [p.data_ptr() for p in model.parameters()] == before  # nothing changed
    assert not any(hasattr(m, "_layerstream_handle") for m in model.modules())
    # True: gradients only; a number: gradients and that many state bytes per parameter.
    grads = layerstream.offload(_NormedStack(), device="sim", budget="3MiB", train=True)._plan
    eight = layerstream.offload(_NormedStack(), device="sim", budget="3MiB", train=8)._plan
    adamw = layerstream.offload(_NormedStack(), device="sim", budget="3MiB", train="adamw")._plan
    assert len(grads["resident"]) > len(adamw["resident"]) and eight["train_bytes"] == adamw["train_bytes"]


def test_every_train_name_the_optimizers_suggest_is_documented():
    """The first step's warning suggests offload(..., train=NAME) with the optimizers' canonical
    names; offload() accepts 'adamw-fp32' (the same bytes as 'adamw'), but README's train= list
    and offload()'s docstring did not name it. Every suggested name is in both."""
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    listed = readme[readme.index("* `offload(..., train=...)` sizes the budget"):]
    listed = listed[:listed.index("\n* ")]
    names = [AdamW._train_spec({"state_precision": p}) for p in ("fp32", "bf16", "8bit")]
    names += [Adafactor._train_spec({"beta1": b}) for b in (None, 0.9)]
    for name in names:
        assert f'"{name}"' in listed, name
        assert f'"{name}"' in layerstream.offload.__doc__, name
    fp32 = layerstream.offload(_NormedStack(), device="sim", budget="3MiB", train="adamw-fp32")._plan
    adamw = layerstream.offload(_NormedStack(), device="sim", budget="3MiB", train="adamw")._plan
    assert (fp32["resident"], fp32["train_bytes"]) == (adamw["resident"], adamw["train_bytes"])


# ---------------------------------------------------------------- Adafactor
@pytest.mark.parametrize("kw", [
    {},
    {"lr": 1e-2, "relative_step": False, "beta1": 0.9, "weight_decay": 0.01},
    {"lr": 5e-3, "relative_step": False, "scale_parameter": False, "clip_threshold": 0.5},
    {"warmup_init": True},
], ids=["default", "lr-beta1-wd", "no-scale", "warmup"])
def test_adafactor_matches_transformers(kw):
    from transformers.optimization import Adafactor as Reference

    torch.manual_seed(0)
    params = [torch.randn(24, 40), torch.randn(40), torch.randn(3, 7, 9)]  # 2-D, 1-D, 3-D
    ours = [nn.Parameter(p.clone()) for p in params]
    theirs = [nn.Parameter(p.clone()) for p in params]
    opt, ref = Adafactor(ours, **kw), Reference(theirs, **kw)
    gen = torch.Generator().manual_seed(9)
    for _ in range(10):
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape, generator=gen) * 0.1
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert_rel_close(a, b, rel=1e-5, what=f"param {i}")
        sa, sb = opt.state[a], ref.state[b]
        assert sa["step"] == sb["step"] == 10
        for key in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg"):
            assert (key in sa) == (key in sb), key
            if key in sa:
                assert_rel_close(sa[key], sb[key], rel=1e-5, what=key)
        assert float(sa["RMS"]) == pytest.approx(float(sb["RMS"]), rel=1e-6)


@pytest.mark.parametrize("kw", [
    {},
    {"lr": 1e-2, "relative_step": False, "beta1": 0.9, "weight_decay": 0.01},
    {"lr": 5e-3, "relative_step": False, "scale_parameter": False, "clip_threshold": 0.5, "weight_decay": 0.1},
], ids=["default", "lr-beta1-wd", "no-scale-wd"])
def test_adafactor_on_bf16_parameters_matches_transformers(kw):
    """bf16 parameters on the host, stepped by the host kernel (stochastic rounding):
    transformers' Adafactor on fp32 copies of them, fed the same bf16 gradients, to a
    rounding per step. Only fp32 parameters were compared on the host (bf16 ones only
    through the device path, optim_adafactor_step_torch), so a host kernel that never
    wrote bf16 parameters back passed every test."""
    from transformers.optimization import Adafactor as Reference

    torch.manual_seed(0)
    params = [torch.randn(96, 80), torch.randn(80), torch.randn(3, 20, 24)]  # 2-D, 1-D, 3-D
    ours = [nn.Parameter(p.bfloat16()) for p in params]
    theirs = [nn.Parameter(p.bfloat16().float()) for p in params]
    opt, ref = Adafactor(ours, seed=2, **kw), Reference(theirs, **kw)
    gen = torch.Generator().manual_seed(9)
    steps = 10
    peak = torch.cat([b.detach().double().abs().flatten() for b in theirs])  # largest |w| on the way
    for _ in range(steps):
        for a, b in zip(ours, theirs):
            g = (torch.randn(a.shape, generator=gen) * 0.1).bfloat16()
            a.grad, b.grad = g, g.float()
        opt.step()
        ref.step()
        peak = torch.maximum(peak, torch.cat([b.detach().double().abs().flatten() for b in theirs]))
    assert all(p.dtype == torch.bfloat16 for p in ours)
    got = torch.cat([a.detach().double().flatten() for a in ours])
    want = torch.cat([b.detach().double().flatten() for b in theirs])
    err = got - want
    # Each step rounds a weight once, by less than one bf16 ulp (stochastic rounding), and
    # the update hardly depends on the weight (through its RMS and the decay): within
    # `steps` ulps at the largest magnitude on the way (10% over the reference's, for our
    # own weight's distance from it).
    tol = steps * _bf16_ulp(1.1 * peak)
    worst = (err.abs() / tol).argmax()
    assert err.abs()[worst] <= tol[worst], (worst.item(), got[worst].item(), want[worst].item())
    # The roundings are unbiased and do not depend on the weight's sign, the decay pulls
    # every weight towards zero: the mean error along sign(w) is zero to 5 standard errors
    # (steps without the decay leave it at 2x that bound for wd=0.01, 10x for wd=0.1).
    along = err * want.sign()
    bound = 5 * along.std().item() / math.sqrt(along.numel())
    assert abs(along.mean().item()) <= bound, (along.mean().item(), bound)


def test_adafactor_leaves_a_parameter_of_zero_elements_as_transformers_does():
    """A (0, 4) parameter beside others: the step raised "factored states ... do not
    match its shape" (transformers' Adafactor steps past it)."""
    from transformers.optimization import Adafactor as Reference

    torch.manual_seed(0)
    params = [torch.zeros(0, 4), torch.zeros(0), torch.randn(6, 5), torch.randn(3)]
    ours = [nn.Parameter(p.clone()) for p in params]
    theirs = [nn.Parameter(p.clone()) for p in params]
    opt, ref = Adafactor(ours, lr=1e-2, relative_step=False), Reference(theirs, lr=1e-2, relative_step=False)
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape
        if a.numel():
            assert_rel_close(a, b, rel=1e-5, what=f"param {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [
    {},
    {"lr": 1e-2, "relative_step": False, "beta1": 0.9, "weight_decay": 0.01},
    {"lr": 5e-3, "relative_step": False, "scale_parameter": False, "clip_threshold": 0.5, "weight_decay": 0.1},
], ids=["default", "lr-beta1-wd", "no-scale-wd"])
def test_adafactor_off_the_host_matches_transformers(kw, dtype):
    """Parameters off the host (resident layers on a GPU) are stepped by torch's tensor
    arithmetic on their device (optim_adafactor_step_torch); run here on the host, it
    equals transformers' Adafactor, bf16 parameters rounded to nearest as transformers
    rounds them, and a clip's gradient scale as gradients scaled before the step."""
    from transformers.optimization import Adafactor as Reference

    torch.manual_seed(0)
    params = [torch.randn(24, 40).to(dtype), torch.randn(40).to(dtype), torch.randn(3, 7, 9).to(dtype)]
    ours = [p.clone() for p in params]
    theirs = [nn.Parameter(p.clone()) for p in params]
    ref = Reference(theirs, **kw)
    cfg = Adafactor._config(Adafactor([nn.Parameter(torch.zeros(1))], **kw).param_groups[0])
    first = ref.defaults["beta1"] is not None
    states = [layerstream._C.optim_adafactor_init_states(p, first) for p in ours]
    gen = torch.Generator().manual_seed(9)
    for step in range(1, 11):
        scale = 0.5 if step % 3 == 0 else 1.0  # a clip on some steps
        rms = []
        for a, b, st in zip(ours, theirs, states):
            g = (torch.randn(a.shape, generator=gen) * 0.1).to(dtype)
            b.grad = (g.float() * scale).to(dtype) if scale != 1.0 else g.clone()
            rms.append(layerstream._C.optim_adafactor_step_torch(*cfg, a, g, *st, step, scale))
        ref.step()
        for r, b in zip(rms, theirs):
            assert r == pytest.approx(float(ref.state[b]["RMS"]), rel=1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: within a rounding of each other
    for i, (a, b, st) in enumerate(zip(ours, theirs, states)):
        assert a.dtype == dtype
        assert_rel_close(a.float(), b.detach().float(), rel=tol, what=f"param {i}")
        names = ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg")
        for key, t in zip(names, st):
            assert (t is not None) == (key in ref.state[b]), key
            if t is not None:
                assert_rel_close(t, ref.state[b][key], rel=1e-4 if dtype == torch.bfloat16 else 1e-5, what=key)


@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_adamw_off_the_host_matches_torch(dtype, state_dtype):
    """AdamW's arithmetic for parameters off the host (optim_adamw_step_torch), run on
    the host: torch.optim.AdamW's single-tensor path, a clip's scale included, in fp32;
    a bf16 parameter (and gradient) and bf16 states through fp32 copies, rounded to
    nearest each step (torch's reference keeps everything in fp32 here)."""
    torch.manual_seed(0)
    p = torch.randn(30, 20).to(dtype)
    ref_p = nn.Parameter(p.float())
    ref = torch.optim.AdamW([ref_p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, foreach=False)
    m, v = torch.zeros(p.shape, dtype=state_dtype), torch.zeros(p.shape, dtype=state_dtype)
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 8):
        scale = 0.25 if step % 2 == 0 else 1.0
        g = torch.randn(p.shape, generator=gen).to(dtype)
        ref_p.grad = g.float() * scale
        ref.step()
        layerstream._C.optim_adamw_step_torch(1e-2, 0.9, 0.99, 1e-8, 0.05, p, g, m, v, step, scale)
    assert p.dtype == dtype and m.dtype == v.dtype == state_dtype
    exact = dtype == state_dtype == torch.float32
    assert_rel_close(p.float(), ref_p.detach(), rel=1e-6 if exact else 1e-2, what="param")
    st = ref.state[ref_p]
    assert_rel_close(m.float(), st["exp_avg"], rel=1e-6 if state_dtype == torch.float32 else 1e-2, what="exp_avg")
    assert_rel_close(v.float(), st["exp_avg_sq"], rel=1e-6 if state_dtype == torch.float32 else 1e-2,
                     what="exp_avg_sq")

def test_adafactor_state_dict_round_trip():
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(16, 8))
    b = nn.Parameter(a.detach().clone())
    opt_a, opt_b = Adafactor([a], beta1=0.9), Adafactor([b], beta1=0.9)
    for step in range(6):
        g = torch.randn(16, 8)
        if step == 3:
            sd = copy.deepcopy(opt_b.state_dict())
            opt_b = Adafactor([b], beta1=0.9)
            opt_b.load_state_dict(sd)
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert torch.equal(a, b)


# ---------------------------------------------------------------- NaN / Inf, misuse
@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_nan_and_inf_gradients_behave_like_torch(max_norm):
    """A NaN and an Inf gradient element: the same NaN pattern and the same
    finite values as clip_grad_norm_ (optional) + torch.optim.AdamW; no error."""
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(300))
    b = nn.Parameter(a.detach().clone())
    opt, ref = AdamW([a], lr=1e-2, max_grad_norm=max_norm), torch.optim.AdamW([b], lr=1e-2)
    for step in range(3):
        g = torch.randn(300)
        if step == 1:
            g[5], g[9] = float("nan"), float("inf")
        a.grad, b.grad = g.clone(), g.clone()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_([b], max_norm)
        opt.step()
        ref.step()
    assert torch.equal(a.isnan(), b.isnan())
    if max_norm is None:  # only the poisoned elements
        assert a[5].isnan() and a[9].isnan() and a.isnan().sum() == 2
        ok = ~b.isnan()
        assert_rel_close(a[ok], b[ok])
    else:  # the total norm is NaN: clip_grad_norm_ multiplies every gradient by NaN
        assert a.isnan().all()


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_nan_gradients_with_narrow_states_do_not_crash(precision):
    p = nn.Parameter(torch.randn(600))
    opt = AdamW([p], state_precision=precision)
    p.grad = torch.randn(600)
    p.grad[300] = float("nan")
    opt.step()
    assert p[300].isnan()
    if precision == "8bit":
        # the state block of the NaN (elements 256..511) reads as NaN: the next
        # step poisons that block only
        p.grad = torch.randn(600)
        opt.step()
        assert p[256:512].isnan().all() and not p[:256].isnan().any() and not p[512:].isnan().any()


def test_sparse_gradients_are_refused():
    """Refused naming the parameter's place in its group (it named its index among
    the parameters with a gradient: 0 here, behind a frozen one)."""
    frozen = nn.Parameter(torch.zeros(3), requires_grad=False)
    emb = nn.Embedding(10, 4, sparse=True)
    opt = AdamW([frozen, emb.weight])
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=r"layerstream.optim: parameter 1 of param group 0 has a sparse "
                                           r"gradient.*nn.Embedding\(sparse=False\).*SparseAdam"):
        opt.step()


@pytest.mark.parametrize("make,bad", [
    (lambda ps: AdamW(ps, lr=1e-2), {"lr": -1.0}),
    (lambda ps: AdamW(ps, lr=1e-2), {"betas": (1.5, 0.9)}),
    (lambda ps: Adafactor(ps, lr=1e-2, relative_step=False, scale_parameter=False), {"lr": -1.0}),
], ids=["adamw-lr", "adamw-betas", "adafactor-lr"])
def test_a_refused_step_counts_nothing_and_the_next_steps_equal_a_fresh_optimizers(make, bad):
    """A step() refused by a bad hyperparameter set through param_groups (a scheduler
    bug) advanced every parameter's step count before the kernel refused: the bias
    correction of every later step was off by one (AdamW differed from torch by ~5e-3).
    Now it counts nothing and keeps no state it made; fixed, training goes on exactly as
    an optimizer that never saw the refused step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    twin = copy.deepcopy(model)
    opt, ref = make(model.parameters()), make(twin.parameters())
    x = torch.randn(4, 8)
    good = {k: opt.param_groups[0][k] for k in bad}
    opt.param_groups[0].update(bad)
    model(x).square().mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((layerstream.LayerstreamError, ValueError)):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(len(opt.state[p]) == 0 for p in model.parameters())
    opt.param_groups[0].update(good)
    opt.zero_grad()
    for _ in range(3):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        assert float(opt.state[p]["step"]) == float(ref.state[q]["step"]) == 3


@pytest.mark.parametrize("cls", [AdamW, Adafactor])
def test_a_parameter_listed_twice_in_a_group_is_refused(cls):
    """torch.optim warns (and will refuse); the host kernels stepped such a tensor twice in
    one call with one count: numbers of neither one step nor torch's two."""
    lin = nn.Linear(4, 4)
    make = AdamW if cls is AdamW else lambda ps: Adafactor(ps, lr=1e-2, relative_step=False)
    with pytest.raises(ValueError, match="lists a parameter more than once"):
        make([lin.weight, lin.bias, lin.weight])
    opt = make([lin.weight])
    with pytest.raises(ValueError, match="param group 1 lists a parameter more than once"):
        opt.add_param_group({"params": [lin.bias, lin.bias]})
    with pytest.raises(TypeError, match="param group 1: its parameters are a set"):
        opt.add_param_group({"params": {lin.bias}})  # (torch refuses a set: its order changes between runs)
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", [AdamW, Adafactor])
@pytest.mark.parametrize("bad", ["shape", "option"])
def test_a_refused_load_state_dict_changes_nothing(cls, bad):
    """Another run's checkpoint with one state of another shape (or a group option this
    optimizer refuses) was refused after torch's load had replaced the groups and the
    states: lr and the first parameters' moments were the checkpoint's, the rest gone,
    and the next step trained on that mix, silently (or died on internal wrappers)."""
    make = ((lambda ps, lr: AdamW(ps, lr=lr)) if cls is AdamW else
            (lambda ps, lr: Adafactor(ps, lr=lr, relative_step=False, scale_parameter=False)))
    gen = torch.Generator().manual_seed(0)
    a, b = nn.Parameter(torch.randn(4, 4, generator=gen)), nn.Parameter(torch.randn(3, 2, generator=gen))
    opt = make([a, b], 1e-2)
    a2, b2 = nn.Parameter(torch.randn(4, 4, generator=gen)), nn.Parameter(torch.randn(5 if bad == "shape" else 3, 2,
                                                                                        generator=gen))
    other = make([a2, b2], 5e-4)
    for o, ps, n in ((opt, (a, b), 3), (other, (a2, b2), 7)):
        for _ in range(n):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            o.step()
    saved = copy.deepcopy(opt.state_dict())
    theirs = other.state_dict()
    if bad == "option":
        theirs["param_groups"][0]["eps" if cls is AdamW else "beta1"] = -1.0 if cls is AdamW else 2.0
    with pytest.raises((ValueError, RuntimeError)):
        opt.load_state_dict(theirs)
    now = opt.state_dict()
    assert now["param_groups"] == saved["param_groups"]
    assert now["state"].keys() == saved["state"].keys()
    for i, st in saved["state"].items():
        assert now["state"][i].keys() == st.keys(), i
        for k, v in st.items():
            assert (torch.equal(now["state"][i][k], v) if isinstance(v, torch.Tensor) else now["state"][i][k] == v), k
    a.grad, b.grad = torch.ones(4, 4), torch.ones(3, 2)
    opt.step()  # steps the states it had


def test_grad_norm_sums_the_kernels_and_torch_parts():
    """The clip norm: fp32/bf16 host gradients by the kernels, the others (fp16 here, a
    device's on a GPU) by torch, summed per device in double: clip_grad_norm_'s total."""
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(300, generator=gen), torch.randn(7, 9, generator=gen).half(),
             torch.randn(50, generator=gen).bfloat16(), torch.randn(33, generator=gen).half()]
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
    assert layerstream._C.optim_grad_norm(grads) == pytest.approx(float(want), rel=1e-12)


def test_the_host_and_one_device_share_a_param_group():
    """An offloaded model's parameters in one group: streamed ones on the host, resident
    ones on its device ("meta" stands in for a GPU: torch's arithmetic runs there, without
    values). Two devices besides the host in one group are refused (C++ test
    OptimGroups.TheHostAndOneDeviceShareAGroupTwoDevicesDoNot: no second device here)."""
    cpu = nn.Parameter(torch.zeros(3))
    meta = nn.Parameter(torch.zeros(3, device="meta"))
    cpu.grad = torch.ones(3)
    meta.grad = torch.ones(3, device="meta")
    opt = AdamW([cpu, meta], lr=0.1, weight_decay=0.0)
    opt.step()
    torch.testing.assert_close(cpu.detach(), torch.full((3,), -0.1))  # AdamW's first step: -lr * sign(g)
    assert opt.state[meta]["exp_avg"].device.type == "meta" and opt.state[meta]["step"] == 1
    AdamW([meta], state_precision="bf16").step()  # bf16 states there too (through fp32)
    with pytest.raises(RuntimeError, match="8-bit states are the host kernels' only: put them in a param group"):
        AdamW([meta], state_precision="8bit").step()

def test_bad_arguments_are_value_errors():
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="Invalid learning rate"):
        AdamW(p, lr=-1)
    with pytest.raises(ValueError, match="beta parameter at index 1"):
        AdamW(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="'fp32', 'bf16' or '8bit'"):
        AdamW(p, state_precision="fp8")
    with pytest.raises(ValueError, match="max_grad_norm"):
        AdamW(p, max_grad_norm=0)
    with pytest.raises(ValueError, match="cannot combine a manual lr"):
        Adafactor(p, lr=1e-3)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        q = nn.Parameter(torch.zeros(2, dtype=torch.float64))
        q.grad = torch.ones(2, dtype=torch.float64)
        AdamW([q]).step()


# ---------------------------------------------------------------- overlap
class Deep(nn.Module):
    """Four streamed Linear layers (one used twice per forward) and a resident LayerNorm."""

    def __init__(self, d=16, twice=False, checkpoint=None):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(4))
        self.norm = nn.LayerNorm(d)
        self.twice = twice
        self.checkpoint = checkpoint  # None, "reentrant", "nonreentrant": layers 1 and 2 in one region

    def _middle(self, x):
        for layer in self.layers[1:3]:
            x = torch.tanh(layer(x))
        return x

    def forward(self, x):
        x = torch.tanh(self.layers[0](x))
        if self.checkpoint:
            from torch.utils.checkpoint import checkpoint
            x = checkpoint(self._middle, x, use_reentrant=self.checkpoint == "reentrant")
        else:
            x = torch.tanh(self.layers[1](x))
            if self.twice:
                x = torch.tanh(self.layers[1](x))
            x = torch.tanh(self.layers[2](x))
        x = torch.tanh(self.layers[3](x))
        return self.norm(x)


def _overlap_run(model, handle, steps, max_norm=None, overlap=True, k=3, speculation_bytes=None, seed=5,
                 precision="fp32", opt=None, keep_grads=False, fused=None, grads=None):
    """`steps` optimizer steps of `k` micro-batches each, the last backward under
    opt.overlap(handle) when `overlap`; returns per step the parameters the plan
    covered. `fused` collects the plan's fused_params, `grads` the .grad of every
    parameter after each step()."""
    if opt is None:
        opt = AdamW(model.parameters(), lr=1e-2, max_grad_norm=max_norm, state_precision=precision)
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    early = []
    for step in range(steps):
        for i in range(k):
            x = (torch.randn(4, 16, generator=gen) * (4.0 if step % 2 else 0.5)).to(dtype)
            loss = model(x).square().mean() / k
            if overlap and i == k - 1:
                with opt.overlap(handle, speculation_bytes=speculation_bytes, keep_grads=keep_grads) as plan:
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        early.append(getattr(opt, "last_overlap_params", 0))
        if fused is not None:
            fused.append(plan.fused_params)
        if grads is not None:
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.zero_grad()
    return early


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16"),
                                             (torch.float32, "8bit")])
@pytest.mark.parametrize("k", [1, 3])
def test_overlap_steps_layers_during_backward_with_the_same_result(offload_sim, dtype, precision, k):
    """No clipping: the last backward of k micro-batches steps every streamed
    layer (8 tensors) as its gradient lands, each in one fused pass over the
    landed gradient (plus .grad's earlier micro-batches when k = 3); the
    parameters are bit for bit those of the same optimizer stepped after
    backward (bf16 weights and states, 8-bit states: the same stochastic
    rounding streams; bf16 accumulation rounded as torch's add)."""
    model = Deep().to(dtype)
    ref = copy.deepcopy(model)
    fused = []
    early = _overlap_run(model, offload_sim(model), 5, precision=precision, k=k, fused=fused)
    _overlap_run(ref, offload_sim(ref), 5, overlap=False, precision=precision, k=k)
    assert early == [8] * 5
    assert fused == [8] * 5
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


# ---------------------------------------------------------------- weight decay with narrow weights or states
def _bf16_ulp(x):
    """One bf16 ulp at |x| (8 significant bits), elementwise."""
    e = torch.frexp(x.abs().double().clamp_min(2.0 ** -126))[1]
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - 8)


@pytest.mark.parametrize("dtype,precision", [(torch.bfloat16, "fp32"), (torch.bfloat16, "bf16"),
                                             (torch.float32, "bf16"), (torch.float32, "8bit"),
                                             (torch.bfloat16, "8bit")],
                         ids=["bf16-fp32states", "bf16-bf16states", "fp32-bf16states", "fp32-8bit", "bf16-8bit"])
@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap"])
def test_adamw_weight_decay_with_narrow_weights_or_states_matches_torch(offload_sim, dtype, precision, overlap):
    """weight_decay=0.1 on bf16 weights, bf16 states or 8-bit states, stepped after the
    backward or under overlap(): the weights follow torch.optim.AdamW (float64, fed the
    same gradients) to the roundings those formats add. The host kernels were compared
    with torch only for fp32 weights with fp32 states; the others against each other
    (overlap against step) or with weight_decay=0, so kernels that dropped the decay
    passed every test."""
    torch.manual_seed(0)
    model = Deep(d=64).to(dtype)
    ref = [nn.Parameter(p.detach().double()) for p in model.parameters()]
    handle = offload_sim(model)
    lr, wd, steps = 1e-2, 0.1, 6
    opt = AdamW(model.parameters(), lr=lr, weight_decay=wd, state_precision=precision, seed=3)
    ref_opt = torch.optim.AdamW(ref, lr=lr, weight_decay=wd, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(8, 64, generator=gen).to(dtype)).float().square().mean()
        with opt.overlap(handle, keep_grads=True) if overlap else contextlib.nullcontext():
            loss.backward()
        opt.step()
        for p, r in zip(model.parameters(), ref):
            r.grad = p.grad.double()  # the gradient the step used (kept under overlap)
        ref_opt.step()
        opt.zero_grad()
    if overlap:
        assert opt.last_overlap_params == 8
    got = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    want = torch.cat([r.detach().flatten() for r in ref])
    err = got - want
    # Elementwise: each step rounds a bf16 weight once, by less than one ulp (stochastic
    # rounding), at a magnitude below |w| + lr per step. Narrow states change the update
    # (about lr per step in size): bf16 states by their 8-bit mantissas (measured: under
    # 0.004 lr per step), 8-bit states by their 3-bit ones (under 0.09 lr); the bounds are
    # 5x and 3x those.
    tol = torch.full_like(want, steps * lr * {"fp32": 0.0, "bf16": 0.02, "8bit": 0.25}[precision])
    if dtype == torch.bfloat16:
        tol += steps * _bf16_ulp(want.abs() + steps * lr)
    worst = (err.abs() / tol).argmax()
    assert err.abs()[worst] <= tol[worst], (worst.item(), got[worst].item(), want[worst].item())
    # The decay itself: it pulls every weight towards zero by lr * wd * |w| per step,
    # 6e-3 |w| in all here, which the elementwise bound (several ulps) can hide. The
    # roundings and the narrow states' errors do not depend on the weight's sign and
    # average to zero, so the mean error along sign(w) is zero to 5 of its standard
    # errors; steps without the decay leave it at +6e-3 mean|w| (over 10x that bound).
    along = err * want.sign()
    bound = 5 * along.std().item() / math.sqrt(along.numel())
    assert abs(along.mean().item()) <= bound, (along.mean().item(), bound, lr * wd * steps * want.abs().mean().item())


@pytest.mark.parametrize("slots", [2, 3, 5])
def test_overlapped_steps_that_leave_the_trace_write_no_weight_a_copy_reads(offload_sim, slots):
    """Note [No copy in flight at a step's end] (csrc/core/scheduler.cpp): the first two
    steps' input needs a gradient, so the trace has the first layer's backward fetch;
    the later ones' does not, so they leave the trace there and a replayed prefetch of
    that layer may go untaken. The steps during the backward declare their writes to
    the checker (offload_sim asserts it saw no race), and so does the end of each
    backward; the parameters equal those of the same steps after the backward."""
    model = Deep()
    ref = copy.deepcopy(model)
    handles = [offload_sim(m, slots=slots, sim_link_gbps=0.05) for m in (model, ref)]
    opts = [AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        x = torch.randn(4, 16, generator=gen)
        for m, h, opt, overlap in zip((model, ref), handles, opts, (True, False)):
            xi = x.clone().requires_grad_(step < 2)
            with opt.overlap(h) if overlap else contextlib.nullcontext():
                m(xi).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert opts[0].last_overlap_params == 8
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("max_norm", [None, 0.75])
@pytest.mark.parametrize("keep_grads", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_overlap_consumes_gradients_unless_kept(offload_sim, max_norm, keep_grads, k):
    """The fused pass writes no .grad: after step() the streamed parameters the
    block stepped have none (the resident LayerNorm keeps its own), also when
    .grad held earlier micro-batches (it is not left half-summed). With
    keep_grads=True every .grad equals the plain backward's, bit for bit. The
    parameters are the plain step's either way."""
    model = Deep()
    ref = copy.deepcopy(model)
    got, want = [], []
    _overlap_run(model, offload_sim(model), 4, max_norm=max_norm, k=k, keep_grads=keep_grads, grads=got)
    _overlap_run(ref, offload_sim(ref), 4, max_norm=max_norm, k=k, overlap=False, grads=want)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    names = [n for n, _ in model.named_parameters()]
    for step_got, step_want in zip(got, want):
        for n, g, w in zip(names, step_got, step_want):
            if n.startswith("layers.") and not keep_grads:
                assert g is None, n
            else:
                assert torch.equal(g, w), n


_MAKERS = {"adamw": lambda ps: AdamW(ps, lr=1e-2),
           "adafactor": lambda ps: Adafactor(ps, lr=1e-2, relative_step=False, scale_parameter=False)}


class _Branchy(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, use_b):
        x = torch.tanh(self.a(x))
        return self.c(torch.tanh(self.b(x)) if use_b else x)


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_zero_grad_without_none_steps_layers_no_gradient_reached_as_a_plain_step_does(offload_sim, name):
    """opt.zero_grad(set_to_none=False): torch leaves zeros in .grad and its next step
    moves a parameter no gradient reached (a branch not taken; frozen since) from them.
    An overlapped step had dropped that .grad, so such a layer was no longer stepped
    (AdamW: 2 steps counted of 6, weights 8e-2 off), silently."""
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 16, generator=gen) for _ in range(6)]
    runs = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = _Branchy()
        handle = offload_sim(model)
        opt = _MAKERS[name](list(model.parameters()))
        for i, x in enumerate(xs):
            if i == 4:
                model.a.bias.requires_grad_(False)  # frozen later: torch steps it from its zeros
            loss = model(x, use_b=i < 2).square().mean()
            with opt.overlap(handle) if overlap else contextlib.nullcontext():
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        runs[overlap] = model, opt
        if overlap:
            assert model.b.weight.grad is None  # dropped, not kept: stepped from a zero made at the step
    (plain, popt), (over, oopt) = runs[False], runs[True]
    for (n, p), q in zip(plain.named_parameters(), over.parameters()):
        assert torch.equal(p, q), n
        assert int(popt.state[p]["step"]) == int(oopt.state[q]["step"]) == 6, n
    oopt.zero_grad()  # set_to_none: nothing is stepped from zeros any more
    before = over.b.weight.detach().clone()
    over(xs[0], use_b=False).square().mean().backward()
    oopt.step()
    assert torch.equal(over.b.weight, before) and int(oopt.state[over.b.weight]["step"]) == 6


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_two_backwards_inside_one_overlap_block_are_refused(offload_sim, name):
    """Both micro-batches' backwards inside one overlap() block: each layer was stepped
    when its first gradient landed and again at the second (AdamW counted two steps on
    halves of the gradient, Adafactor one on the second half), silently; later the
    second forward was refused only when the block ended, after it had copied weights
    the first backward's steps were writing (ThreadSanitizer saw the race). The second
    forward is refused now, at its first streamed layer; one backward per block steps
    as the plain optimizer does."""
    model = Deep()
    ref = copy.deepcopy(model)
    handle, _ = offload_sim(model), offload_sim(ref)
    opt, ropt = _MAKERS[name](list(model.parameters())), _MAKERS[name](list(ref.parameters()))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="layer 'layers.0' was called after a backward inside an overlapped "
                                           "optimizer step's block"):
        with opt.overlap(handle):
            model(x).square().mean().backward()
            model(x).square().mean().backward()
    opt.zero_grad()
    model.load_state_dict(ref.state_dict())
    opt, ropt = _MAKERS[name](list(model.parameters())), _MAKERS[name](list(ref.parameters()))
    model(x).square().mean().backward()
    with opt.overlap(handle):
        model(x).square().mean().backward()
    opt.step()
    for _ in range(2):
        ref(x).square().mean().backward()
    ropt.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_a_call_of_the_model_inside_an_overlap_block_after_its_backward_is_refused(offload_sim, name):
    """A validation pass under no_grad inside the block, after its backward, copied the
    streamed layers' weights while the hook's thread was stepping them: some layers
    computed with stepped weights, some with half-stepped ones, resident ones with the
    old (numbers no model computes). The engine refuses the call before reading; after
    the block and step(), the same pass runs and the step equals the plain one. A
    call inside the block before its backward stays allowed."""
    model = Deep()
    ref = copy.deepcopy(model)
    handle, _ = offload_sim(model), offload_sim(ref)
    opt, ropt = _MAKERS[name](list(model.parameters())), _MAKERS[name](list(ref.parameters()))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    with opt.overlap(handle):
        with torch.no_grad():
            before = model(x)  # before the backward: allowed
        model(x).square().mean().backward()
        with pytest.raises(RuntimeError, match="called after a backward inside an overlapped optimizer step's "
                                               "block .* Call the model before the backward or after the block"):
            with torch.no_grad():
                model(x)
    opt.step()
    with torch.no_grad():
        assert torch.equal(before, ref(x))
    ref(x).square().mean().backward()
    ropt.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))  # after step(): calls run again


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
@pytest.mark.parametrize("key", ["lr", "weight_decay"])
def test_a_hyperparameter_set_between_an_overlapped_backward_and_step_is_refused(offload_sim, name, key):
    """The streamed layers step during the backward with their groups' values of when
    the block was entered: a warmup setting lr (or anything those steps read) after the
    block would reach the resident parameters only. Set before the block, the step
    equals the plain one bit for bit; set after it, step() refuses, naming the group and
    both values, and the next overlapped step works."""
    model = Deep()
    ref = copy.deepcopy(model)
    handle, _ = offload_sim(model), offload_sim(ref)
    opt, ropt = _MAKERS[name](list(model.parameters())), _MAKERS[name](list(ref.parameters()))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    for o in (opt, ropt):
        o.param_groups[0][key] = 0.005
    with opt.overlap(handle):
        model(x).square().mean().backward()
    opt.step()
    ref(x).square().mean().backward()
    ropt.step()
    assert opt.last_overlap_params == 8
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    opt.zero_grad()
    with opt.overlap(handle):
        model(x).square().mean().backward()
    opt.param_groups[0][key] = 0.0025
    with pytest.raises(RuntimeError, match=rf"param group 0's {key} from 0.005 to 0.0025 after `with opt.overlap"):
        opt.step()
    opt.zero_grad()
    with opt.overlap(handle):
        model(x).square().mean().backward()
    opt.step()
    assert opt.last_overlap_params == 8


def test_kept_gradients_written_between_an_overlapped_backward_and_step_are_refused(offload_sim):
    """keep_grads=True lets a user read .grad after an overlapped backward, but the
    streamed layers were stepped with the gradients as they landed: a custom clip
    (clip_grad_norm_ writes every .grad in place, also when it does not clip) would
    reach the resident ones only. step() refuses it; reading (get_total_norm, of the
    scaled gradients) steps as without overlap. GradScaler.unscale_ (which torch's amp
    kernel does without moving the version counters) is refused by scaler.step(): the
    plan reads kept gradients in step() and unscales them itself, and they were
    divided twice (the weights off, silently)."""
    model = Deep()
    ref = copy.deepcopy(model)
    handle, _ = offload_sim(model), offload_sim(ref)
    opt, ropt = AdamW(model.parameters(), lr=1e-2), AdamW(ref.parameters(), lr=1e-2)
    scaler, rscaler = (torch.amp.GradScaler("cpu", init_scale=256.0) for _ in range(2))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    with opt.overlap(handle, keep_grads=True, grad_scaler=scaler):
        scaler.scale(model(x).square().mean()).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    scaler.step(opt)
    scaler.update()
    rscaler.scale(ref(x).square().mean()).backward()
    assert torch.equal(norm, torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    rscaler.step(ropt)
    rscaler.update()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    for speculation in (None, 0):  # stepped during the backward and re-read in step(), or only read there
        with opt.overlap(handle, keep_grads=True, grad_scaler=scaler, speculation_bytes=speculation):
            scaler.scale(model(x).square().mean()).backward()
        scaler.unscale_(opt)
        with pytest.raises(RuntimeError, match=r"scaler\.unscale_\(optimizer\) after an overlapped backward given "
                                               r"the GradScaler: .* Drop unscale_ here"):
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        for (n, p), b in zip(model.named_parameters(), before):
            assert torch.equal(p, b), n
    opt.zero_grad()
    with opt.overlap(handle, keep_grads=True):
        model(x).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # writes .grad (times 1.0)
    with pytest.raises(RuntimeError, match=r"the \.grad of 10 parameter\(s\) changed .* max_grad_norm="):
        opt.step()


@pytest.mark.filterwarnings("ignore:layerstream.optim.*kept on the device train there:RuntimeWarning")
@pytest.mark.parametrize("name", ["adamw", "adafactor"])
@pytest.mark.parametrize("resident", ["budget", "layernorm"])
def test_a_clip_between_an_overlapped_backward_and_step_is_refused(offload_sim, name, resident):
    """Without keep_grads the overlapped backward consumes the streamed layers' gradients
    (.grad None), so clip_grad_norm_(model.parameters()) between the block and step(),
    alone or in the AMP recipe (unscale_, clip, scaler.step), took the norm of the
    resident parameters only (a layer a budget kept, a LayerNorm) and scaled their .grad
    alone, the streamed layers stepped unclipped: before, silently. step() refuses it, as
    for kept gradients; the scaler's step without them is the plain backward's, and the
    refused AMP step leaves the model as it was (the scaler's speculation taken back)."""
    if resident == "budget":  # six Linear layers, the budget keeps one on the device
        layers = lambda: nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)])
        kw = dict(budget=5000)
    else:
        layers, kw = Deep, {}
    model = layers()
    ref = copy.deepcopy(model)
    handle = offload_sim(model, **kw)
    offload_sim(ref, **kw)
    if resident == "budget":
        assert handle.stats()["resident_layers"] == 1
    opt, ropt = _MAKERS[name](list(model.parameters())), _MAKERS[name](list(ref.parameters()))
    scaler, rscaler = (torch.amp.GradScaler("cpu", init_scale=256.0) for _ in range(2))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    with opt.overlap(handle, grad_scaler=scaler):
        scaler.scale(model(x).square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    rscaler.scale(ref(x).square().mean()).backward()
    rscaler.step(ropt)
    rscaler.update()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    refused = (r"the \.grad of {} parameter\(s\) changed .*\(without overlap\(keep_grads=True\) their \.grad is None, "
               r"so a clip there sees only the other parameters\)\. Clip with the optimizer's max_grad_norm=")
    opt.zero_grad()
    with opt.overlap(handle):
        model(x).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match=refused.format(2)):  # the resident layer's or LayerNorm's
        opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    with opt.overlap(handle, grad_scaler=scaler):
        scaler.scale(model(x).square().mean()).backward()
    # Adafactor under a scaler only takes the norms during the backward: every .grad is left
    left = sum(p.grad is not None for p in model.parameters())
    assert left == (2 if name == "adamw" else len(before))
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match=refused.format(left)):
        scaler.step(opt)
    for (n, p), b in zip(model.named_parameters(), before):
        assert torch.equal(p, b), n


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_a_backward_between_an_overlapped_backward_and_step_is_refused(offload_sim, name):
    """A forward and backward after the overlap block and before step(): the layers the
    block stepped skip step(), so the gradients it left in their .grad were dropped
    (before, silently; all streamed, nothing else changed to see), and the forward
    computed with half-stepped weights. The forward is refused (Note [No call between an
    overlapped backward and its step]); step() then steps as if nothing happened."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    opt, ref_opt = _MAKERS[name](list(model.parameters())), _MAKERS[name](list(ref.parameters()))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    with opt.overlap(handle):
        model(x).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"layer '0' was called between an overlapped backward .*step\(\) first"):
        model(x).square().mean().backward()
    opt.step()
    ref(x).square().mean().backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_the_uncounted_training_warning_points_at_the_users_step(offload_sim):
    """The once-per-optimizer warning about trainable parameters a budget kept on the
    device names the line that called step() (through torch.no_grad's wrapper)."""
    model = Deep()
    handle = offload_sim(model, budget="5KiB")
    assert handle.stats()["resident_layers"] == 4
    opt = AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).square().mean().backward()
    with pytest.warns(RuntimeWarning, match="kept on the device train there") as record:
        opt.step()
    assert [os.path.basename(w.filename) for w in record] == ["test_optim.py"]


@pytest.mark.parametrize("speculation_bytes", [None, 0, 2000])
def test_overlap_with_clipping_equals_clip_then_step(offload_sim, speculation_bytes):
    """max_grad_norm under overlap (speculate unclipped, restore and re-step when
    the clip triggers; 0 bytes: norms only; 2000 bytes: only some layers
    speculate) gives the bits of the same optimizer clipping and stepping after
    the backward (which test_adamw_fp32_matches_torch compares with
    clip_grad_norm_ + torch.optim.AdamW), with the clip active on some steps.
    (This model's saturated units have gradients near 0, which AdamW normalizes
    to +-lr: a 1-ulp difference upstream flips them, so it is compared with the
    same arithmetic, not with torch's.)"""
    model = Deep()
    ref = copy.deepcopy(model)
    fused = []
    early = _overlap_run(model, offload_sim(model), 6, max_norm=0.75, speculation_bytes=speculation_bytes,
                         fused=fused)
    assert fused == [8] * 6
    ref_opt = AdamW(ref.parameters(), lr=1e-2, max_grad_norm=0.75)
    gen = torch.Generator().manual_seed(5)
    clipped = []
    for step in range(6):
        for _ in range(3):
            x = torch.randn(4, 16, generator=gen) * (4.0 if step % 2 else 0.5)
            (ref(x).square().mean() / 3).backward()
        ref_opt.step()
        clipped.append(ref_opt.last_grad_norm > 0.75)
        ref_opt.zero_grad()
    assert any(clipped) and not all(clipped), clipped
    assert early == [8] * 6
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


def test_overlap_with_a_frozen_weight_and_a_trainable_bias(offload_sim):
    """A streamed layer whose weight is frozen stages only its bias's gradient: the
    fused pass steps the bias from it (7 tensors in all), with the plain step's bits."""
    model = Deep()
    model.layers[2].weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    fused = []
    early = _overlap_run(model, offload_sim(model), 3, fused=fused)
    _overlap_run(ref, offload_sim(ref), 3, overlap=False)
    assert early == [7] * 3 and fused == [7] * 3
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


def test_overlap_block_ends_with_every_layer_done(offload_sim):
    """The end of backward no longer waits for layers the hook consumes; the
    block's end does: right after it (before step()), with keep_grads=True,
    every streamed .grad holds the plain backward's gradient and every
    streamed parameter has been stepped."""
    model = Deep()
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    offload_sim(ref)
    opt = AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 16)
    before = [p.detach().clone() for p in model.layers.parameters()]
    with opt.overlap(handle, keep_grads=True):
        model(x).square().mean().backward()
    ref(x).square().mean().backward()
    for (n, p), q, b in zip(model.layers.named_parameters(), ref.layers.parameters(), before):
        assert torch.equal(p.grad, q.grad), n
        assert not torch.equal(p.detach(), b), n
    opt.step()
    assert opt.last_overlap_params == 8


def test_overlap_without_with_warns_and_steps_nothing_early(offload_sim):
    """opt.overlap(handle) on a line of its own reads like a setting but does
    nothing: it warns, and the backward after it steps no layer early."""
    model = Deep()
    handle = offload_sim(model)
    opt = AdamW(model.parameters(), lr=1e-2)
    with pytest.warns(RuntimeWarning, match="not entered"):
        opt.overlap(handle)
    before = [p.detach().clone() for p in model.layers.parameters()]
    model(torch.randn(4, 16)).square().mean().backward()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.layers.parameters(), before))


def test_overlap_waits_for_every_use_of_a_layer_used_twice(offload_sim):
    """A layer called twice in the forward is complete only after its second
    gradient of the backward: both uses are summed (in arrival order, as at
    the end of backward) into .grad by the engine and then stepped from there
    (its two tensors are not fused; the other six are); the result is unchanged."""
    model = Deep(twice=True)
    ref = copy.deepcopy(model)
    fused = []
    early = _overlap_run(model, offload_sim(model), 3, fused=fused)
    _overlap_run(ref, offload_sim(ref), 3, overlap=False)
    assert early == [8] * 3
    assert fused == [6] * 3
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("mode,early_tensors", [("nonreentrant", 8), ("reentrant", 4)])
def test_overlap_under_checkpointing(offload_sim, mode, early_tensors):
    """A checkpoint's recomputation in the backward is not a second use: with a
    non-reentrant checkpoint every layer still steps early. A reentrant
    checkpoint's layers run without a node in the forward and get their
    gradients in an inner backward: they are stepped in step(). Same bits."""
    model = Deep(checkpoint=mode)
    ref = copy.deepcopy(model)
    early = _overlap_run(model, offload_sim(model), 3)
    _overlap_run(ref, offload_sim(ref), 3, overlap=False)
    assert early == [early_tensors] * 3
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("max_norm", [None, 0.75])
def test_adafactor_overlap_equals_the_step_after_backward(offload_sim, max_norm):
    """Adafactor under overlap: without clipping each streamed layer is stepped as
    its gradient lands; with max_grad_norm only the norms are taken then and step()
    steps those layers, clipped. The same bits as stepping after the backward, and
    the same state (step counts, RMS)."""
    model = Deep()
    ref = copy.deepcopy(model)
    opt, ref_opt = (Adafactor(m.parameters(), max_grad_norm=max_norm) for m in (model, ref))
    early = _overlap_run(model, offload_sim(model), 4, opt=opt)
    _overlap_run(ref, offload_sim(ref), 4, overlap=False, opt=ref_opt)
    assert early == [8] * 4
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    for k in want:
        assert got[k]["step"] == want[k]["step"] == 4
        assert torch.equal(got[k]["RMS"], want[k]["RMS"])
    if max_norm is not None:
        assert opt.last_grad_norm == pytest.approx(ref_opt.last_grad_norm, rel=1e-6)


def _overlapped_backward_that_raises(model, handle, opt):
    """A backward under opt.overlap(handle) that raises at its very end (a hook on the
    input); returns the parameters as they were before it."""
    x = torch.randn(4, 16, requires_grad=True)
    x.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="boom"):
        with opt.overlap(handle):
            model(x).square().mean().backward()
    return before


def test_adafactor_overlap_backward_that_raises_counts_the_layers_it_stepped(offload_sim):
    """Without clipping, layers stepped before the backward raised stay stepped and their
    state counts that step; the others count none. Which layers the hook thread reached
    before the engine dropped the failed backward's gradients depends on timing: the
    test checks the invariant (changed <=> counted), then the bookkeeping with a plan
    whose status is given."""
    model = Deep()
    handle = offload_sim(model)
    opt = Adafactor(model.parameters())
    before = _overlapped_backward_that_raises(model, handle, opt)
    for p, b in zip(model.parameters(), before):
        assert (opt.state[p].get("step", 0) == 1) == (not torch.equal(p, b))

    class Plan:  # what AdafactorOverlap.wait() reports after abort()
        def wait(self):
            return [layerstream._C.OVERLAP_STEPPED, 0]

    a, b = model.layers[0].weight, model.layers[0].bias
    steps = [opt.state[a]["step"], opt.state[b]["step"]]
    opt._aborted(Plan(), [a, b])
    assert [opt.state[a]["step"], opt.state[b]["step"]] == [steps[0] + 1, steps[1]]


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_a_block_left_by_an_exception_after_its_backward_steps_each_layer_once(offload_sim, name):
    """overlap(keep_grads=True), a complete backward, then the user's own exception leaves
    the block: the layers stepped during the backward stay stepped, and their gradient
    stayed in .grad, so the step() that followed stepped them a second time (one lr step
    off). Their kept .grad goes at the abort (it was applied); step() steps the rest, and
    the result equals one plain step."""
    model = Deep()
    ref = copy.deepcopy(model)
    handle, _ = offload_sim(model), offload_sim(ref)
    opt, ropt = _MAKERS[name](list(model.parameters())), _MAKERS[name](list(ref.parameters()))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="the user's"):
        with opt.overlap(handle, keep_grads=True):
            model(x).square().mean().backward()
            raise ValueError("the user's own error")
    opt.step()
    ref(x).square().mean().backward()
    ropt.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_every_overlapped_backward_that_raises_is_counted_in_stats(offload_sim, max_norm):
    """stats()["failed_backwards"] counted a failed backward only when it had staged
    gradients left to drop: under overlap() without clipping, where the hook's thread had
    consumed (and stepped) them all, three failed backwards counted 1 or none. (The
    hook that raises waits first, so that the hook's thread has consumed them: counted
    either way, but without the wait the old count depended on that race.)"""
    import time
    model = Deep()
    handle = offload_sim(model)
    opt = AdamW(model.parameters(), lr=1e-2, max_grad_norm=max_norm)

    def late_boom(g):
        time.sleep(0.3)
        raise RuntimeError("boom")

    for n in range(1, 4):
        x = torch.randn(4, 16, requires_grad=True)
        x.register_hook(late_boom)
        with pytest.raises(RuntimeError, match="boom"):
            with opt.overlap(handle):
                model(x).square().mean().backward()
        opt.zero_grad()
        assert handle.stats()["failed_backwards"] == n
        model(torch.randn(4, 16)).square().mean().backward()  # a good step between them
        opt.step()
        opt.zero_grad()
    assert handle.stats()["failed_backwards"] == 3


def test_overlap_backward_that_raises_restores_speculated_layers(offload_sim):
    """With clipping, a backward that raises after some layers were stepped
    speculatively leaves every parameter as it was."""
    model = Deep()
    handle = offload_sim(model)
    opt = AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    before = _overlapped_backward_that_raises(model, handle, opt)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    assert all(s["step"].item() == 0 for s in opt.state.values())
    opt.zero_grad()
    model(torch.randn(4, 16)).square().mean().backward()  # usable afterwards
    opt.step()
    assert not torch.equal(model.layers[0].weight, before[0])


# ---------------------------------------------------------------- loss scaling (torch.amp.GradScaler)
def _scaled_run(model, opt, steps=8, handle=None, init_scale=2.0 ** 20, k=2, unscale_and_clip=None, din=16):
    """fp16 autocast with a GradScaler: `steps` steps of `k` micro-batches, the
    last backward under opt.overlap(handle, grad_scaler=) when a handle is given.
    The first steps overflow fp16 at this scale (skipped, the scale backs off),
    later ones do not. Returns the scale after each step."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)
    gen = torch.Generator().manual_seed(11)
    scales = []
    for step in range(steps):
        for i in range(k):
            x = torch.randn(4, din, generator=gen) * (8.0 if step % 3 == 1 else 1.0)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().square().mean() / k
            if handle is not None and i == k - 1:
                with opt.overlap(handle, grad_scaler=scaler):
                    scaler.scale(loss).backward()
            else:
                scaler.scale(loss).backward()
        if unscale_and_clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), unscale_and_clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def test_a_grad_scaler_steps_like_torch_and_skips_the_overflowing_steps(offload_sim):
    """GradScaler hands the host optimizer its scale (_step_supports_amp_scaling):
    the kernels unscale as they read, a step with an Inf/NaN gradient is
    skipped, and the scale backs off and grows as with torch.optim.AdamW on the
    resident model; the weights agree to AdamW's rounding. Also after the
    user's own scaler.unscale_() and clip_grad_norm_."""
    for clip in (None, 0.5):
        model, ref = Net(), Net()
        ref.load_state_dict(model.state_dict())
        before = [p.detach().clone() for p in model.parameters()]
        offload_sim(model)
        scales = _scaled_run(model, AdamW(model.parameters(), lr=1e-3), unscale_and_clip=clip, din=8)
        ref_scales = _scaled_run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), unscale_and_clip=clip, din=8)
        assert scales == ref_scales
        assert min(scales) < 2.0 ** 20 and scales[-1] > min(scales), scales  # skipped steps, then stepped ones
        for (n, p), q, b in zip(model.named_parameters(), ref.parameters(), before):
            assert not torch.equal(p, b), n
            assert_rel_close(p, q, what=f"clip={clip} {n}")


@pytest.mark.parametrize("opt_kind,max_norm,speculation_bytes", [
    ("adamw", None, None), ("adamw", 0.75, None), ("adamw", None, 0), ("adamw", 0.75, 2000),
    ("adafactor", None, None), ("adafactor", 0.75, None)])
def test_overlap_with_a_grad_scaler_equals_the_step_after_backward(offload_sim, opt_kind, max_norm,
                                                                   speculation_bytes):
    """opt.overlap(handle, grad_scaler=scaler): layers stepped during the backward
    with their gradient unscaled (speculatively, taken back when a gradient
    overflowed), or only their norm taken (0 bytes; Adafactor): the same bits
    and the same scales as the step after the backward."""
    def make(m):
        if opt_kind == "adafactor":
            return Adafactor(m.parameters(), lr=1e-2, relative_step=False, max_grad_norm=max_norm)
        return AdamW(m.parameters(), lr=1e-2, max_grad_norm=max_norm)
    model, ref = Deep(), Deep()
    ref.load_state_dict(model.state_dict())
    handle = offload_sim(model)
    offload_sim(ref)
    opt = make(model)
    if speculation_bytes is not None:
        real = opt.overlap
        opt.overlap = lambda h, **kw: real(h, speculation_bytes=speculation_bytes, **kw)
    scales = _scaled_run(model, opt, handle=handle)
    assert scales == _scaled_run(ref, make(ref))
    assert min(scales) < 2.0 ** 20 and scales[-1] > min(scales), scales
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    for p in model.parameters():
        assert p.grad is None


def test_overlap_tells_the_scaler_of_an_overflow_it_cannot_see(offload_sim):
    """A model whose every parameter streams leaves no .grad for GradScaler to
    check (the overlapped step consumes them): the plan's own check reaches the
    scaler, which backs off; the overflowing steps change nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    before = [p.detach().clone() for p in model.parameters()]
    handle = offload_sim(model)
    opt = AdamW(model.parameters(), lr=1e-2)
    scales = _scaled_run(model, opt, steps=3, handle=handle, init_scale=2.0 ** 60)
    assert scales == [2.0 ** 59, 2.0 ** 58, 2.0 ** 57]
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    assert all(s["step"].item() == 0 for s in opt.state.values())
    assert _scaled_run(model, opt, steps=1, handle=handle, init_scale=2.0 ** 8) == [2.0 ** 8]
    assert not torch.equal(model[0].weight, before[0])


def test_a_scaler_and_an_overlap_that_do_not_know_each_other_are_errors(offload_sim):
    """scaler.step() after an overlap() not given the scaler (its layers were
    stepped with scaled gradients), and opt.step() after one given a scaler:
    errors that say what to write."""
    model = Deep()
    handle = offload_sim(model)
    opt = AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    with opt.overlap(handle):
        scaler.scale(model(torch.randn(4, 16)).square().mean()).backward()
    with pytest.raises(RuntimeError, match=r"opt.overlap\(handle, grad_scaler=scaler\)"):
        scaler.step(opt)
    del opt.grad_scale, opt.found_inf  # GradScaler.step() leaves them when the step raises
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    with opt.overlap(handle, grad_scaler=scaler):
        scaler.scale(model(torch.randn(4, 16)).square().mean()).backward()
    with pytest.raises(RuntimeError, match=r"scaler.step\(optimizer\)"):
        opt.step()
    for p, b in zip(model.parameters(), before):  # the speculated step was taken back
        assert torch.equal(p, b)


@pytest.mark.parametrize("kind", ["adamw", "adafactor"])
def test_overlap_leaves_the_gradients_of_layers_it_does_not_step_in_grad(offload_sim, kind):
    """Two optimizers over one offloaded model, the overlapped one stepping layers 0-2
    but not layer 2's bias, the other (torch's) layer 3 and that bias: the landed
    gradients the plan does not step go to .grad, where the other optimizer finds
    them (before, the overlapped backward dropped them: the other optimizer stepped
    nothing). Same bits as both stepping after the backward."""
    def optimizers(m):
        mine = [p for layer in m.layers[:2] for p in layer.parameters()] + [m.layers[2].weight]
        other = list(m.layers[3].parameters()) + [m.layers[2].bias] + list(m.norm.parameters())
        host = (Adafactor(mine, lr=1e-2, relative_step=False) if kind == "adafactor" else AdamW(mine, lr=1e-2))
        return host, torch.optim.AdamW(other, lr=1e-2)
    model, ref = Deep(), Deep()
    ref.load_state_dict(model.state_dict())
    handle = offload_sim(model)
    offload_sim(ref)
    (a, b), (ra, rb) = optimizers(model), optimizers(ref)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(4, 16, generator=gen)
        with a.overlap(handle):
            model(x).square().mean().backward()
        assert model.layers[3].weight.grad is not None and model.layers[2].bias.grad is not None
        a.step(), b.step(), a.zero_grad(), b.zero_grad()
        ref(x).square().mean().backward()
        ra.step(), rb.step(), ra.zero_grad(), rb.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


def test_a_second_overlap_on_one_handle_is_an_error(offload_sim):
    """Two optimizers' overlap() around one backward: the second is refused (it would
    replace the first one's hook), saying what to do; the first still works."""
    model = Deep()
    handle = offload_sim(model)
    a = AdamW(list(model.layers[:2].parameters()), lr=1e-2)
    b = AdamW(list(model.layers[2:].parameters()), lr=1e-2)
    with a.overlap(handle):
        with pytest.raises(RuntimeError, match=r"already active on this offload\(\) handle.*Step the other"):
            with b.overlap(handle):
                pass
        model(torch.randn(4, 16)).square().mean().backward()
    a.step(), b.step()
    assert all(s["step"].item() == 1 for s in a.state.values()) and len(b.state) == 4


@pytest.mark.parametrize("make", [lambda ps: AdamW(ps, lr=1e-2), lambda ps: Adafactor(ps, lr=1e-2, relative_step=False)],
                         ids=["adamw", "adafactor"])
def test_state_dict_between_an_overlapped_backward_and_its_step_is_an_error(offload_sim, make):
    """Between overlap()'s backward and step() the layers stepped during the backward are
    a step ahead of the others: a state dict then (saved, or loaded into the plan's
    states) would be half a step. Refused, saying to step first; step() then works and
    the state dict after it is whole."""
    model = Deep()
    handle = offload_sim(model)
    opt = make(list(model.parameters()))
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step(), opt.zero_grad()
    before = copy.deepcopy(opt.state_dict())
    with opt.overlap(handle):
        model(torch.randn(4, 16)).square().mean().backward()
    for call in (opt.state_dict, lambda: opt.load_state_dict(before)):
        with pytest.raises(RuntimeError, match=r"between an overlapped backward and step\(\).*call step\(\) first"):
            call()
    # The model's weights too: a state dict or a call there saw the streamed layers
    # stepped and the resident ones not (Note [No call between an overlapped backward
    # and its step]).
    with pytest.raises(layerstream.LayerstreamError, match=r"model.state_dict\(\) between an overlapped backward .*step\(\) first"):
        model.state_dict()
    with pytest.raises(RuntimeError, match=r"called between an overlapped backward .*Call step\(\) first"):
        with torch.no_grad():
            model(torch.randn(4, 16))
    opt.step()
    assert {float(s["step"]) for s in opt.state_dict()["state"].values()} == {2.0}
    model.state_dict()
    with torch.no_grad():
        model(torch.randn(4, 16))


@pytest.mark.parametrize("cls", ["AdamW", "Adafactor"])
def test_suspend_moves_the_states_of_the_moved_parameters(cls):
    """What Handle.suspend() does to optimizer states (_move_states_of), seen on this
    machine (one device) with a copy in place of the move: every state tensor a live
    layerstream optimizer keeps on that device for the given parameters is replaced
    (same values), the other parameters' and torch's optimizers' are not."""
    from layerstream._optim_state import _move_states_of
    a, b = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(6))
    opt = layerstream.optim.AdamW([a, b], lr=0.1) if cls == "AdamW" else layerstream.optim.Adafactor([a, b])
    theirs = torch.optim.AdamW([a, b], lr=0.1)
    (a.square().sum() + b.square().sum()).backward()
    opt.step()
    theirs.step()
    mine_a, mine_b, their_a = dict(opt.state[a]), dict(opt.state[b]), dict(theirs.state[a])
    _move_states_of([a], torch.device("cpu"), lambda t: t.clone())
    tensors = {k for k, v in mine_a.items() if isinstance(v, torch.Tensor)}
    assert len(tensors) >= 2
    for k in tensors:
        assert opt.state[a][k] is not mine_a[k] and torch.equal(opt.state[a][k], mine_a[k]), k
    assert all(opt.state[b][k] is v for k, v in mine_b.items())
    assert all(theirs.state[a][k] is v for k, v in their_a.items())


@pytest.mark.parametrize("cls", ["AdamW", "Adafactor"])
@pytest.mark.parametrize("made", ["stepped-before", "loaded-after-a-step", "loaded-never-stepped",
                                  "first-step-while-suspended"])
def test_resume_puts_every_state_of_a_moved_parameter_where_a_step_on_its_device_makes_it(cls, made):
    """Handle.resume() moved back only the states suspend() had moved (looked up again
    after a load): states that did not exist at suspend() (the optimizer never stepped,
    then load_state_dict() or a first step() while suspended, beside the parameter then
    on the host) stayed there, beside a parameter back on its device, and the next step
    failed on a device mismatch. The move back looks up every state of the moved
    parameters. On this one-device machine the parameter is put back on the meta device
    in place of the device it came from, so that the move shows; where each state goes
    is where a fresh state of a parameter on that device is made (the step count on the
    host)."""
    from layerstream._optim_state import _move_states_back, _move_states_of

    def make(p):
        return (AdamW([p], lr=1e-2) if cls == "AdamW" else
                Adafactor([p], lr=1e-2, relative_step=False, beta1=0.9))

    def stepped(p):
        opt = make(p)
        p.grad = torch.randn(p.shape)
        opt.step()
        return opt

    p = nn.Parameter(torch.randn(3, 20))
    saved = copy.deepcopy(stepped(nn.Parameter(torch.randn(3, 20))).state_dict())  # another run's checkpoint
    opt = stepped(p) if made in ("stepped-before", "loaded-after-a-step") else make(p)
    _move_states_of([p], p.device, torch.clone)  # what suspend() does
    if made.startswith("loaded"):
        opt.load_state_dict(saved)  # while suspended
    elif made == "first-step-while-suspended":
        p.grad = torch.randn(p.shape)
        opt.step()
    _move_states_back([(p, torch.device("meta"))])  # what resume() does: "p came from the meta device"
    twin = nn.Parameter(torch.empty(p.shape, device="meta"))
    fresh = make(twin)
    group = fresh.param_groups[0]
    fresh._states(twin, group["state_precision"] if cls == "AdamW" else group, count=False)
    where = lambda st: {k: v.device.type for k, v in st.items() if torch.is_tensor(v)}  # noqa: E731
    assert "meta" in where(fresh.state[twin]).values() and "cpu" in where(fresh.state[twin]).values()
    assert where(opt.state[p]) == where(fresh.state[twin])


def test_an_unknown_optim_isa_is_refused():
    """LS_OPTIM_ISA=avx512 (or a typo of avx2) was ignored: the widest kernels ran where
    a benchmark or a narrow-CPU run meant the named ones."""
    code = ("import torch, layerstream.optim as o\n"
            "p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.ones(4)\n"
            "o.AdamW([p]).step()\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(layerstream.__file__)))
    for isa, ok in (("avx512", False), ("AVX2", False), ("generic", True)):
        r = subprocess.run([sys.executable, "-c", code], env=dict(env, LS_OPTIM_ISA=isa), capture_output=True,
                           text=True, timeout=120)
        assert (r.returncode == 0) == ok, (isa, r.stderr[-500:])
        if not ok:
            assert f"LS_OPTIM_ISA={isa} is not one of generic, avx2" in r.stderr


def test_a_parameter_dtype_it_cannot_step_is_refused_before_anything_moves(offload_sim):
    """A float64 (or float16) trainable parameter was accepted by the constructor and refused
    only by step(), as "a parameter has dtype float64": under overlap() the streamed layers
    had been stepped by then, so the model was left half-stepped. Now the constructor refuses
    it naming its place, and a parameter unfrozen later is refused when overlap() is entered,
    before the backward steps anything."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)
            self.temperature = nn.Parameter(torch.ones((), dtype=torch.float64))

        def forward(self, x):
            return self.b(torch.tanh(self.a(x))) * self.temperature.float()

    torch.manual_seed(0)
    m = M()
    h = offload_sim(m)
    with pytest.raises(RuntimeError, match=r"parameter 0 of param group 0 \(shape \[\]\) has dtype float64; the "
                                           r"host optimizers step float32 and bfloat16"):
        AdamW(m.parameters(), lr=0.1)
    m.temperature.requires_grad_(False)  # frozen: accepted, checked once it trains
    opt = AdamW(m.parameters(), lr=0.1)
    m.temperature.requires_grad_(True)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    loss = m(torch.randn(3, 8)).square().mean()
    with pytest.raises(RuntimeError, match=r"parameter 0 of param group 0 .* float64"):
        with opt.overlap(h):
            loss.backward()
    assert all(torch.equal(p.detach(), before[n]) for n, p in m.named_parameters())
    with pytest.raises(RuntimeError, match=r"parameter 0 of param group 0 .* float64"):
        opt.step()
    assert all(torch.equal(p.detach(), before[n]) for n, p in m.named_parameters())
