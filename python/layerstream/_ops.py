"""Fake kernels of the torch.ops.layerstream operators (csrc/torch/ops_library.cpp), which
torch.compile and torch.export trace instead of calling the engine. Each calls the
operator's shape-only twin, the same C++ computation on stand-in weights, so shapes,
dtypes and strides are decided in one place (Note [Streamed layers as custom ops],
csrc/torch/ops_compiled.cpp)."""
from __future__ import annotations

import sys

import torch

from . import _C  # noqa: F401  (loading the extension registers the operators)
from . import _group_op

_ops = torch.ops.layerstream


@torch.library.register_fake("layerstream::linear")
def _linear(x, weight, bias, engine, layer, spec):
    return _ops.linear_shape(x, engine, layer, spec)


@torch.library.register_fake("layerstream::conv")
def _conv(x, weight, bias, engine, layer, spec):
    return _ops.conv_shape(x, engine, layer, spec)


@torch.library.register_fake("layerstream::layer_backward")
def _layer_backward(grad, x, engine, layer, spec, mask, stage):
    if stage:
        _refuse_compiled_autograd()
    return _ops.layer_backward_shape(grad, x, engine, layer, spec, mask, stage)


def _refuse_compiled_autograd():
    """A staged backward (Note [Compiled weight gradients are staged],
    csrc/torch/ops_compiled.cpp) hands its weight gradients to the engine, which adds them
    to .grad when the autograd engine's backward ends; torch._dynamo's compiled autograd
    runs the backward as a graph of its own and never ends it that way, so they would be
    lost: refused while it compiles that graph (in_compiled_autograd_region)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if ca is not None and getattr(ca, "in_compiled_autograd_region", False):
        raise _C.LayerstreamError(
            "torch._dynamo's compiled autograd cannot trace the backward of a compiled model whose streamed "
            "weights train: layerstream applies their gradients when the autograd engine's backward ends, "
            "which compiled autograd does not run. Run the backward without compiled autograd (the forward "
            "may stay compiled), or keep those weights frozen (LoRA).")


@torch.library.register_fake("layerstream::embedding")
def _embedding(ids, weight, engine, layer, spec):
    return _ops.embedding_shape(ids, engine, layer, spec)


@torch.library.register_fake("layerstream::embedding_backward")
def _embedding_backward(grad, ids, engine, layer, spec):
    return _ops.embedding_backward_shape(grad, ids, engine, layer, spec)


# A tensor group's call (Note [A tensor group as an operator], _group_op.py): the module's
# own forward on stand-ins of its tensors.
torch.library.register_fake("layerstream::group")(_group_op.fake)
torch.library.register_fake("layerstream::group_backward")(_group_op.backward_fake)
