"""Calls of one offloaded model from several threads (a server's worker threads):
Note [Calls of one offloaded model take turns] (_calls.py) and Note [Two threads and
one tensor group] (_forward.py)."""
import copy
import sys
import threading
import time

import pytest
import torch
import torch.nn as nn

from layerstream import _calls

THREADS, ROUNDS = 4, 3


class Mix(nn.Module):
    """A module of its own streamed as a tensor group (offload(groups=...)): its
    parameters are swapped on the module for the call. It gives the other threads the
    interpreter while it holds them, so that, without turns, their calls begin inside."""

    def __init__(self, d):
        super().__init__()
        self.a = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.b = nn.Parameter(torch.randn(d) / d ** 0.5)

    def forward(self, x):
        time.sleep(0.002)
        return torch.tanh(x @ self.a) * self.b


class Block(nn.Module):
    """An nn.MultiheadAttention and a Mix (tensor groups) and a Linear."""

    def __init__(self, d=32):
        super().__init__()
        self.att = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mix = Mix(d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        return self.out(self.mix(self.att(x, x, x, need_weights=False)[0]))


def _in_threads(fn, n=THREADS, timeout=120):
    """fn(i) in n threads started together; their exceptions, re-raised here."""
    start, errors = threading.Barrier(n), []

    threads_per_op = torch.get_num_threads()

    def run(i):
        try:
            # A new thread's CPU kernels would split their work over OpenMP's default
            # number of threads (not conftest's) and so round otherwise than this one's.
            torch.set_num_threads(threads_per_op)
            start.wait()
            fn(i)
        except BaseException as e:  # noqa: B902 - reported to the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), name=f"worker-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a call never returned"
    if errors:
        raise errors[0]


def test_threads_calling_one_offloaded_model_get_the_resident_models_outputs(offload_dev, compute_device):
    """Four threads call a model of streamed tensor groups and Linears at once, pausing
    inside the groups' calls: every output is the resident model's, bit for bit. (Before
    the turns: 'all 2 device slots are held at once', or one thread found the other's
    swapped parameters.)"""
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(3)]).eval().requires_grad_(False)
    ref = copy.deepcopy(model).to(compute_device)
    handle = offload_dev(model, budget=2 * 4 * 4 * 32 * 32 + 4096, prefetch=1, groups="*.mix")
    assert handle.stats()["layers"] == 9
    xs = [torch.randn(2, 5, 32, device=compute_device) for _ in range(THREADS)]
    got = {}

    def work(i):
        for r in range(ROUNDS):
            with torch.no_grad():
                got[i, r] = model(xs[i])

    _in_threads(work)
    assert len(got) == THREADS * ROUNDS
    with torch.no_grad():
        for (i, _), y in got.items():
            assert torch.equal(y, ref(xs[i]))


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Wrapper(nn.Module):
    """As peft's wrappers hold a causal LM, and a causal LM its backbone."""

    def __init__(self):
        super().__init__()
        self.model = Backbone()

    def forward(self, x):
        return self.model(x)


def test_threads_calling_a_model_below_its_root_take_turns(offload_sim):
    """Calls that enter the offloaded model below its root (peft's generate() calls the
    causal LM inside its wrappers; model.model(...) for hidden states) skipped the root's
    call hooks: four threads met each other's slots ('all 2 device slots are held at
    once'). The modules between the root and its blocks carry the hooks too (Note [Calls
    that enter the model below its root]); a call of one inside a call of the root only
    nests. A deep copy of such a module is plain: its hooks do nothing."""
    torch.manual_seed(0)
    model = Wrapper().eval().requires_grad_(False)
    ref = copy.deepcopy(model)
    handle = offload_sim(model, budget=2 * 4 * 4 * 32 * 32 + 4096, prefetch=1, groups="*.mix")
    assert [r() for r in handle._call_hook.entries] == [model.model]
    xs = [torch.randn(2, 5, 32) for _ in range(THREADS)]
    got = {}

    def work(i):
        for r in range(ROUNDS):
            with torch.no_grad():
                got[i, r] = (model if r == 1 else model.model)(xs[i])

    _in_threads(work)
    assert len(got) == THREADS * ROUNDS
    with torch.no_grad():
        for (i, _), y in got.items():
            assert torch.equal(y, ref(xs[i]))
    turns = handle._call_hook.begins._turns
    assert turns._owner is None and turns._frames == []
    plain = copy.deepcopy(model.model)
    turns.enter(sys._getframe())  # this thread holds the model's turn: the copy's call takes none
    try:
        done = threading.Event()
        t = threading.Thread(target=lambda: (plain(xs[0]), done.set()), daemon=True)
        t.start()
        t.join(10)
        assert done.is_set(), "the copy's call waits for the offloaded model's turn"
    finally:
        turns.leave(sys._getframe())
    handle.detach()
    with torch.no_grad():  # and it outlives the handle
        assert torch.equal(plain(xs[0]), ref(xs[0]))
    assert not model.model._forward_pre_hooks and not model.model._forward_hooks


