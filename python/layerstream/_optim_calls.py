"""What layerstream.optim's public calls need around them, apart from the optimizers:
the stack level of the user's call for its warnings, and overlap()'s context manager
that warns when it is dropped without being entered."""
from __future__ import annotations


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel, called in the function that warns, for the first frame
    outside layerstream and torch: the user's step() call, also through torch.no_grad's
    wrapper or a GradScaler."""
    import sys
    level, f = 1, sys._getframe(1)
    while f is not None and f.f_globals.get("__name__", "").partition(".")[0] in ("layerstream", "torch"):
        f, level = f.f_back, level + 1
    return level


class _EnterOrWarn:
    """A context manager that warns when it is dropped without being entered:
    ``opt.overlap(handle)`` on its own line is a no-op that looks like a setting."""

    __slots__ = ("_cm", "_entered")

    def __init__(self, cm):
        self._cm, self._entered = cm, False

    def __enter__(self):
        self._entered = True
        return self._cm.__enter__()

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

    def __del__(self):
        if not self._entered:
            import warnings
            warnings.warn("layerstream.optim: overlap() was called but not entered, so it does nothing: "
                          "write `with opt.overlap(handle): loss.backward()`", RuntimeWarning, stacklevel=2)


# Note [A re-run step() completes an interrupted one]
# step() holds Ctrl-C over each kernel and its counts (Note [A Ctrl-C as a C++ call
# returns]), so a KeyboardInterrupt out of step() lands between two of its parts: after
# an overlapped backward's steps were settled and counted, or after a param group's
# kernel. torch's answer to a step() that raised is to run it again; that stepped what
# was done a second time wherever a gradient was still in .grad (overlap(keep_grads=True),
# the groups already stepped), and took the clip norm of the rest alone. So the step
# leaves a record of what it stepped and with which coefficient until it returns, and a
# step() that finds every gradient of it as it was (same tensor, same version: no
# zero_grad() or backward since) and no new overlapped backward finishes that step:
# the rest, with its coefficient; anything else is a new step.
class _Unfinished:
    """The record of a step() under way (the Note above): its clip coefficient and loss
    scale reciprocal, every parameter it had a gradient for with that gradient (None: a
    zero_grad(set_to_none=False) one, Note [Zeroed gradients an overlapped step dropped])
    and its version, the ids of those it stepped so far (`done`), and whether a sharded
    step's end (its barrier and version records) ran (`ended`; the Note below)."""

    __slots__ = ("scale", "inv", "grads", "done", "ended")

    def __init__(self, scale, inv, params, done):
        self.scale, self.inv, self.done, self.ended = scale, inv, set(done), False
        self.grads = {id(p): (p, p.grad, None if p.grad is None else p.grad._version) for p in params}

    def resumes(self, work) -> bool:
        """Whether a step() with `work` (_collect's) finishes this one."""
        return (all(p.grad is g and (g is None or g._version == v) for p, g, v in self.grads.values())
                and all(id(p) in self.grads for _, ps, _, _ in work for p in ps))

    def rest(self, work) -> list:
        """`work` without what this step stepped already."""
        return [(g, [p for p in ps if id(p) not in self.done], [x for p, x in zip(ps, gs) if id(p) not in self.done],
                 [k for p, k in zip(ps, keys) if id(p) not in self.done]) for g, ps, gs, keys in work]


# Note [A sharded step lands a Ctrl-C when it is done]
# A sharded step (offload(share_host_store="all")) opens with a barrier of the ranks, writes
# this rank's shards and ends with a barrier and the versions of what it wrote (what
# Distributed.check_shards compares before each forward). A Ctrl-C that landed between
# its parts (as a kernel's hold ended) left the end undone: the next forward refused the
# step's own writes as "written by something other than layerstream.optim", the other
# ranks waited in the end's barrier, and a re-run stepped nothing and skipped the end too
# (what the end records was computed from what was left to step); one that landed past
# the opening barrier made a re-run pass it again, paired with the other ranks' closing one.
# So Ctrl-C is held over the sharded step whole (a barrier's wait does not stop on one
# anyway) and lands after its end, the record kept with every parameter done and `ended`:
# a re-run (torch's answer to a step() that raised) finds nothing left and returns, and
# a new backward makes a new step.
