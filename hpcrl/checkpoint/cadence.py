"""When the training roles' states are snapshotted (`train.checkpoint.snapshot_every`) and when a
checkpoint is committed (`train.checkpoint.save_every`).

A snapshot copies each training role's state (weights, optimizer, RNG) into host memory, so that a
rebuilt process takes it back and makes again only the updates since. Its price is a pause between
steps; on a GPU it can cost more than the step itself (SmolLM2-135M: 1.7 GB in 0.86 s after a
0.30 s step, bench/gpu_slurm.json), so a snapshot at every step would slow training threefold.

    every N     after every N-th step (0: never)
    "auto"      as often as keeps the snapshots under SHARE of the wall time: after a snapshot that
                took s seconds, the next once s / SHARE seconds have passed. A role rebuilt then
                makes again the updates of those seconds, at most about s / SHARE of training.

A committed checkpoint is what survives a lost node (a dead process comes back from its snapshot, a
lost node or an out-of-memory kill takes the job down): `save_every` is

    every N     after every N-th step (0: only on a stop, and after the last step)
    "auto"      by time, as often as keeps the commits under SHARE of the wall time: after a commit
                that held training for c seconds, the next once c / SHARE seconds have passed, but
                never more often than every FLOOR seconds (a tiny model would commit at every step)
                nor less often than every CEILING seconds (the most a lost node costs). The first
                is due FLOOR seconds after the first step.
"""
from __future__ import annotations

import time

SHARE = 0.05
FLOOR, CEILING = 10.0, 1800.0    # seconds between periodic commits (save_every: auto)


class SnapshotCadence:
    def __init__(self, every: int | str, clock=time.perf_counter):
        self.every, self.clock = every, clock
        self.cost: float | None = None     # seconds the last snapshot took (None: none yet)
        self.since = clock()               # when the last snapshot ended

    def due(self, step: int) -> bool:
        if self.every != "auto":
            return bool(self.every) and step % self.every == 0
        return self.cost is None or self.clock() - self.since >= self.cost / SHARE

    def took(self, seconds: float) -> None:
        """A snapshot just ended, after `seconds`."""
        self.cost, self.since = seconds, self.clock()


class CommitCadence:
    """When a periodic checkpoint is due (`save_every`); `interval` is auto's seconds between commits."""

    def __init__(self, every: int | str, clock=time.perf_counter):
        self.every, self.clock = every, clock
        self.cost: float | None = None     # seconds the last commit held training (None: none yet)
        self.since: float | None = None    # when the last commit ended (None: at the first step's end)

    @property
    def interval(self) -> float:
        return FLOOR if self.cost is None else min(CEILING, max(FLOOR, self.cost / SHARE))

    def due(self, step: int) -> bool:
        if self.every != "auto":
            return bool(self.every) and step % self.every == 0
        if self.since is None:
            self.since = self.clock()
        return self.clock() - self.since >= self.interval

    def took(self, seconds: float) -> float | None:
        """A commit just ended, after holding training for `seconds`; auto's new interval when it
        changed by more than half (to say in the log), else None."""
        before = self.interval if self.cost is not None else None
        self.cost, self.since = seconds, self.clock()
        if self.every != "auto" or (before is not None and abs(self.interval - before) <= before / 2):
            return None
        return self.interval
