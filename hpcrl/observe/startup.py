"""Where a start of the run spends its time before its first step: the `startup` events.

A start begins when the job was submitted (its first start), when the start before it ended (a
requeued job: the last event that start wrote, usually the `stop` at its committed checkpoint), or
when the driver's process started (a local run). Its phases, each from the end of the one before:

    queued / requeued  Slurm, until the batch script ran on the allocation (for a requeue, Slurm's
                       requeue delay and the wait for nodes)
    ray                every Ray node of this start joined (local: the one node started)
    driver             the driver's process up, its imports done, connected to Ray
    roles              every role's processes built; per role and rank, from the process's start:
        process          Python, Ray's worker and torch imported (a worker process Ray started ahead, idle,
                         counts from its own start)
        group            the rank's torch.distributed group joined
        imports          the model's code imported (transformers)
        model            the model built, its weights loaded
        engine           the training engine built
        rollout engine   the generation engine built (on a GPU: its weights copied, its graphs captured)
        built            the role's worker ready
    validation         the held-out prompts answered with the weights before the first update
                       (validation.before_train): issued behind the first step's batch, scored after its update
    first_step         the first step of this start trained (on a GPU: most of the compilation)

`hpcrl status` shows the newest start's phases, `hpcrl report` a table of them, and the first step's
metrics record `timing/startup`: the seconds from the start's beginning to its end.
"""
from __future__ import annotations

import time

ROLE_PHASES = ("process", "group", "imports", "model", "engine", "rollout engine", "built")


class StartupClock:
    """Says each phase of this start as it ends: an event, and the status's `startup` summary."""

    def __init__(self, status, began: float, since: str, phases: list[tuple[str, float]] = ()):
        self.status, self.began, self.last = status, began, began
        self.first_step_done = False
        status.doc["startup"] = {"began": round(began, 3), "since": since, "phases": {}, "slowest": {}}
        for name, ended in phases:
            self.phase(name, ended)

    def phase(self, name: str, ended: float | None = None) -> None:
        """The run's own phase `name` ended (now, or at `ended`): an event, which writes the status."""
        ended = time.time() if ended is None else ended
        self.status.doc["startup"]["phases"][name] = round(ended - self.began, 2)
        self.status.event("startup", **self._fields(name, None, None, ended - self.last, ended))
        self.last = max(self.last, ended)

    def roles(self, started: dict[str, list[dict]]) -> None:
        """Every role's ranks' phases (WorkerGroup.startup), then the `roles` phase; the status keeps,
        per phase, the rank that took longest."""
        slowest, said = self.status.doc["startup"]["slowest"], []
        for role, ranks in started.items():
            for rank, s in enumerate(ranks):
                for name, ended, took in s["phases"]:
                    said.append(self._fields(name, role, rank, took, ended))
                    if took > slowest.get(name, {}).get("seconds", -1.0):
                        slowest[name] = {"role": role, "rank": rank, "seconds": round(took, 2)}
        self.status.events("startup", said)
        self.phase("roles")

    def logged(self, record: dict) -> None:
        """A metrics record was logged: the first step's (or the validation before it) ends a phase;
        the first step's record gets timing/startup."""
        if self.first_step_done:
            return
        if "timing/step" in record:
            self.first_step_done = True
            record["timing/startup"] = round(time.time() - self.began, 2)
            self.phase("first_step")
        elif any(k.startswith("val/") for k in record):
            self.phase("validation")

    def _fields(self, phase: str, role: str | None, rank: int | None, took: float, ended: float) -> dict:
        return {"phase": phase, "role": role, "rank": rank, "seconds": round(took, 3),
                "since_start": round(ended - self.began, 3)}


def slowest_phases(ranks: list[dict], since: float) -> dict[str, float]:
    """Per phase of the ranks' starts (WorkerGroup.startup) since `since`, the seconds of the slowest
    rank's: what a standby process did before (its start, its imports) is left out, and a process Ray
    had started before, idle, counts from `since`."""
    out: dict[str, float] = {}
    for s in ranks:
        for name, ended, took in s["phases"]:
            if ended > since:
                out[name] = round(max(out.get(name, 0.0), min(took, ended - since)), 3)
    return out


def format_startup(startup: dict) -> str:
    """One line of `hpcrl status`: each phase's end, seconds from the start's beginning, and the
    slowest rank's phases."""
    phases = ", ".join(f"{name} {at:.1f}" for name, at in startup["phases"].items())
    slow = "; ".join(f"{name} {s['seconds']:.1f} s ({s['role']} rank {s['rank']})" for name, s in startup["slowest"].items()
                     if s["seconds"] >= 0.5)
    return (f"start (s since {startup['since']}): {phases or 'nothing yet'}"
            + (f"\n  slowest role phases: {slow}" if slow else ""))


def starts(events: list[dict]) -> list[dict]:
    """Each start's phases from events.jsonl, in order: {"phases": {phase: seconds since the start
    began}, "slowest": {role phase: (role, rank, seconds)}}; queued, requeued, or a run phase the
    start has seen already begins the next."""
    out: list[dict] = []
    for e in events:
        if e["event"] != "startup":
            continue
        if e["role"] is None and (not out or e["phase"] in out[-1]["phases"] or e["phase"] in ("queued", "requeued")):
            out.append({"phases": {}, "slowest": {}})
        if not out:
            continue
        if e["role"] is None:
            out[-1]["phases"][e["phase"]] = e["since_start"]
        elif e["seconds"] > out[-1]["slowest"].get(e["phase"], (None, None, -1.0))[2]:
            out[-1]["slowest"][e["phase"]] = (e["role"], e["rank"], e["seconds"])
    return out
