"""The Python stacks of hung worker processes, taken while they are stuck.

Each worker process registers faulthandler on STACKS_SIGNAL (hpcrl/controller/worker.py), writing
to a file of its own beside its role log. `hung_stacks` signals the processes on their nodes (a Ray
task each), waits for the files to grow, and returns what each wrote; faulthandler answers even a
process stuck in C code that holds the GIL, where a Python thread could not.
"""
from __future__ import annotations

import os
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hpcrl.controller.worker import STACKS_SIGNAL, stacks_path
from hpcrl.run_dir import log_stamp, rank_log

WAIT_S = 10.0     # how long the processes are given to write their stacks


def hung_stacks(processes: dict[int, tuple[str, int]], log_dir: str | None, roles: list[str], why: str) -> dict[int, str]:
    """processes: rank -> (its node's Ray id, its pid). Each rank's threads' stacks (rank -> text),
    also added, after `why`, to the rank's log of each of `roles` (those its process hosts)."""
    paths = {r: stacks_path(log_dir, roles[0], r, pid) for r, (_, pid) in processes.items()}
    before = {r: _size(p) for r, p in paths.items()}
    asked = [_signal.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(pid, STACKS_SIGNAL)
             for node, pid in processes.values()]
    ray.wait(asked, num_returns=len(asked), timeout=WAIT_S)
    until, last = time.monotonic() + WAIT_S, None
    while time.monotonic() < until:     # written at once, unless the node is slow: until the files stop growing
        sizes = {r: _size(p) for r, p in paths.items()}
        if sizes == last and all(sizes[r] > before[r] for r in paths):
            break
        last = sizes
        time.sleep(0.2)
    out = {}
    for r, path in paths.items():
        try:
            with open(path, errors="replace") as f:
                f.seek(before[r])
                out[r] = f.read().strip()
        except OSError:
            out[r] = ""
        out[r] = out[r] or f"(no stacks: the process did not write them within {WAIT_S:.0f} s)"
        if log_dir:
            for role in roles:
                _append_log(log_dir, role, r, f"{why}; its threads' stacks:\n{out[r]}")
    return out


def _size(path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _append_log(log_dir, role: str, rank: int, text: str) -> None:
    """Lines into a rank's role log as its own process writes them (dated, marked [role rankK])."""
    now = time.time()
    stamp = f"{log_stamp(now)} [{role} rank{rank}] "
    with open(rank_log(log_dir, role, rank), "a") as f:
        f.write("".join(stamp + line + "\n" for line in text.splitlines()))


@ray.remote(num_cpus=0)
def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
