"""The rules of offloaded models in several processes, and what breaking them says:
torch.multiprocessing's moves into shared memory, the same streamed backwards on every
rank, DDP's join() left by an exception, and offload() before init_process_group() in a
job that sets no WORLD_SIZE (mp.spawn). The two-rank tests run this file as their ranks
(gloo, the sim device), each with a time limit; nothing outlives a test."""
import copy
import datetime
import os
import socket
import subprocess
import sys
from multiprocessing import Pipe
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing  # noqa: F401 - registers torch's ForkingPickler reductions
import torch.nn as nn

import layerstream

HERE = os.path.dirname(os.path.abspath(__file__))
needs_gloo = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="this torch has no torch.distributed with gloo")


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



def test_share_memory_of_an_offloaded_model_is_refused_on_the_sim_device_as_on_a_gpu():
    """model.share_memory() after offload() returned normally on the sim device, the streamed
    weights left unshared: the layers' conversion check took the share for a no-op move to
    the compute device, which there is the host (on a GPU it refused it as a move to the
    host, with a message about moves and dtypes). Now both refuse it before anything is
    shared, naming share_memory() and detach(); a resident part (the norm) shares as
    torch's does, the model computes as before, and after detach() it shares."""
    model = _model()
    ref = copy.deepcopy(model)
    handle = layerstream.offload(model, device="sim")
    refused = (r"streamed layer '0' keeps its weights in layerstream's host store.*share_memory\(\) would move "
               r"them into shared memory.*\(nothing was shared\).*call handle\.detach\(\) first")
    for share in (model.share_memory, model[0].share_memory):
        with pytest.raises(layerstream.LayerstreamError, match=refused):
            share()
        assert not any(p.is_shared() for p in model.parameters())
    for layer in (model[0], model[2]):  # the streamed layers' check, as on a model computing on a GPU
        layer._apply._compute = torch.device("cuda", 0)
    with pytest.raises(layerstream.LayerstreamError, match=refused):
        model.share_memory()
    for layer in (model[0], model[2]):
        layer._apply._compute = torch.device("cpu")
    assert model[1].share_memory() is model[1] and all(p.is_shared() for p in model[1].parameters())
    x = torch.randn(4, 8)
    assert torch.equal(model(x), ref(x))
    handle.detach()
    assert model.share_memory() is model and all(p.is_shared() for p in model.parameters())
    assert torch.equal(model(x), ref(x))

@needs_gloo
def test_training_after_a_join_left_by_an_exception_equals_the_resident_model():
    """A DDP join() left by an exception (the refusal of training under join() itself, or
    a user's error) runs no join post-hook, and its config stays enabled: every later
    training forward was refused as if still inside join(), for good until another
    join() ended. Now the join counts as ended once its block is left: training after it
    equals the resident model, and a new join() is refused again. One process (a store in
    memory), its group given explicitly so that the engine averages over it."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _model()
        ref = copy.deepcopy(model)
        handle = layerstream.offload(model, device="sim", process_group=dist.group.WORLD)
        x = torch.randn(2, 8)
        ddp = nn.parallel.DistributedDataParallel(model)
        with pytest.raises(layerstream.LayerstreamError, match=r"join\(\) \(uneven inputs\) is not supported"):
            with ddp.join():
                ddp(x).square().sum().backward()
        with pytest.raises(ZeroDivisionError):  # an evaluation under join() that fails
            with torch.no_grad(), ddp.join():
                ddp(x)
                1 / 0
        for m in (ddp, ref):
            m(x).square().sum().backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), n
        assert handle.stats()["averaged_bytes"] > 0
        with pytest.raises(layerstream.LayerstreamError, match=r"join\(\) \(uneven inputs\) is not supported"):
            with ddp.join():
                ddp(x)
        del ddp
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(scenario: str, tmp_path, timeout=120) -> list:
    """Runs this file as 2 ranks of `scenario` (rank and world size passed to
    init_process_group(), as mp.spawn does: no WORLD_SIZE in their environment); returns
    their results."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    path = [os.path.join(HERE, "..", "..", "python")] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), scenario, str(r), port, str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:  # bounded: nothing outlives the test
            if p.poll() is None:
                p.kill()
                p.wait()
    wrong = [f"rank {r} exited with {p.returncode}:\n{out[-4000:]}" for r, (p, out) in enumerate(zip(procs, outputs))
             if p.returncode != 0]
    assert not wrong, "\n".join(wrong)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


