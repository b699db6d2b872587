"""offload(budget=...) with two streamed layers sharing one weight: the planner places
them together (core/planner.h PlannerLayer::tied_layer), so what handle.plan and
stats() report is what runs, and the shared weight is counted once on the device and
in host RAM. Numbers are compared bit for bit with the resident model."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn

import layerstream

W = 256 * 256 * 4  # one 256x256 fp32 weight
B = 256 * 4  # its bias


class _SharedWeight(nn.Module):
    """l1 -> 3 blocks -> l2, l2.weight is l1.weight (each with its own bias)."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(256, 256)
        self.mid = nn.ModuleList([nn.Linear(256, 256) for _ in range(3)])
        self.l2 = nn.Linear(256, 256)
        self.l2.weight = self.l1.weight

    def forward(self, x):
        x = self.l1(x)
        for m in self.mid:
            x = torch.relu(m(x))
        return self.l2(x)


def _offload(budget):
    torch.manual_seed(0)
    model = _SharedWeight().requires_grad_(False)
    ref = copy.deepcopy(model)
    handle = layerstream.offload(model, device="sim", budget=budget, prefetch=1)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(x), ref(x))
    return model, handle


@pytest.mark.parametrize("budget", [3 * (W + B) + B // 2, 3 * (W + B) + 4 * B, 4 * W + 5 * B, 2 * 2**20])
def test_the_plan_places_layers_sharing_a_weight_as_they_run(budget):
    """Before, the planner kept l1 resident alone (resident_layers 1, "4 streamed"), and
    offload() then kept l2 resident too, beyond the reported plan and its budget."""
    model, handle = _offload(budget)
    try:
        streamed = set(handle.layers)
        plan = json.loads(handle._plan["json"])
        placed = {l["name"]: l["placement"] for l in plan["layers"]}
        assert {n for n, p in placed.items() if p == "streamed"} == streamed
        assert placed["l1"] == placed["l2"]
        s = handle.stats()
        assert s["resident_layers"] == 5 - len(streamed) == plan["num_resident"]
        # The resident bytes are the tensors resident on the device, the shared weight once.
        layers = {"l1": model.l1, "l2": model.l2, **{f"mid.{i}": m for i, m in enumerate(model.mid)}}
        resident = {id(p): p.numel() * p.element_size() for name, m in layers.items() if name not in streamed
                    for p in m.parameters()}
        assert s["resident_bytes"] == sum(resident.values())
        assert s["peak_device_bytes"] <= budget
        assert plan["host_pinned_bytes"] == s["pinned_bytes"]
    finally:
        handle.detach()


def test_the_budget_counts_a_shared_weight_once():
    """4 weights and 5 biases fit everything resident; before, the planner charged the
    shared weight twice and streamed layers (it asked 5 weights + 5 biases)."""
    model, handle = _offload(4 * W + 5 * B)
    try:
        assert handle.layers == []
        assert handle.stats()["resident_bytes"] == 4 * W + 5 * B
        assert "l2 is resident with l1, whose weight it shares (counted once)" in handle.plan
    finally:
        handle.detach()


def test_layers_sharing_a_weight_stream_together_with_one_host_copy():
    """Room for two slots and l1 alone, not for l1 and l2: both stream, pinned once."""
    model, handle = _offload(3 * (W + B) + B // 2)
    try:
        assert "l1" in handle.layers and "l2" in handle.layers
        s = handle.stats()
        assert s["pinned_bytes"] == json.loads(handle._plan["json"])["host_pinned_bytes"]
        assert s["pinned_bytes"] == W + B * len(handle.layers) + W * (len(handle.layers) - 2)
    finally:
        handle.detach()
