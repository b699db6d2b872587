"""Fake kernels of the torch.ops.layerstream operators (csrc/torch/ops_library.cpp), which
torch.compile and torch.export trace instead of calling the engine. Each calls the
operator's shape-only twin, the same C++ computation on stand-in weights, so shapes,
dtypes and strides are decided in one place (Note [Streamed layers as custom ops],
csrc/torch/ops_streamed.cpp)."""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loading the extension registers the operators)
from . import _group_op

_ops = torch.ops.layerstream


@torch.library.register_fake("layerstream::linear")
def _linear(x, weight, bias, engine, layer):
    return _ops.linear_shape(x, engine, layer)


@torch.library.register_fake("layerstream::conv")
def _conv(x, weight, bias, engine, layer):
    return _ops.conv_shape(x, engine, layer)


@torch.library.register_fake("layerstream::layer_backward")
def _layer_backward(grad, x, engine, layer, mask, stage):
    return _ops.layer_backward_shape(grad, x, engine, layer, mask, stage)


@torch.library.register_fake("layerstream::embedding")
def _embedding(ids, weight, engine, layer):
    return _ops.embedding_shape(ids, engine, layer)


@torch.library.register_fake("layerstream::embedding_backward")
def _embedding_backward(grad, ids, engine, layer):
    return _ops.embedding_backward_shape(grad, ids, engine, layer)


# A tensor group's call (Note [A tensor group as an operator], _group_op.py): the module's
# own forward on stand-ins of its tensors.
torch.library.register_fake("layerstream::group")(_group_op.fake)
torch.library.register_fake("layerstream::group_backward")(_group_op.backward_fake)