@needs_gloo
def test_ranks_that_run_different_streamed_layers_are_refused_naming_the_layer(tmp_path):
    """The engine all-reduces each streamed layer's gradient in its backward: a rank whose
    control flow skipped a streamed layer (DDP's find_unused_parameters=True covers its own
    parameters only) left the collectives unpaired, and gloo aborted a rank ("collective
    mismatch") or timed out, naming neither the rule nor the layer. Now the training
    forward is refused on both ranks, before any backward, naming the layer; the same
    skips on every rank train as the resident model under DDP."""
    results = _ranks("skips", tmp_path)
    for r, res in enumerate(results):
        for name, value in res["resident"].items():
            assert torch.equal(res["same_skips"][name], value), (r, name)
        assert "ranks ran different streamed layers" in res["rank_skips"], res["rank_skips"]
        assert "the 2nd trainable streamed layer of the forward: 'b' on rank 0, 'c' on rank 1" in res["rank_skips"]
        assert "same streamed layers' backwards in the same order" in res["rank_skips"]
        assert res["rank_skips_grads"] == [None, None, None]  # refused before the backward
    assert torch.equal(results[0]["same_skips"]["b.weight"], results[1]["same_skips"]["b.weight"])


@needs_gloo
def test_ddp_of_a_model_offloaded_before_init_process_group_without_world_size_is_checked(tmp_path):
    """A job that passes rank and world size to init_process_group() itself (mp.spawn)
    sets no WORLD_SIZE: a model offloaded before init_process_group() got no DDP check,
    its engine averaged over no group and the two ranks' streamed weights stepped apart,
    silently. Now DDP's first training forward is refused on both ranks, saying to
    offload after init_process_group(); nothing was stepped."""
    for res in _ranks("late_group", tmp_path):
        assert "averages them over no group" in res["error"] and "Call offload() after" in res["error"], res["error"]
        assert res["weight"] == res["weight_before"]


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.norm = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4), nn.LayerNorm(8)
        self.skip_b = False

    def forward(self, x):
        h = self.norm(torch.relu(self.a(x)))
        if not self.skip_b:
            h = torch.relu(self.b(h))
        return self.c(h)


def _rank_main(scenario: str, rank: int, port: str, out: str) -> None:
    import torch._dynamo  # noqa: F401 - before init_process_group (dist_worker.py's main() says why)
    import torch.distributed as dist
    result = {}
    if scenario == "late_group":
        model = _model()
        handle = layerstream.offload(model, device="sim")  # before init_process_group(), no WORLD_SIZE
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        if scenario == "late_group":
            result["weight_before"] = model[0].weight.tolist()
            ddp = nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            torch.manual_seed(rank)
            try:
                ddp(torch.randn(4, 8)).square().sum().backward()
                opt.step()
            except layerstream.LayerstreamError as e:
                result["error"] = str(e)
            result["weight"] = model[0].weight.tolist()
            del ddp
            dist.barrier()
            handle.detach()
        elif scenario == "skips":
            def train(offloaded, skip, into):
                model = _Branchy()
                handle = layerstream.offload(model, device="sim", exclude=["norm"]) if offloaded else None
                ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                try:
                    for step in range(3):
                        model.skip_b = skip(step)
                        g = torch.Generator().manual_seed(100 * step + rank)
                        ddp(torch.randn(4, 8, generator=g)).square().mean().backward()
                        opt.step()
                        opt.zero_grad()
                    result[into] = {n: p.detach().clone() for n, p in model.named_parameters()}
                except layerstream.LayerstreamError as e:
                    result[into] = str(e)
                    result[into + "_grads"] = [getattr(model, n).weight.grad for n in "abc"]
                del ddp
                dist.barrier()
                if handle is not None:
                    handle.detach()
            train(False, lambda step: step == 1, "resident")
            train(True, lambda step: step == 1, "same_skips")
            train(True, lambda step: step == 1 and rank == 1, "rank_skips")
        else:
            raise SystemExit(f"unknown scenario {scenario}")
    finally:
        import gc
        gc.collect()
        dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
