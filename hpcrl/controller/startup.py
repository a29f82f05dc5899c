"""When each part of a process's start ended: the phases a role's process goes through before its
first call (process started, imports, torch.distributed group joined, model built, engine ready),
marked by the code that does them and read back by the driver (WorkerGroup.startup).

A phase is marked when it ends; it took the time since the mark before it (the first since the
process started), whichever role's it was: colocated roles are built one after the other. The marks
live in the process: a rebuilt rank's new process has its own.
"""
from __future__ import annotations

import os
import time

_marks: list[tuple[str, float]] = []


def process_started(pid: int | None = None) -> float:
    """When the process was started (Unix time, from /proc; now where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22: starttime, in clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()


def mark(phase: str) -> None:
    """`phase` of this process's start ends now."""
    _marks.append((phase, time.time()))


def timed(started: float) -> list[tuple[str, float, float]]:
    """The phases marked so far, in order: (phase, when it ended, seconds it took: since the mark
    before it, the first since `started`)."""
    return [(name, ended, ended - (_marks[k - 1][1] if k else started)) for k, (name, ended) in enumerate(_marks)]


def count() -> int:
    return len(_marks)
