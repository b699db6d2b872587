"""A streamed conv after offload(): its stride, padding and dilation set again to the values
it has, in another form (a list for a tuple, one int for a tuple that repeats it), and a
layout conversion of the model that moves it to the compute device in the same call."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn

from layerstream import LayerstreamError


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_conv_attribute_restated_in_another_form_is_accepted_and_a_change_still_refused(offload_sim, compiled):
    """`conv.stride = [1, 1]` where it held (1, 1) was refused as a change of the stride
    ((1, 1) -> [1, 1]), though torch's conv computes the same with either; so was
    `conv.stride = 1` (F.conv2d expands one int per dimension). Both are accepted now, for
    stride, padding and dilation, eager and compiled, with the outputs of the resident
    model; a value that computes otherwise is still refused: another int, a list of other
    ints, or one of another length (which torch's conv refuses)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1))
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    call = torch.compile(model, backend="aot_eager") if compiled else model
    x = torch.randn(1, 4, 9, 9)
    conv = model[0]
    taken = {a: getattr(conv, a) for a in ("stride", "padding", "dilation")}  # what offload() took
    for attr, value in [("stride", [1, 1]), ("stride", 1), ("padding", [1, 1]), ("padding", 1),
                        ("dilation", [1, 1]), ("dilation", 1)]:
        setattr(conv, attr, value)
        setattr(ref[0], attr, value)
        assert torch.equal(call(x), ref(x)), (attr, value)
    for attr, value in [("stride", [2, 2]), ("stride", 2), ("padding", 0), ("dilation", [1, 1, 1])]:
        old = getattr(conv, attr)
        setattr(conv, attr, value)
        with pytest.raises(LayerstreamError, match=re.escape(
                f"streamed layer '0': its {attr} changed after offload() ({taken[attr]!r} -> {value!r})")):
            call(x)
        setattr(conv, attr, old)
    assert torch.equal(call(x), ref(x))
    handle.detach()
    assert torch.equal(model(x), ref(x))


def test_a_conv1d_stride_restated_as_one_int_is_accepted(offload_sim):
    """Conv1d holds (2,): `conv.stride = 2` is the same to F.conv1d, and accepted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 4, 3, stride=2))
    ref = copy.deepcopy(model)
    offload_sim(model)
    model[0].stride = 2
    x = torch.randn(2, 4, 11)
    assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_a_layout_conversion_with_a_move_after_offload_is_refused_as_without_one(offload_sim, layout):
    """model.to(device, memory_format=torch.channels_last) (the move and the layout in one
    call) after offload() left the streamed conv weights in their layout, silently: the
    layout probe ran on the meta device, which a move cannot copy out of, and counted it as
    no layout change. The outputs stayed right, but the weights did not get the layout
    asked for, where model.to(memory_format=...) alone is refused. Refused the same way now,
    before anything changes, for the model and for one conv (a 1x1 one too, whose strides
    torch changes in its size-1 dimensions); the layout the weights have, or a move alone,
    still passes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1))
    fmt, other = torch.contiguous_format, torch.channels_last
    if layout == "channels_last":
        model, fmt, other = model.to(memory_format=torch.channels_last), other, fmt
    ref = copy.deepcopy(model).eval()
    offload_sim(model)
    model.eval()
    before = {n: (p.detach().clone(), p.stride()) for n, p in model.named_parameters()}
    for args in [("cpu",), (torch.device("cpu"), torch.float32), ()]:
        for part, name in [(model, "0"), (model[0], "0"), (model[2], "2")]:
            with pytest.raises(LayerstreamError, match=rf"streamed layer '{name}' .* another memory layout "
                                                       r".*before offload\(\)"):
                part.to(*args, memory_format=other)
            assert all(torch.equal(p, before[n][0]) and p.stride() == before[n][1]
                       for n, p in model.named_parameters())
        model.to(*args, memory_format=fmt)
    model.to("cpu")
    assert all(p.stride() == before[n][1] for n, p in model.named_parameters())
    x = torch.randn(2, 4, 6, 6)
    assert torch.equal(model(x), ref(x))
