"""`hpcrl ls [DIR]`: the runs under a folder, a line each, like `squeue` for runs.

A run is a folder holding job.json (submitted) or status.json (a local run). Each line comes from
Slurm (the job's state, its leader's: the component that runs the driver) and the run's files: the
driver's state, step/total, the newest committed checkpoint, the last reward and held-out score.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from hpcrl.checkpoint.store import CheckpointStore
from hpcrl.observe.metrics import read_metrics
from hpcrl.observe.status import read_status
from hpcrl.run_dir import RunDir
from hpcrl.slurm.cluster_info import SlurmCommandError
from hpcrl.slurm.sbatch import SubmitError, component_states

COLUMNS = [("run", "RUN", "<"), ("job", "JOB", ">"), ("state", "STATE", "<"), ("driver", "DRIVER", "<"),
           ("step", "STEP", ">"), ("checkpoint", "CKPT", ">"), ("reward", "REWARD", ">"), ("val", "VAL", ">")]


def find_runs(root: str | Path, depth: int = 3) -> list[Path]:
    """root itself when it is a run, else the runs up to `depth` folders below it, sorted by path."""
    root = Path(root)

    def is_run(p: Path) -> bool:
        return RunDir(p).job.exists() or RunDir(p).status.exists()
    if is_run(root):
        return [root]
    found, level = [], [root]
    for _ in range(depth):
        level = sorted(d for p in level if os.access(p, os.R_OK | os.X_OK)      # another user's folder: skipped
                       for d in p.iterdir() if d.is_dir() and not d.name.startswith("."))
        found += [d for d in level if is_run(d)]
        level = [d for d in level if not is_run(d)]
    return sorted(found)


def run_row(run_dir: Path, root: Path | None = None) -> dict:
    """One run's line, as values (None where the run has nothing to say yet)."""
    paths = RunDir(run_dir)
    job = json.loads(paths.job.read_text()) if paths.job.exists() else None
    state = "local"
    if job:
        try:
            states = component_states(job["job_id"])
            state = states.get(0) or next(iter(states.values()))
        except (SubmitError, SlurmCommandError):
            state = "?"         # Slurm unreachable, or the job forgotten by slurmctld and accounting
    status = read_status(paths.root) or {}
    store = CheckpointStore(paths.root, keep_last=0)
    steps = store.committed_steps() if paths.ckpt.exists() else []
    records = read_metrics(paths.metrics)
    last = lambda key: next((r[key] for r in reversed(records) if r.get(key) is not None), None)  # noqa: E731
    return {"run": str(run_dir.relative_to(root)) if root and run_dir != root else str(run_dir),
            "job": job["job_id"] if job else None, "state": state, "driver": status.get("state"),
            "step": f"{status['step']}/{status['total_steps']}" if status else None,
            "checkpoint": steps[-1] if steps else None, "reward": last("reward/mean"), "val": last("val/score")}


def list_runs(root: str | Path) -> list[dict]:
    root = Path(root)
    return [run_row(run, root) for run in find_runs(root)]


def format_runs(rows: list[dict]) -> str:
    def cell(v):
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
    table = [[title for _, title, _ in COLUMNS]] + [[cell(r[key]) for key, _, _ in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(f"{v:{align}{w}}" for v, w, (_, _, align) in zip(row, widths, COLUMNS)).rstrip()
                     for row in table)
