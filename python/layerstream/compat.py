"""Drop-in API of the original memory manager (RamTorch-derived), on layerstream.

Code written for the original system keeps working::

    from layerstream.compat import MemoryManager
    MemoryManager.attach(model, torch.device("cuda"), offload_percent=0.5,
                         ignore_modules=[model.head])

Observable behaviour kept from the original:
  * ``MemoryManager.attach(module, device, offload_percent=1.0, ignore_modules=[])``
    sets ``module._memory_manager`` and manages Linear / Conv layers below it;
  * ``LinearLayerMemoryManager.attach(m, manager)`` / ``ConvLayerMemoryManager.attach(m, manager)``
    attach one layer (a second attach of the same module is a no-op), tag its
    parameters ``_is_memory_managed = True`` and set
    ``m._memory_management_device``;
  * a call with extra arguments falls back to the module's original forward;
  * a module exposing ``ara_lora_ref()`` gets that wrapper's ``org_forward``
    replaced instead of its own ``forward``.

Differences (fixes): ``offload_percent`` picks layers by bytes, largest
first, deterministically (ties by name), not at random; weights are
prefetched in the traced order; gradients are complete when backward
returns; a CPU ``device`` runs on layerstream's simulated device; a model
already offloaded by ``layerstream.offload()`` is refused (one model, one
handle), as offload() refuses a model attached here.
"""
from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.nn as nn

from . import _C
from ._discovery import _conv_args, _is_streamable
from ._offload import _move_resident

LayerstreamError = _C.LayerstreamError

__all__ = ["MemoryManager", "LinearLayerMemoryManager", "ConvLayerMemoryManager",
           "BaseLayerMemoryManager"]


def _engine_device(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return str(device) if device.index is not None else "cuda"
    if device.type == "cpu":
        return "sim"
    raise ValueError(f"layerstream.compat: unsupported device {device}; use cuda or cpu")


class MemoryManager:
    """Owns one layerstream engine for the layers attached through it."""

    def __init__(self, module: nn.Module, process_device, **engine_options):
        self.module = module
        self.process_device = torch.device(process_device)
        opts = {"device": _engine_device(self.process_device)}
        opts.update(engine_options)
        self.engine = _C.Engine(opts)
        self.managed: List[nn.Module] = []

    @classmethod
    def attach(cls, module: nn.Module, device, offload_percent: float = 1.0,
               ignore_modules: Optional[Iterable[nn.Module]] = None, **engine_options):
        if hasattr(module, "_memory_manager"):
            return module._memory_manager
        taken = [name or "<root>" for name, sub in module.named_modules()
                 if getattr(sub, "_layerstream_handle", None) is not None]
        if taken:
            raise LayerstreamError(
                f"MemoryManager.attach: the model is already offloaded by layerstream.offload() "
                f"({len(taken)} streamed layer(s), e.g. '{taken[0]}'); one model is streamed by one "
                f"handle. Call handle.detach() on the offload() handle first, or keep using it.")
        if not 0.0 <= float(offload_percent) <= 1.0:
            raise ValueError(f"offload_percent must be in [0, 1], got {offload_percent}")
        manager = cls(module, device, **engine_options)
        module._memory_manager = manager

        ignored = set()
        for m in ignore_modules or []:
            for sub in m.modules():
                ignored.add(id(sub))
        layers = []
        for name, sub in module.named_modules():
            if id(sub) in ignored:
                continue
            kind = _is_streamable(sub)
            if kind is None or (kind == "conv" and sub.padding_mode != "zeros"):
                continue
            nbytes = sum(p.numel() * p.element_size() for p in sub.parameters(recurse=False))
            layers.append((nbytes, name, sub, kind))
        # Deterministic choice by bytes: largest first, ties by name.
        layers.sort(key=lambda t: (-t[0], t[1]))
        total = sum(t[0] for t in layers)
        target = float(offload_percent) * total
        chosen, acc = [], 0
        for nbytes, name, sub, kind in layers:
            if acc >= target or (offload_percent <= 0):
                break
            chosen.append((name, sub, kind))
            acc += nbytes
        chosen_ids = {id(sub) for _, sub, _ in chosen}
        # Attach in module order so the engine's layer order follows execution order.
        for name, sub in module.named_modules():
            if id(sub) not in chosen_ids:
                continue
            if _is_streamable(sub) == "linear":
                LinearLayerMemoryManager.attach(sub, manager, name=name)
            else:
                ConvLayerMemoryManager.attach(sub, manager, name=name)
        # Whatever is not streamed runs on the process device.
        streamed = {id(p) for m in manager.managed for p in m.parameters(recurse=False)}
        _move_resident(module, streamed, torch.device(manager.engine.compute_device))
        return manager

    def stats(self):
        return dict(self.engine.stats())

    def synchronize(self):
        self.engine.synchronize()


class BaseLayerMemoryManager:
    kind = ""

    def __init__(self, module: nn.Module, manager: MemoryManager, name: Optional[str] = None):
        self.module = module
        self.manager = manager
        self.name = name or f"{type(module).__name__}@{id(module):x}"

    @classmethod
    def attach(cls, module: nn.Module, manager: MemoryManager, name: Optional[str] = None):
        if hasattr(module, "_layer_memory_manager"):
            return module._layer_memory_manager
        lm = cls(module, manager, name)
        lm._install()
        module._layer_memory_manager = lm
        for p in module.parameters(recurse=False):
            p._is_memory_managed = True
        return lm

    def _register(self) -> int:
        raise NotImplementedError

    def _run(self, index: int, x):
        raise NotImplementedError

    def _install(self):
        index = self._register()
        self.manager.managed.append(self.module)
        target = self.module.ara_lora_ref() if hasattr(self.module, "ara_lora_ref") else self.module
        attr = "org_forward" if hasattr(self.module, "ara_lora_ref") else "forward"
        original = getattr(target, attr)
        self._original_forward = original

        def _mm_forward(x, *args, **kwargs):
            if args or kwargs:
                return original(x, *args, **kwargs)
            return self._run(index, x)

        setattr(target, attr, _mm_forward)
        self.module._memory_management_device = self.manager.process_device


class LinearLayerMemoryManager(BaseLayerMemoryManager):
    def _register(self) -> int:
        return self.manager.engine.add_linear(self.name, self.module.weight, self.module.bias)

    def _run(self, index, x):
        return self.manager.engine.linear(index, x)


class ConvLayerMemoryManager(BaseLayerMemoryManager):
    def _register(self) -> int:
        if self.module.padding_mode != "zeros":
            raise ValueError(
                f"layerstream.compat: conv '{self.name}' uses padding_mode="
                f"'{self.module.padding_mode}'; only zero padding can be streamed")
        return self.manager.engine.add_conv(self.name, self.module.weight, self.module.bias,
                                            **_conv_args(self.module))

    def _run(self, index, x):
        return self.manager.engine.conv(index, x)
