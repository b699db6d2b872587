"""One peer of a benchmark in its own process (the benchmarks' rule: each peer runs as
its users run it, in a process of its own): runs the command and returns the JSON object
its last JSON line printed, or a row {"peer": ..., "error": why} (exit status, the end of
its stderr, or the timeout).

The peer runs in a session of its own, and a peer past its timeout is killed with every
process it started (a compiler that torch's extension loader or DeepSpeed launched, a
compile worker), so that nothing it left running holds a lock or the CPU for the next.
Being in another session, a peer would outlive a SIGTERM sent to this process (run.sh's
stage timeout): this process then kills the running peers' sessions before it ends."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


_RUNNING: set = set()  # the sessions (= pids) of the peers running now


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _on_sigterm(signum, frame):
    for pid in list(_RUNNING):
        _kill_session(pid)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def run_peer_process(cmd: list, peer: str, timeout: float | None = None, **row) -> dict:
    """`row`: fields an error row carries besides peer and error (e.g. a description)."""
    if signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        signal.signal(signal.SIGTERM, _on_sigterm)  # the main thread: where the benchmarks call this
    # A peer killed by a signal (SIGSEGV) prints where it was into the stderr its error row
    # quotes (the H200 run of 2026-12-04 had only "exit -11"): the native stack
    # (core/crash_report.h), then faulthandler's Python one.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "LS_NATIVE_BACKTRACE": "1"}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, env=env) as p:
        _RUNNING.add(p.pid)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(p.pid)
            p.communicate()
            return {"peer": peer, **row, "error": f"did not finish in {timeout:.0f} s", "timed_out": True}
        finally:
            _RUNNING.discard(p.pid)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (err or out).strip()[-2000:]
        # The row keeps the tail; the whole of it goes to this process's stderr (a stage's log).
        sys.stderr.write(f"[{peer}] exit {p.returncode}; its stderr:\n{err}\n")
        return {"peer": peer, **row, "error": f"exit {p.returncode}: {tail}"}
    return json.loads(lines[-1])


def stage_deadline() -> float:
    """--deadline-s's default: LS_STAGE_DEADLINE_S, which bench/gpu/run.sh sets 15 s
    inside a stage's timeout (0: none)."""
    return float(os.environ.get("LS_STAGE_DEADLINE_S") or 0)


class StageClock:
    """The wall time a benchmark's peers share (deadline_s from now; 0: none). run()
    starts a peer with what is left (at most `cap`), or returns a row skipped for lack
    of time, so that the script prints the rows it has instead of being killed by the
    stage's timeout with none."""

    def __init__(self, deadline_s: float):
        self.deadline_s, self.t0 = deadline_s, time.perf_counter()

    def run(self, cmd: list, peer: str, cap: float | None = None, **row) -> dict:
        t = cap
        if self.deadline_s:
            left = self.deadline_s - (time.perf_counter() - self.t0)
            if left < 10:
                return {"peer": peer, **row, "skipped": f"no time left of --deadline-s {self.deadline_s:.0f}"}
            t = left if cap is None else min(cap, left)
        return run_peer_process(cmd, peer, timeout=t, **row)
