"""Satellite jobs: more nodes for some members of a running hetjob, each node a job of its own.

A Slurm allocation cannot grow in place. A satellite is an ordinary one-node job (on the members'
partition or another) whose one step starts a Ray node that joins the run's cluster for those
members (hpcrl/raycluster/node.py: run_satellite). One job per node: each starts as soon as a node is
free, and each can end (cancelled, preempted, timed out) without the others.

RUN_DIR/satellites.json records what was asked for and what was submitted:

    {"targets": {"reward": {"nodes": 3, "options": {"partition": "cpu", "time": "00:30:00"}}},
     "jobs": [{"job_id": "41", "members": "reward", "run_id": "5c1d...", "submitted_at": 1796...}, ...]}

`hpcrl scale` and each start of the driver change it, each under an exclusive lock (`locked_record`),
and a satellite is in it as soon as its sbatch returns (`submit_recorded`).

Each end of the main job's batch script cancels the run's satellites (`end`): they end with every
start of the job, and the next start asks for them again. Knows nothing about RL: members are labels.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hpcrl._version import __version__
from hpcrl.files import atomic_write_text
from hpcrl.env_vars import JobEnv
from hpcrl.run_dir import RunDir
from hpcrl.slurm import directives
from hpcrl.slurm.cluster_info import SlurmCommandError, slurm_cmd
from hpcrl.slurm.job import HetJob
from hpcrl.slurm.render import template_environment


def read_record(run_dir: str | Path) -> dict:
    path = RunDir(run_dir).satellites
    record = json.loads(path.read_text()) if path.exists() else {}
    return {"targets": record.get("targets", {}), "jobs": record.get("jobs", [])}


def write_record(run_dir: str | Path, record: dict) -> None:
    atomic_write_text(RunDir(run_dir).satellites, json.dumps(record, indent=1))


@contextmanager
def locked_record(run_dir: str | Path) -> Iterator[dict]:
    """The record, read under an exclusive lock that holds until the block ends (flock on
    satellites.json.lock beside it): whoever changes the record writes it back (write_record) inside
    the block, so that `hpcrl scale` and a driver's start at once never lose each other's change."""
    path = RunDir(run_dir).satellites
    with open(path.with_name(f"{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)      # released as the file closes (or its process ends)
        yield read_record(run_dir)


def render_satellite(job: HetJob, main_job: str, run_id: str) -> str:
    """The batch script of one satellite: `job` has one component of one node, whose members the
    node serves. Raises directives.UnsafeValue, naming each field, when a value cannot stand in it."""
    paths = RunDir(job.run_dir)
    output = str(paths.logs / "satellite-%j.out")
    found = directives.problems(job, output.replace("%j", "0"))
    if len(job.components) != 1 or job.components[0].nodes != 1:
        found.append(f"a satellite is one job of one node, not {[c.nodes for c in job.components]}")
    if found:
        raise directives.UnsafeValue(found)
    c = job.components[0]
    return template_environment().get_template("satellite.sbatch.j2").render(
        job=job, c=c, version=__version__, main_job=main_job, run_id=run_id, output=output,
        options=directives.component_lines(c)[0], run_dir_var=JobEnv.var("run_dir"), paths=paths, container_env=[])


def submit_satellite(job: HetJob, main_job: str, run_id: str) -> dict:
    """Render and submit one satellite; its entry for the record's "jobs"."""
    members = ",".join(job.components[0].members)
    path = RunDir(job.run_dir).satellite_script(members)
    atomic_write_text(path, render_satellite(job, main_job, run_id))
    # from the driver's start, whose environment holds the secrets (the batch script read secrets.env):
    # the satellite's script reads them as the main job's does, sbatch is not given them
    job_id = slurm_cmd("sbatch", "--parsable", str(path), env=job.sbatch_env(outside_any_job())).strip().split(";")[0]
    return {"job_id": job_id, "members": members, "run_id": run_id, "submitted_at": round(time.time(), 3)}


def submit_recorded(run_dir: str | Path, record: dict, jobs: list[HetJob], main_job: str, run_id: str) -> list[str]:
    """Submit each satellite of `jobs`, each put in `record` and written to disk as soon as its sbatch
    returns: an sbatch that fails midway leaves every satellite submitted before it recorded, so the
    job's end cancels it. Call it inside locked_record. Returns the job ids."""
    ids = []
    for job in jobs:
        entry = submit_satellite(job, main_job, run_id)
        record["jobs"].append(entry)
        write_record(run_dir, record)
        ids.append(entry["job_id"])
    return ids


def outside_any_job() -> dict[str, str]:
    """This environment without the variables of the job it may run in: sbatch passes the submitting
    environment on, and a satellite submitted from inside the hetjob (its next start asks for it)
    would take the hetjob's SLURM_* for its own (srun: "No directives to start application on any
    available hetjob components")."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) or k == "SLURM_CONF"}


def live_states(job_ids: list[str]) -> dict[str, str]:
    """Job id -> Slurm state of those among `job_ids` still in the queue (pending, running, ...);
    a satellite missing here has ended."""
    if not job_ids:
        return {}
    out = slurm_cmd("squeue", "-h", "--me", "-o", "%i|%T")
    wanted = set(job_ids)
    return {jid: state for jid, _, state in (line.strip().partition("|") for line in out.splitlines()) if jid in wanted}


def cancel_jobs(job_ids: list[str]) -> None:
    if job_ids:
        try:
            slurm_cmd("scancel", *job_ids)
        except SlurmCommandError as e:
            if "already completed" not in str(e) and "Invalid job id" not in str(e):
                raise


def end(run_dir: str | Path) -> list[str]:
    """Cancel every satellite of the run still in the queue (the main job's batch script, on exit);
    the ids cancelled. The targets stay: the run's next start asks for them again."""
    record = read_record(run_dir)
    live = list(live_states([j["job_id"] for j in record["jobs"]]))
    cancel_jobs(live)
    return live


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "end":
        print("usage: python -m hpcrl.slurm.satellite end RUN_DIR   (the batch script's exit: cancel the run's satellites)",
              file=sys.stderr)
        return 2
    try:
        ended = end(argv[1])
    except SlurmCommandError as e:
        print(f"[hpcrl] satellites of {argv[1]} not cancelled: {e}", file=sys.stderr, flush=True)
        return 1
    if ended:
        print(f"[hpcrl] cancelled satellite jobs {' '.join(ended)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
