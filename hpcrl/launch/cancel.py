"""`cancel(run_dir)`: a last committed checkpoint, then the run's job ends without a requeue.

The run's `cancel` file asks the driver to stop after its current step at a committed checkpoint
(it reads the file after every step, as it reads Slurm's signals); the batch script then does not
requeue and cancels the job itself, so the job ends CANCELLED as after `scancel`. A job with no
driver to ask (pending, or between two starts), one whose driver has not stopped within the
timeout, and `now=True` are cancelled by `scancel` at once: the last committed checkpoint stays.
A run on a local Ray (`hpcrl run --local`) stops the same way, without Slurm.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from hpcrl.checkpoint.store import CheckpointStore
from hpcrl.observe.status import read_status
from hpcrl.run_dir import RunDir
from hpcrl.slurm.cluster_info import SlurmCommandError, slurm_cmd
from hpcrl.slurm.sbatch import LIVE, TERMINAL, SubmitError, component_states

DRIVER_LIVE = ("starting", "running")


def cancel(run_dir: str | Path, now: bool = False, timeout: float = 600.0, poll_s: float = 1.0,
           say: Callable[[str], None] = print) -> dict:
    """Cancel the run in run_dir; returns {"job_id", "states" (per component, None for a local run),
    "checkpoint" (the newest committed step, or None), "how" ("checkpoint" or "scancel")}.
    SubmitError when nothing of the run is running."""
    paths = RunDir(run_dir)
    job_id = json.loads(paths.job.read_text())["job_id"] if paths.job.exists() else None
    driver = (read_status(paths.root) or {}).get("state")
    states = component_states(job_id) if job_id else None
    if (states is not None and not any(s in LIVE for s in states.values())) or (states is None and driver not in DRIVER_LIVE):
        what = f"job {job_id} is {'/'.join(sorted(set(states.values())))}" if states else f"its driver is {driver or 'not started'}"
        raise SubmitError(f"{paths.root}: nothing to cancel, {what}")
    asks_driver = not now and (states is None or states.get(0) == "RUNNING")
    how = "scancel"
    if asks_driver:
        paths.cancel.write_text(f"{time.time():.3f}\n")
        say(f"asked the driver for a last checkpoint ({paths.cancel}); waiting up to {timeout:.0f} s")
        how = "checkpoint" if _wait(paths, job_id, timeout, poll_s) else "scancel"
        if how == "scancel":
            say(f"the driver did not stop within {timeout:.0f} s: scancel")
    if how == "scancel" and job_id:
        _scancel(job_id)
        _wait(paths, job_id, timeout, poll_s)
    steps = CheckpointStore(paths.root, keep_last=0).committed_steps() if paths.ckpt.exists() else []
    return {"job_id": job_id, "states": component_states(job_id) if job_id else None,
            "checkpoint": steps[-1] if steps else None, "how": how}


def _wait(paths: RunDir, job_id: str | None, timeout: float, poll_s: float) -> bool:
    """Until the job has ended (a local run: its driver stopped); False on timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if job_id and all(s in TERMINAL for s in component_states(job_id).values()):
            return True
        if not job_id and (read_status(paths.root) or {}).get("state") not in DRIVER_LIVE:
            return True
        time.sleep(poll_s)
    return False


def _scancel(job_id: str) -> None:
    try:
        slurm_cmd("scancel", job_id)     # the leader's id cancels every component
    except SlurmCommandError as e:
        if "already completed" not in str(e) and "Invalid job id" not in str(e):
            raise SubmitError(f"scancel {job_id}: {e}") from None
