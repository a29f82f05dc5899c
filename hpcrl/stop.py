"""`StopRequest`: why the driver should stop at the end of this step.

SIGUSR1/SIGTERM (passed on by the batch script from Slurm: time limit near, or preemption), a stop
file the batch script wrote (a signal that came before the driver ran), the deadline (epoch
seconds: Slurm's end time minus the signal lead) passed, or `hpcrl cancel`'s file (a last
checkpoint, and then no requeue: the batch script reads the same file).
"""
from __future__ import annotations

import signal
import time
from pathlib import Path


CANCELLED = "cancelled (hpcrl cancel)"


class StopRequest:
    def __init__(self, deadline: float | None = None, stop_file: Path | None = None,
                 cancel_file: Path | None = None):
        self.reason: str | None = None
        self.since = 0.0     # when the request came (epoch seconds)
        self.deadline, self.stop_file, self.cancel_file = deadline, stop_file, cancel_file

    def request(self, reason: str, since: float | None = None) -> None:
        if self.reason is None:
            self.reason, self.since = reason, since or time.time()

    def install(self) -> None:
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, lambda s, _: self.request(signal.Signals(s).name))

    def check(self) -> str | None:
        if self.reason is None and self.stop_file is not None and self.stop_file.exists():
            self.request(f"SIG{self.stop_file.read_text().strip()}, noted by the batch script",
                         self.stop_file.stat().st_mtime)
        if self.reason is None and self.cancel_file is not None and self.cancel_file.exists():
            self.request(CANCELLED, self.cancel_file.stat().st_mtime)
        if self.reason is None and self.deadline and time.time() >= self.deadline:
            self.request("deadline", self.deadline)
        return self.reason
