"""What the driver publishes about its run, so a login node can see it without a Ray connection.

    RUN_DIR/status.json    rewritten (atomically) at every phase and whenever a role starts or
                           ends a rebuild: state, step, phase, each role's ranks and health, the
                           last committed checkpoint
    RUN_DIR/events.jsonl   appended: start (and from which checkpoint), checkpoint (step, size,
                           seconds), rebuild and rebuilt (a role, and the batches generated ahead
                           meanwhile), stop (why), finish, fail; one JSON object per line

Both survive the job: `hpcrl status` and `hpcrl report` read them during the run and after it.
Neither may stop a run: when the run directory cannot take a write (a full disk), the status
waits and the events queue, and both are written once the directory takes writes again.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from hpcrl.run_dir import RunDir


class RunStatus:
    def __init__(self, run_dir: Path, total_steps: int):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.groups: dict = {}
        self.unwritten: list[dict] = []       # events the run directory refused, in order
        self.doc = {"state": "starting", "step": 0, "total_steps": total_steps, "phase": "starting the roles",
                    "phase_since": time.time(), "started": time.time(), "pid": os.getpid(), "last_checkpoint": None,
                    "last_snapshot": None, "validation": None, "error": None}
        self.write()

    def attach(self, groups: dict) -> None:
        """The role WorkerGroups, once started: their ranks and health go into every write."""
        self.groups = groups
        for wg in groups.values():
            wg.on_change(self.write)
        self.write()

    def phase(self, step: int, phase: str) -> None:
        self.doc.update(state="running", step=step, phase=phase, phase_since=time.time())
        self.write()

    def snapshotted(self, step: int, nbytes: int, seconds: float, spills: list[str] = ()) -> None:
        """The training roles' newest snapshot: the state a rebuilt role takes back (written with the
        next phase: one write less a step); `spills`: where it does not fit in memory."""
        self.doc["last_snapshot"] = {"step": step, "bytes": nbytes, "seconds": round(seconds, 3), "spills": list(spills)}

    def validated(self, step: int, scores: dict[str, float]) -> None:
        """The newest validation's scores (val/score, per data source, response lengths)."""
        self.doc["validation"] = {"step": step, **scores}
        self.write()

    def event(self, kind: str, **fields) -> dict:
        """Append one event; `checkpoint`, `finish`, `stop` and `fail` also change the status."""
        return self.events(kind, [fields])[0]

    def events(self, kind: str, many: list[dict]) -> list[dict]:
        """Append events of one kind, each of the given fields, in one write (a start's hundreds of
        per-rank `startup` events); the status is written once, after them."""
        records = [{"time": round(time.time(), 3), "event": kind, **fields} for fields in many]
        self.unwritten.extend(records)
        try:
            with open(RunDir(self.run_dir).events, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in self.unwritten))
            self.unwritten.clear()
        except OSError:
            pass         # kept for the next event
        last = records[-1]
        if kind == "checkpoint":
            self.doc["last_checkpoint"] = {"step": last["step"], "time": last["time"]}
        elif kind in ("finish", "stop", "fail"):
            self.doc.update(state={"finish": "finished", "stop": "stopped", "fail": "failed"}[kind], phase=None,
                            error=last.get("error"))
        self.write()
        return records

    def write(self) -> None:
        doc = {**self.doc, "updated": time.time(), "roles": {r: wg.describe() for r, wg in self.groups.items()}}
        path = RunDir(self.run_dir).status
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(doc, indent=1))
            os.replace(tmp, path)   # no fsync: advisory, rewritten every phase
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)     # the next write says it all again


def read_status(run_dir: Path) -> dict | None:
    path = RunDir(run_dir).status
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_events(run_dir: Path) -> list[dict]:
    path = RunDir(run_dir).events
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
