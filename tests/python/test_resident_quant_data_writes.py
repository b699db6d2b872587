"""What the README says of a quantized layer the budget keeps resident (held dense, with its
quantized values): what load_state_dict() or copy_() writes into it is quantized at its next
eager call, as a streamed layer's is; a write through .data is not. torch does not count a .data
write in the version the call checks, and comparing the values' checksum at every call instead
would read the whole weight at each call (on the CPU about 4-5x a batch-1 matmul of it; a device
weight would cross to the host for it), so the README states the limit. This pins both sides,
and that a write through the parameter after a .data write is quantized again."""
from pathlib import Path

import torch
import torch.nn as nn

README = Path(__file__).resolve().parents[2] / "README.md"


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)]).requires_grad_(False)


def _weights(model):
    return [model[i][0].weight for i in range(6)]


def test_a_data_write_into_a_resident_quantized_layer_is_not_quantized_as_the_readme_says(offload_sim):
    """p.data.copy_(new) (diffusers' EMAModel.copy_to): the streamed model quantizes it, the one the
    budget keeps resident computes with the values as written (the budget changes the numbers);
    p.copy_(new) quantizes in both, and so does a write through the parameter after a .data write."""
    text = " ".join(README.read_text().split())
    assert ("A write through `.data` (`p.data.copy_(new)`, diffusers' `EMAModel.copy_to()`) is not: torch does "
            "not count it in the version that call checks, so that layer computes with the values as written, "
            "while a streamed one quantizes them; write through the parameter instead.") in text
    new = _weights(_mlp(1))
    x = torch.randn(4, 64)
    out = {}
    for budget, resident in (("48KiB", False), ("1MiB", True)):
        for how in ("data", "param"):
            model = _mlp(0)
            handle = offload_sim(model, quantize="int8", budget=budget)
            weights = _weights(model)
            assert all(w.is_meta != resident for w in weights)
            with torch.no_grad():
                for w, v in zip(weights, new):
                    (w.data if how == "data" else w).copy_(v)
            out[budget, how] = model(x)
            if resident:
                assert all(torch.equal(w, v) == (how == "data") for w, v in zip(weights, new))
                if how == "data":  # the way the README gives: a write through the parameter is quantized
                    with torch.no_grad():
                        for w in weights:
                            w.copy_(w.detach().clone())
                    assert torch.equal(model(x), out["48KiB", "param"])
                    assert not any(torch.equal(w, v) for w, v in zip(weights, new))
            handle.detach()
    assert torch.equal(out["48KiB", "data"], out["48KiB", "param"])
    assert torch.equal(out["1MiB", "param"], out["48KiB", "param"])
    assert not torch.equal(out["1MiB", "data"], out["48KiB", "data"])  # the limit the README states
