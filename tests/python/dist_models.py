"""The models, batches and training loop that test_distributed.py runs in one process
and in every rank of dist_worker.py (same seeds: the same numbers)."""
import contextlib

import torch
import torch.nn as nn

BATCH = 4  # rows per rank per micro-batch
STEPS = 5
LORA_LR = 0.005  # the wide LoRA model's
MICRO = 2  # micro-batches per step: the first under no_sync() in the ranks
VOCAB, DIM = 40, 16


class Net(nn.Module):
    """An embedding table, an attention block (a tensor group), Linear layers and a
    resident LayerNorm: every kind of streamed gradient, and one DDP reduces."""

    def __init__(self, hidden=32, wide=False):
        super().__init__()
        dim = 256 if wide else DIM
        self.emb = nn.Embedding(VOCAB, dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim if wide else hidden)
        self.fc2 = nn.Linear(4 * dim if wide else hidden, 1)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = torch.relu(self.fc1(self.norm(h)))
        return self.fc2(h).mean(dim=(1, 2))


def make_model(hidden=32, wide=False):
    torch.manual_seed(0)
    return Net(hidden, wide)


def lora_model(wide=False):
    from peft import LoraConfig, get_peft_model
    model = make_model(wide=wide)
    # A LoRA adapter on the Linear layers; the rest frozen, as LoRA trainers do.
    return get_peft_model(model, LoraConfig(r=4, target_modules=["fc1", "fc2"], init_lora_weights="gaussian"))


def batch_of(step, micro, ranks=3):
    """(ids, target) of all ranks for one micro-batch: rows r*BATCH.. are rank r's."""
    g = torch.Generator().manual_seed(100 * step + micro)
    ids = torch.randint(0, VOCAB, (ranks * BATCH, 6), generator=g)
    return _Rows(ids, torch.randn(ranks * BATCH, generator=g))


class _Rows(tuple):
    """(ids, target), sliceable by rows."""

    def __new__(cls, ids, target):
        return super().__new__(cls, (ids, target))

    def __getitem__(self, k):
        if isinstance(k, slice):
            return _Rows(tuple.__getitem__(self, 0)[k], tuple.__getitem__(self, 1)[k])
        return tuple.__getitem__(self, k)


def train_steps(model, batch, accumulate_with=contextlib.nullcontext, lr=0.05, optimizer=None):
    """STEPS steps of SGD with momentum (or `optimizer(params)`), MICRO micro-batches each (the first inside
    `accumulate_with()`: DDP's no_sync); returns each step's loss (mean of the micro-batches)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9) if optimizer is None else optimizer(params)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(MICRO):
            ids, target = batch(step, micro)
            with accumulate_with() if micro < MICRO - 1 else contextlib.nullcontext():
                loss = nn.functional.mse_loss(model(ids), target) / MICRO
                loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    train_steps.optimizer = opt
    return losses


def host_adamw(params):
    """The sharded scenario's optimizer: layerstream's host AdamW (fp32). eps is large
    enough that a gradient at rounding level (attention's key bias, whose true gradient
    is zero) is not normalized into a full-size step: Adam would turn the ranks' and
    the single process's different roundings of ~0 into opposite lr-sized updates."""
    import layerstream.optim
    return layerstream.optim.AdamW(params, lr=1e-3, eps=1e-3, weight_decay=0.01)


def host_adamw_clipped(params):
    """host_adamw with a global clip that triggers at every step (the overlapped sharded
    scenario: speculated layers restored and re-stepped, then norm-only passes)."""
    import layerstream.optim
    return layerstream.optim.AdamW(params, lr=1e-3, eps=1e-3, weight_decay=0.01, max_grad_norm=1e-3)


def host_adafactor(params):
    """The sharded Adafactor scenario's optimizer: layerstream's Adafactor with a fixed
    lr. eps[0] (added to the squared gradient) is large enough that a gradient at
    rounding level is not normalized into a full-size step (see host_adamw)."""
    import layerstream.optim
    return layerstream.optim.Adafactor(params, lr=1e-3, eps=(1e-6, 1e-3), relative_step=False,
                                       scale_parameter=False)


def host_adafactor_clipped(params):
    """host_adafactor with a global clip that triggers at every step (the overlapped sharded
    scenario: each rank takes the norms of the tensors it owns, the ranks' sums add up)."""
    import layerstream.optim
    return layerstream.optim.Adafactor(params, lr=1e-3, eps=(1e-6, 1e-3), relative_step=False,
                                       scale_parameter=False, max_grad_norm=1e-3)