def test_threads_calling_one_streamed_group_directly_take_turns_on_it(offload_sim):
    """Note [Two threads and one tensor group]: calls of a streamed group module itself
    (not through the model, so without the model's turns) from two threads at once wait
    for each other's swap; both get the resident module's output. (Before: the second
    found the first's views in place of the parameters, 'were replaced after offload()'.)"""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).eval().requires_grad_(False)
    ref = copy.deepcopy(model)
    offload_sim(model, groups="*.mix")
    x = torch.randn(2, 5, 32)
    got = []

    def work(i):
        with torch.no_grad():
            got.append(model[0].mix(x))

    _in_threads(work, n=2)
    with torch.no_grad():
        assert len(got) == 2 and all(torch.equal(y, ref[0].mix(x)) for y in got)


def test_a_call_that_raises_passes_the_turn_on(offload_sim):
    """A call that raises (here: inside the model, after its first layer) ends its turn:
    the other threads' calls run, and the raising thread calls again afterwards. The turn
    is given back as the call raises (torch's always-called hook runs in another frame
    than the pre-hook), not found stale by the next call."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    turns = offload_sim(model)._call_hook.begins._turns
    fail = threading.local()

    def maybe_raise(module, args):
        if getattr(fail, "on", False):
            raise RuntimeError("planted")

    model[1].register_forward_pre_hook(maybe_raise)
    x = torch.randn(2, 8)

    def work(i):
        if i == 0:
            fail.on = True
            with pytest.raises(RuntimeError, match="planted"):
                model(x)
            fail.on = False
        assert torch.equal(model(x), ref(x))

    _in_threads(work)
    fail.on = True
    with pytest.raises(RuntimeError, match="planted"):
        model(x)
    assert turns._owner is None and turns._frames == []


def _call_in_thread(model, x, ref, timeout=30):
    """model(x) == ref(x) in a new (daemon) thread; fails when the call has not returned
    within `timeout` (daemon: a call that waits for ever must not hang the run)."""
    got = []
    t = threading.Thread(target=lambda: got.append(torch.equal(model(x), ref(x))), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the call still waits for a turn nobody holds"
    assert got == [True]


def test_a_call_ended_by_keyboard_interrupt_gives_its_turn_to_the_next_call(offload_sim):
    """KeyboardInterrupt (a notebook's interrupt) skips torch's always-called hooks: the
    interrupted call never gives its turn back. Its frame is gone from the stack, so the
    next call takes the turn, another thread's as well as this one's."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    offload_sim(model)
    interrupt = [True]

    def maybe_interrupt(module, args):
        if interrupt[0]:
            raise KeyboardInterrupt

    model[1].register_forward_pre_hook(maybe_interrupt)
    x = torch.randn(2, 8)
    with pytest.raises(KeyboardInterrupt):
        model(x)
    interrupt[0] = False
    _call_in_thread(model, x, ref)
    with pytest.raises(KeyboardInterrupt):
        interrupt[0] = True
        model(x)
    interrupt[0] = False
    assert torch.equal(model(x), ref(x))  # this thread's next call
    _call_in_thread(model, x, ref)  # and the turn was given back after it


def test_a_waiting_call_does_not_take_the_turn_of_a_call_under_way(offload_sim, monkeypatch):
    """The look at the holder's stack must not take a turn whose call is still running
    (here: held inside a layer for many of the waiter's looks)."""
    monkeypatch.setattr(_calls._CallTurns, "POLL_S", 0.02)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    offload_sim(model)
    inside, go_on, events = threading.Event(), threading.Event(), []

    def hold(module, args):
        if threading.current_thread().name == "holder":
            events.append("holder inside")
            inside.set()
            go_on.wait(30)
            events.append("holder leaves")

    model[1].register_forward_pre_hook(hold)
    model[0].register_forward_pre_hook(
        lambda m, a: events.append("waiter runs") if threading.current_thread().name == "waiter" else None)
    x = torch.randn(2, 8)
    holder = threading.Thread(target=lambda: model(x), name="holder")
    holder.start()
    assert inside.wait(30)
    waiter = threading.Thread(target=lambda: events.append(torch.equal(model(x), ref(x))), name="waiter")
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and events == ["holder inside"]
    go_on.set()
    holder.join(30)
    waiter.join(30)
    assert events == ["holder inside", "holder leaves", "waiter runs", True]


def test_detach_removes_both_call_hooks(offload_sim):
    model = nn.Sequential(nn.Linear(8, 8))
    handle = offload_sim(model)
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    handle.detach()
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_turn_whose_thread_is_gone_is_taken_over(offload_sim):
    """A thread that ended inside a call (SystemExit skips torch's always-called hooks)
    left its turn held: the next call takes it over."""
    model = nn.Sequential(nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    t = threading.Thread(target=lambda: handle._call_hook.begins._turns.enter(sys._getframe()), name="gone")
    t.start()
    t.join()
    _call_in_thread(model, torch.randn(2, 8), ref)


def test_transformers_generate_from_several_threads_gives_the_resident_tokens(offload_sim):
    """Three threads each run generate() on one offloaded Llama (a chat server's
    workers): each gets the tokens the resident model gives its prompt."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).eval().requires_grad_(False)
    ref = copy.deepcopy(model)
    handle = offload_sim(model, budget="700KiB")
    assert handle.stats()["layers"] > 0
    prompts = [torch.randint(0, 256, (1, 5 + i)) for i in range(3)]
    want = [ref.generate(p, max_new_tokens=8, do_sample=False) for p in prompts]
    got = {}

    def work(i):
        got[i] = model.generate(prompts[i], max_new_tokens=8, do_sample=False)

    _in_threads(work, n=3)
    assert all(torch.equal(got[i], want[i]) for i in range(3))


@pytest.mark.parametrize("what", ["suspend", "detach"])
def test_suspend_and_detach_wait_for_another_threads_call(offload_sim, what):
    """suspend() or detach() from one thread while another thread's call is under way
    waits for that call to end (before: the call lost its slots or weights half-way, an
    error or worse), then does its work."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    inside, go_on, events = threading.Event(), threading.Event(), []

    def hold(module, args):
        if threading.current_thread().name == "holder":
            inside.set()
            go_on.wait(30)
            events.append("call leaves the layer")

    model[1].register_forward_pre_hook(hold)
    x = torch.randn(2, 8)
    holder = threading.Thread(target=lambda: events.append(torch.equal(model(x), ref(x))), name="holder")
    holder.start()
    assert inside.wait(30)
    other = threading.Thread(target=lambda: (getattr(handle, what)(), events.append(what)), daemon=True)
    other.start()
    other.join(0.3)
    assert other.is_alive() and events == []
    go_on.set()
    holder.join(30)
    other.join(30)
    assert not other.is_alive()
    # the call's result (True: the resident output) and the method's end in either order:
    # the turn passes on as the call returns, before its thread compares
    assert events[0] == "call leaves the layer" and sorted(map(str, events[1:])) == sorted(["True", what])
    if what == "suspend":
        assert handle.suspended
        handle.resume()
        assert torch.equal(model(x), ref(x))


_SAVED_TENSORS_SCRIPT = r"""
import copy, sys, threading, torch, torch.nn as nn
import layerstream
sys.setswitchinterval(1e-6)  # threads switch as often as possible
torch.manual_seed(0)
layers = []
for _ in range(2):
    layers += [nn.Linear(128, 128), nn.GELU()]
model = nn.Sequential(*layers, nn.Linear(128, 8))
ref = copy.deepcopy(model)
layerstream.offload(model, device="sim", activations="host")
def work():
    torch.set_num_threads(1)
    for _ in range(ROUNDS):
        x = torch.randn(256, 128)
        y = model(x)  # saved activations go to the host; freed without backward
        with torch.no_grad():
            assert torch.equal(y, ref(x))
        del y
threads = [threading.Thread(target=work) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
print("done")
"""


def test_threads_saving_and_freeing_activations_do_not_deadlock(tmp_path):
    """offload(activations="host"), threads calling the model with gradients on and
    dropping the outputs (their calls take turns): about one run in five hung for good.
    A thread in stash_activation (the GIL released) destroyed a saved tensor under the
    engine's lock, and the destructor waited for the GIL, which another thread held
    while it waited for that lock (dropping its saved tensors in a Python __del__):
    Note [Saved tensors are let go after the lock]. Runs in subprocesses, each bounded;
    several rounds, so that the interleaving that hung comes up."""
    import os
    import subprocess
    script = tmp_path / "saved.py"
    script.write_text(_SAVED_TENSORS_SCRIPT.replace("ROUNDS", "40"))
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(here, "..", "..", "python")] +
                                                      [p for p in [os.environ.get("PYTHONPATH")] if p]))
    for run in range(6):
        try:
            r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=45)
        except subprocess.TimeoutExpired:
            pytest.fail(f"run {run}: the threads hung (deadlock between the GIL and the engine's lock)")
        assert r.returncode == 0 and "done" in r.stdout, r.stdout + r.stderr


