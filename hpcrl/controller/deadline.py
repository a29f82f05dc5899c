"""How long a role call may take before its ranks count as hung (`train.deadlines`).

Each kind of call (a role's method) learns its deadline from the run: `factor` times the slowest
of its last `window` calls, never under `floor_s`. A call with no warm call of its kind behind it
in these processes (the first, or the first after a rebuild: it may compile, warm up, allocate)
gets `first_s`, or the learned deadline where that is longer; its time is not learned from.
`fixed`: "method" or "role.method" -> seconds, as set (the role's own entry wins).

Pure bookkeeping: no Ray, no clock of its own (durations are given).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeadlinePolicy:
    floor_s: float = 300.0
    factor: float = 5.0
    first_s: float = 1800.0
    window: int = 20
    fixed: dict[str, float] = field(default_factory=dict)
    stop_grace_s: float = 10.0    # on a stop, a warm call is waited for at least this long, a cold one 3 times it


class CallDeadlines:
    """The durations of one process group's calls, by kind (`role.method`), and the deadlines they give."""

    RESAY = 2.0     # a learned deadline is said again once it has changed by this factor
    GRACE = 3.0     # on a stop, a warm call is waited for up to this many times the slowest recent one

    def __init__(self, policy: DeadlinePolicy | None = None):
        self.policy = policy or DeadlinePolicy()
        self.recent: dict[str, deque[float]] = {}
        self.warm: set[str] = set()           # kinds that ran once in the current processes
        self.said: dict[str, float] = {}      # the deadline last announced per kind

    def _fixed(self, kind: str) -> float | None:
        fixed = self.policy.fixed
        return fixed.get(kind, fixed.get(kind.rpartition(".")[2]))

    def learned(self, kind: str) -> float | None:
        """factor × the slowest recent warm call, at least floor_s; None before the first warm call."""
        recent = self.recent.get(kind)
        return max(self.policy.floor_s, self.policy.factor * max(recent)) if recent else None

    def deadline(self, kind: str) -> float:
        if (fixed := self._fixed(kind)) is not None:
            return fixed
        learned = self.learned(kind)
        if kind not in self.warm or learned is None:
            return max(self.policy.first_s, learned or 0.0)
        return learned

    def stop_grace(self, kind: str) -> float:
        """How long a call of this kind may have run when a stop is asked for and still be waited
        for: GRACE times the slowest of its recent warm calls, at least stop_grace_s (past that it is
        likely hung); 3 × stop_grace_s for a cold one (a compile). A call past it is abandoned: the
        stop commits the last step boundary, which costs the busy groups a rebuild, tens of seconds
        on a loaded machine, so a call that merely runs slow is waited for."""
        recent = self.recent.get(kind)
        if recent and kind in self.warm:
            return max(self.GRACE * max(recent), self.policy.stop_grace_s)
        return 3 * self.policy.stop_grace_s

    def took(self, kind: str, seconds: float) -> float | None:
        """A call of `kind` returned after `seconds`. Returns its new learned deadline when that is
        worth saying (the first, or one that changed by RESAY times since it was last said)."""
        if kind not in self.warm:          # cold: compile, warm-up; not what a call of this kind takes
            self.warm.add(kind)
            return None
        self.recent.setdefault(kind, deque(maxlen=self.policy.window)).append(seconds)
        now, said = self.learned(kind), self.said.get(kind)
        if self._fixed(kind) is None and (said is None or not said / self.RESAY < now < said * self.RESAY):
            self.said[kind] = now
            return now
        return None

    def new_processes(self) -> None:
        """The group was rebuilt: each kind's next call is cold again (its durations are kept)."""
        self.warm.clear()

    def describe(self) -> dict[str, float]:
        """kind -> the deadline its next call gets."""
        return {kind: round(self.deadline(kind), 1) for kind in sorted(self.warm | set(self.recent))}
