"""The rules of offloaded models in several processes, and what breaking them says:
torch.multiprocessing's moves into shared memory, the same streamed backwards on every
rank, DDP's join() left by an exception, and offload() before init_process_group() in a
job that sets no WORLD_SIZE (mp.spawn). The two-rank tests run this file as their ranks
(gloo, the sim device), each with a time limit; nothing outlives a test."""
import copy
from multiprocessing import Pipe
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing  # noqa: F401 - registers torch's ForkingPickler reductions
import torch.nn as nn

import layerstream


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))


def test_sending_a_streamed_parameter_through_torch_multiprocessing_is_refused_and_the_model_keeps_its_numbers():
    """ForkingPickler (a torch.multiprocessing Queue, Pipe or Process argument) and
    share_memory_() moved a streamed parameter's storage into shared memory in place:
    the model's next call failed with "replaced or moved after offload() (e.g. by
    module.to() ...)", naming nothing of the send. Now the send is refused, naming
    torch.multiprocessing and the copy to send; the model computes and trains as the
    resident one; a copy goes through, and after detach() the weights share as usual."""
    model = _model()
    ref = copy.deepcopy(model)
    handle = layerstream.offload(model, device="sim")
    x = torch.randn(4, 8)
    sender, receiver = Pipe()
    try:
        for send in (lambda: sender.send(model.state_dict()),  # a state_dict: views of the same storages
                     lambda: ForkingPickler.dumps(model[2].weight),
                     lambda: model[0].bias.detach().share_memory_()):
            with pytest.raises(layerstream.LayerstreamError,
                               match=r"streamed parameter '\d\.(weight|bias)' .*torch\.multiprocessing .*"
                                     r"Send a copy instead \(param\.detach\(\)\.clone\(\)"):
                send()
        assert not any(p.is_shared() for p in model.parameters())
        sender.send({k: v.clone() for k, v in model.state_dict().items()})  # a copy: shared as usual
        received = receiver.recv()
        assert all(torch.equal(received[k], v) for k, v in ref.state_dict().items())
    finally:
        sender.close()
        receiver.close()
    assert torch.equal(model(x), ref(x))
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(x).square().sum().backward()
        opt.step()
    assert torch.equal(model(x), ref(x))
    handle.detach()
    model[0].weight.detach().share_memory_()  # ordinary tensors again
    assert model[0].weight.is_shared()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
