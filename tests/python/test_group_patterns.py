"""exclude= and quantize={pattern: format} patterns that name a module inside a tensor group
(an attention's out_proj, a child of a groups= module) and not the group: the group streams
and is packed as a whole, so such a pattern cannot apply. It was silently ignored; it is an
error naming the group and what to write instead."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from conftest import TwoLinears
from layerstream import LayerstreamError
from layerstream._discovery import _WHOLE_GROUPS


def _encoder():
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).requires_grad_(False)


def _mixer_model(frozen=True):
    torch.manual_seed(0)
    return nn.Sequential(TwoLinears(), nn.Linear(16, 8)).requires_grad_(not frozen)


def _unchanged(model, before):
    assert not any(p.is_meta for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.state_dict().values()))
    assert not any(m in _WHOLE_GROUPS for m in model.modules())
    assert getattr(model, "_layerstream_handle", None) is None and not any(
        getattr(m, "_layerstream_handle", None) is not None for m in model.modules())


def test_quantize_naming_an_attention_out_proj_is_an_error_naming_the_attention(offload_sim):
    """quantize={"self_attn.out_proj": "int8", "*": None} quantized nothing (quantized_layers 0)
    without a word: out_proj's weight streams in the attention's group, packed in the format
    the attention's own name gets. Now an error that says to name 'self_attn'; that works."""
    model = _encoder()
    before = copy.deepcopy(model)
    with pytest.raises(LayerstreamError, match=r"names 'self_attn\.out_proj', which streams inside tensor group "
                                               r"'self_attn'.*quantize=\{'self_attn': 'int8', \.\.\.\}"):
        offload_sim(model, quantize={"self_attn.out_proj": "int8", "*": None})
    _unchanged(model, before)
    handle = offload_sim(model, quantize={"self_attn": "int8", "*": None})
    assert handle.stats()["quantized_layers"] == 1 and model.self_attn.out_proj.weight.is_meta


def test_quantize_keeping_out_proj_dense_under_a_default_is_an_error(offload_sim):
    """{"*out_proj": None, "*": "int8"} meant the out_proj dense; it was packed with its group."""
    model = _encoder()
    with pytest.raises(LayerstreamError, match=r"quantize=\{'\*out_proj': None, \.\.\.\}.*its own name gets "
                                               r"\('int8'\).*quantize=\{'self_attn': None"):
        offload_sim(model, quantize={"*out_proj": None, "*": "int8"})


def test_a_default_pattern_matching_the_group_too_is_no_error(offload_sim):
    """A pattern that matches the group as well ("*") chose the group's format: no error."""
    for quantize in ({"*": "int8"}, {"self_attn": "int8", "*": None}, {"linear*": "int8", "*": None}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # and no warning either
            handle = offload_sim(_encoder(), quantize=quantize)
        handle.detach()


@pytest.mark.parametrize("frozen", [True, False])
def test_quantize_naming_a_child_of_a_groups_module_is_an_error(offload_sim, frozen):
    """groups=["0"], quantize={"0.a": "nf4", "*": None}: ignored, and with trainable weights not
    even the usual refusal (a quantized weight must be frozen). Now an error naming group '0'."""
    model = _mixer_model(frozen)
    before = copy.deepcopy(model)
    with pytest.raises(LayerstreamError, match=r"names '0\.a', which streams inside tensor group '0' \(offload\("
                                               r"groups=\.\.\.\) streams it whole\).*quantize=\{'0': 'nf4', \.\.\.\}"
                                               r".*or leave '0' out of groups="):
        offload_sim(model, groups=["0"], quantize={"0.a": "nf4", "*": None})
    _unchanged(model, before)


def test_exclude_naming_an_attention_out_proj_is_an_error(offload_sim):
    """exclude=["self_attn.out_proj"] left out_proj streaming in the attention's group."""
    model = _encoder()
    before = copy.deepcopy(model)
    with pytest.raises(LayerstreamError, match=r"offload\(exclude=\['self_attn\.out_proj'\]\) names "
                                               r"'self_attn\.out_proj'.*exclude the whole group "
                                               r"\(exclude=\['self_attn'\]\)"):
        offload_sim(model, exclude=["self_attn.out_proj"])
    _unchanged(model, before)
    x = torch.randn(2, 5, 32)
    handle = offload_sim(model, exclude=["self_attn"])  # what it says to write
    assert not model.self_attn.out_proj.weight.is_meta and handle.stats()["group_layers"] == 0
    with torch.no_grad():
        assert torch.equal(model(x), before(x))


def test_exclude_naming_a_child_of_a_groups_module_is_an_error(offload_sim):
    """groups=["0"], exclude=["0.a"]: 0.a streamed in the group all the same. Now an error; its
    second way (leave '0' out of groups=) streams 0.b alone and keeps 0.a resident. Its first
    way said exclude=['0'], which streamed 0.a and 0.b one by one (exclude= names a module, not
    what is below it); it says exclude=['0', '0.*'], which keeps the whole group resident."""
    model = _mixer_model(frozen=False)
    before = copy.deepcopy(model)
    for exclude in (["0.a"], "*.a"):
        with pytest.raises(LayerstreamError, match=r"names '0\.a', which streams inside tensor group '0'.*"
                                                   r"exclude the whole group \(exclude=\['0', '0\.\*'\]\); or "
                                                   r"leave '0' out of groups="):
            offload_sim(model, groups=["0"], exclude=exclude)
        _unchanged(model, before)
    x = torch.randn(3, 16)
    handle = offload_sim(model, groups=["0"], exclude=["0", "0.*"])
    assert handle.layers == ["1"] and not any(hasattr(p, "_is_memory_managed") for p in model[0].parameters())
    with torch.no_grad():
        assert torch.equal(model(x), before(x))
    handle.detach()
    handle = offload_sim(model, exclude=["0.a"])
    assert handle.stats()["group_layers"] == 0 and handle.stats()["layers"] == 2
    x = torch.randn(3, 16)
    model(x).square().sum().backward()
    before(x).square().sum().backward()
    for p, q in zip(model.parameters(), before.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_groups_naming_an_attention_out_proj_is_an_error_naming_the_attention(offload_sim):
    """groups=["self_attn.out_proj"] (a module already inside nn.MultiheadAttention's group)
    failed in the engine: "tensor group 'self_attn.out_proj': tensor #0 is already streamed by
    layer 'self_attn'", naming no option. Now offload() says so before anything changes,
    naming the attention; dropping the pattern streams the attention as before."""
    model = _encoder()
    before = copy.deepcopy(model)
    for groups in (["self_attn.out_proj"], "*out_proj"):
        with pytest.raises(LayerstreamError, match=r"offload\(groups=\['\*?(self_attn\.)?out_proj'\]\) names "
                                                   r"'self_attn\.out_proj', which already streams inside tensor "
                                                   r"group 'self_attn'.*Drop the pattern \(it streams with "
                                                   r"'self_attn' as it is\), or name 'self_attn' itself"):
            offload_sim(model, groups=groups)
        _unchanged(model, before)
    handle = offload_sim(model)
    assert handle.stats()["group_layers"] == 1 and model.self_attn.out_proj.weight.device.type == "cpu"
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        assert torch.equal(model(x), before(x))
