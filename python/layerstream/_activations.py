"""Activation offload (docs/design/activations.md): while an offloaded model's forward runs,
the tensors autograd saves go through the engine (Engine.stash_activation: to pinned host
memory on the device-to-host stream, or kept on the device), and come back when backward
unpacks them (Engine.restore_activation, which also starts the next ones back)."""
from __future__ import annotations

from typing import List

import torch
import torch.nn as nn


class _Saved:
    """A saved tensor the engine holds for autograd (kept or on the host): released with
    the graph that holds this object."""

    __slots__ = ("engine", "token")

    def __init__(self, engine, token: int):
        self.engine, self.token = engine, token

    def __del__(self):
        try:
            self.engine.drop_activation(self.token)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to release
            pass


class ActivationOffload:
    """The saved-tensor hooks around the model's forward (forward pre-hook and an
    always-called forward hook on the root module)."""

    def __init__(self, engine, device_budget: int):
        self.engine, self.device_budget = engine, device_budget
        self._depth = 0
        self._context = None
        self._held = set()  # storages of the model's parameters and buffers, per forward

    def pack(self, t: torch.Tensor):
        # Held by the model anyway (a resident weight, or a view of it such as the
        # transposed weight a linear saves): a copy would free nothing.
        if isinstance(t, nn.Parameter) or (t.device.type != "meta" and t.untyped_storage().data_ptr() in self._held):
            return t
        token = self.engine.stash_activation(t)
        return t if token < 0 else _Saved(self.engine, token)

    def unpack(self, saved):
        return saved if isinstance(saved, torch.Tensor) else self.engine.restore_activation(saved.token)

    def _enter(self, module, args):
        if self._depth == 0:
            self.engine.begin_activations(self.device_budget)
            self._held = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())
                          if t.device.type != "meta"}
            self._context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self._context.__enter__()
        self._depth += 1

    def _exit(self, module, args, output):
        self._depth -= 1
        if self._depth == 0:
            context, self._context = self._context, None
            self._held = set()
            context.__exit__(None, None, None)

    def install(self, model: nn.Module) -> List:
        """The hook handles (removed by Handle.detach())."""
        return [model.register_forward_pre_hook(self._enter),
                model.register_forward_hook(self._exit, always_call=True)]


def parse_activations(value, parse_bytes) -> int:
    """offload(activations=...): "host" = every saved tensor that can goes to the host (a
    device budget of 0), a size = that many bytes of them stay on the device."""
    if isinstance(value, str) and value == "host":
        return 0
    try:
        budget = parse_bytes(value)
    except (ValueError, TypeError, RuntimeError):  # LayerstreamError is a RuntimeError
        budget = -1
    if budget < 0:
        raise ValueError(f"activations={value!r}: use None (off), 'host', or a device budget for saved "
                         f"activations such as '8GiB' or a number of bytes")
    return budget
