"""Stand-ins for what ai-toolkit builds around layerstream.compat (its models,
its LoRA modules, its accuracy-recovery adapters), reduced to the parts compat
sees: module shapes and how the wrappers hook a layer's forward."""
import weakref

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, h):
        return h + self.down(nn.functional.gelu(self.up(self.norm(h))))


class Toy(nn.Module):
    """A small transformer-like model with the parts ai-toolkit's models have: an
    input projection, blocks with norms, a free parameter table (ai-toolkit passes
    such parameters in ignore_modules), an output head."""

    def __init__(self, d=64):
        super().__init__()
        self.proj_in = nn.Linear(32, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.scale_shift_table = nn.Parameter(torch.randn(2, d) / 10)
        self.proj_out = nn.Linear(d, 16)

    def forward(self, x):
        h = self.proj_in(x)
        for b in self.blocks:
            h = b(h)
        shift, scale = self.scale_shift_table
        return self.proj_out(h * (1 + scale) + shift)


class LoRA(nn.Module):
    """ai-toolkit's (kohya-style) LoRA module: apply_to() keeps the layer's forward
    as org_forward and puts its own in the layer's place; the layer is held in a
    list, so it is not a submodule of the adapter. Extra call arguments reach
    org_forward."""

    def __init__(self, org: nn.Linear, rank=4, multiplier=0.5):
        super().__init__()
        self.lora_down = nn.Linear(org.in_features, rank, bias=False)
        self.lora_up = nn.Linear(rank, org.out_features, bias=False)
        nn.init.normal_(self.lora_up.weight, std=0.1)  # not zero: the adapter shows in the output
        self.multiplier = multiplier
        self.org_module = [org]

    def apply_to(self):
        self.org_forward = self.org_module[0].forward
        self.org_module[0].forward = self.forward

    def forward(self, x, *args, **kwargs):
        return self.org_forward(x, *args, **kwargs) + self.lora_up(self.lora_down(x)) * self.multiplier


class Ara(LoRA):
    """An accuracy-recovery adapter: a LoRA the layer points back to through
    ``ara_lora_ref`` (a weak reference), as ai-toolkit's quantizer sets it."""

    def apply_to(self):
        super().apply_to()
        self.org_module[0].ara_lora_ref = weakref.ref(self)
