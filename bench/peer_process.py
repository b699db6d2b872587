"""One peer of a benchmark in its own process (the benchmarks' rule: each peer runs as
its users run it, in a process of its own): runs the command and returns the JSON object
its last JSON line printed, or a row {"peer": ..., "error": why} (exit status, the end of
its stderr, or the timeout)."""
from __future__ import annotations

import json
import subprocess


def run_peer_process(cmd: list, peer: str, timeout: float | None = None, **row) -> dict:
    """`row`: fields an error row carries besides peer and error (e.g. a description)."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"peer": peer, **row, "error": f"did not finish in {timeout:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip()[-2000:]
        return {"peer": peer, **row, "error": f"exit {done.returncode}: {tail}"}
    return json.loads(lines[-1])