def _turn_lock_taken(turns):
    """threading.Condition's __enter__ took the turns' lock (its C call returns)."""
    return lambda frame, arg: getattr(arg, "__name__", "") == "__enter__" and getattr(
        arg, "__self__", None) is turns._cond._lock


def _turn_lock_given_back(turns):
    """threading.Condition's __exit__ is about to give the turns' lock back."""
    return lambda frame, arg: frame.f_code.co_name == "__exit__" and frame.f_locals.get("self") is turns._cond


@pytest.mark.parametrize("where", ["taken", "given back"])
def test_a_ctrl_c_at_the_turns_lock_leaves_it_free_for_the_next_calls(offload_sim, where):
    """threading.Condition takes and gives back its lock in Python code: a Ctrl-C
    raised just after the take, or just before the give-back, left the lock taken for
    ever, and every later call of the model (another thread's, this one's, detach())
    waited on it. Held over those steps now (_CallTurns._take): raised after them."""
    from test_errors import _sigint_at
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    turns = handle._call_hook.begins._turns
    x = torch.randn(2, 8)
    event, hit = ("c_return", _turn_lock_taken(turns)) if where == "taken" else ("line", _turn_lock_given_back(turns))
    with _sigint_at(event, hit) as sent, pytest.raises(KeyboardInterrupt):
        model(x)
    leaked = turns._cond._lock.locked()
    if leaked:
        turns._cond._lock.release()  # or the fixture's detach() waits for ever
    assert sent and not leaked
    _call_in_thread(model, x, ref, timeout=10)
    assert torch.equal(model(x), ref(x))
    handle.detach()


