"""When the training roles' states are snapshotted (`train.checkpoint.snapshot_every`).

A snapshot copies each training role's state (weights, optimizer, RNG) into host memory, so that a
rebuilt process takes it back and makes again only the updates since. Its price is a pause between
steps; on a GPU it can cost more than the step itself (SmolLM2-135M: 1.7 GB in 0.86 s after a
0.30 s step, bench/gpu_slurm.json), so a snapshot at every step would slow training threefold.

    every N     after every N-th step (0: never)
    "auto"      as often as keeps the snapshots under SHARE of the wall time: after a snapshot that
                took s seconds, the next once s / SHARE seconds have passed. A role rebuilt then
                makes again the updates of those seconds, at most about s / SHARE of training.
"""
from __future__ import annotations

import time

SHARE = 0.05


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
