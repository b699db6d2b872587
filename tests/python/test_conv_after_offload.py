"""A streamed conv after offload(): its stride, padding and dilation set again to the values
it has, in another form (a list for a tuple, one int for a tuple that repeats it), or to
floats torch's conv refuses (a table's attributes too), and a layout conversion of the model
that moves it to the compute device in the same call; one given one int before offload()."""
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


@pytest.mark.parametrize("attr, value", [("stride", 2), ("padding", 1), ("dilation", 2), ("padding", "same"),
                                         ("padding", "valid")])
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_a_conv_given_one_int_or_a_padding_string_before_offload_streams_as_the_resident_model(offload_sim, dims,
                                                                                               attr, value):
    """`conv.stride = 2` (one int, which F.conv2d expands per dimension; also padding,
    dilation) set before offload() made offload() fail with a TypeError ('int' object is not
    iterable). It streams now, computing what the resident conv computes; so does a padding
    string ('same' here with an even kernel: padded more on one side). After offload() the
    int restated as a tuple, and the tuple as the int, are accepted; another value refused."""
    torch.manual_seed(0)
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims](4, 4, 4 if value == "same" else 3)
    setattr(conv, attr, value)
    model, ref = nn.Sequential(conv), nn.Sequential(copy.deepcopy(conv))
    handle = offload_sim(model)
    assert handle.layers == ["0"]
    x = torch.randn(2, 4, *(11,) * dims)
    assert torch.equal(model(x), ref(x))
    if isinstance(value, int):
        for restated in [(value,) * dims, [value] * dims, value]:
            setattr(conv, attr, restated)
            assert torch.equal(model(x), ref(x)), restated
        conv.stride = (1,) * dims if attr == "stride" else 2  # a change
        with pytest.raises(LayerstreamError, match=r"its stride changed after offload\(\)"):
            model(x)


_FLOATS = [(0, "stride", (1.0, 1.0)), (0, "stride", [1, 1.0]), (0, "padding", (1.0, 1.0)), (0, "dilation", 1.0),
           (0, "dilation", (True, True)), (0, "groups", 1.0), (1, "stride", 1.0), (1, "stride", (1.0, 1.0)),
           (1, "stride", True)]


def _floats_model():
    """Two convs, the second given one int stride before offload()."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3))
    model[1].stride = 1
    return model


def test_a_conv_attribute_set_to_floats_after_offload_is_refused_as_torch_refuses_it(offload_sim):
    """`conv.stride = (1.0, 1.0)` after offload() passed the check ((1.0, 1.0) == (1, 1) in
    Python) and the streamed conv computed with stride 1, while torch's conv refuses floats
    (and bools) there. Refused as a change now, for stride, padding, dilation and groups,
    also where offload() took one int; numpy ints, which torch's conv takes, are accepted."""
    np = pytest.importorskip("numpy")
    model = _floats_model()
    ref = copy.deepcopy(model)
    offload_sim(model)
    x = torch.randn(1, 4, 9, 9)
    assert torch.equal(model(x), ref(x))
    for i, attr, value in _FLOATS:
        conv, old = model[i], getattr(model[i], attr)
        setattr(ref[i], attr, value)
        with pytest.raises(TypeError):
            ref(x)  # torch's own conv refuses it
        setattr(ref[i], attr, old)
        setattr(conv, attr, value)
        with pytest.raises(LayerstreamError, match=re.escape(
                f"streamed layer '{i}': its {attr} changed after offload() ({old!r} -> {value!r})")):
            model(x)
        setattr(conv, attr, old)
    for i, attr, value in [(0, "stride", (np.int64(1),) * 2), (0, "groups", np.int64(1)), (1, "stride", np.int64(1))]:
        setattr(model[i], attr, value)
        setattr(ref[i], attr, value)
        assert torch.equal(model(x), ref(x)), (i, attr, value)


def test_a_compiled_conv_given_floats_after_offload_computes_as_torch_compiled_or_refuses(offload_sim):
    """Compiled, torch's own conv is not always refused: Dynamo's guards take (1.0, 1.0) for
    the (1, 1) a graph was traced with and run that graph (stride 1). A compiled streamed
    conv given the values _FLOATS lists either refuses them (its check runs while tracing)
    or computes what the compiled resident model does; the values back, it computes on."""
    model = _floats_model()
    ref = copy.deepcopy(model)
    offload_sim(model)
    call, ref_call = torch.compile(model, backend="aot_eager"), torch.compile(ref, backend="aot_eager")
    x = torch.randn(1, 4, 9, 9)
    assert torch.equal(call(x), ref_call(x))
    for i, attr, value in _FLOATS:
        old = getattr(model[i], attr)
        setattr(model[i], attr, value)
        setattr(ref[i], attr, value)
        try:
            got = call(x)
        except LayerstreamError as e:
            assert f"its {attr} changed after offload() ({old!r} -> {value!r})" in str(e)
        else:
            assert torch.equal(got, ref_call(x)), (i, attr, value)  # torch's compiled conv took it too
        setattr(model[i], attr, old)
        setattr(ref[i], attr, old)
        assert torch.equal(call(x), ref_call(x))


def test_a_table_attribute_set_to_a_value_torch_refuses_after_offload_is_refused(offload_sim):
    """emb.padding_idx = 0.0 where it held 0, emb.sparse = 0 where it held False: equal in
    Python, refused by torch's lookup, and passed by the check after offload(). Refused as a
    change now; the value itself again passes."""
    model = nn.Sequential(nn.Embedding(64, 8, padding_idx=0))
    ref = copy.deepcopy(model)
    assert offload_sim(model).layers == ["0"]
    x = torch.tensor([0, 1, 2])
    for attr, value in [("padding_idx", 0.0), ("sparse", 0), ("scale_grad_by_freq", 0)]:
        old = getattr(model[0], attr)
        setattr(ref[0], attr, value)
        with pytest.raises(TypeError):
            ref(x)
        setattr(ref[0], attr, old)
        setattr(model[0], attr, value)
        with pytest.raises(LayerstreamError, match=re.escape(f"its {attr} changed after offload() ({old!r} -> {value!r})")):
            model(x)
        setattr(model[0], attr, type(old)(old))
        assert torch.equal(model(x), ref(x))