def test_a_ctrl_c_stops_a_call_waiting_for_its_turn(offload_sim):
    """Ctrl-C is held over the turns' lock (_CallTurns._take), not over the wait for a
    turn another thread's call holds: the waiting call raises KeyboardInterrupt while
    the other call goes on, takes no turn, and the calls after it work."""
    from test_errors import _sigint_at
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    handle = offload_sim(model)
    turns = handle._call_hook.begins._turns
    inside, go_on = threading.Event(), threading.Event()

    def hold(module, args):
        if threading.current_thread().name == "holder":
            inside.set()
            go_on.wait(30)

    model[1].register_forward_pre_hook(hold)
    x = torch.randn(2, 8)
    got = []
    holder = threading.Thread(target=lambda: got.append(torch.equal(model(x), ref(x))), name="holder")
    holder.start()
    assert inside.wait(30)
    waiting = lambda frame, arg: frame.f_code.co_name == "wait" and frame.f_locals.get("self") is turns._cond
    try:
        with _sigint_at("line", waiting) as sent, pytest.raises(KeyboardInterrupt):
            model(x)  # waits for the holder's turn
        assert sent and holder.is_alive() and turns._owner == holder.ident
    finally:
        go_on.set()
    holder.join(30)
    assert got == [True]
    assert torch.equal(model(x), ref(x))
    _call_in_thread(model, x, ref, timeout=10)
