"""`RunDir`: every path of a run directory, named once.

A run directory lives on storage that the login node and every compute node see. The batch script,
the Ray nodes, the driver, the roles and the login-node commands meet only there:

    RUN_DIR/spec.yaml          the validated spec (the driver reads it back)
            job.sbatch         the rendered batch script
            job.json           the submitted job: id, via, component of each role
            secrets.env        the values of the spec's `secrets:` (0600), sourced by job.sbatch at start
            satellites.json    hpcrl scale: the nodes asked for each role, the satellite jobs submitted (satellites.json.lock: its lock)
            satellite-<role>.sbatch   the batch script of the role's satellites
            allocation.json    the nodes of every component (written in the batch shell)
            stop               a signal the batch script noted before the driver ran
            cancel             `hpcrl cancel` asked for a last checkpoint and no requeue
            status.json        the driver's state, step, phase and roles (rewritten every phase)
            events.jsonl       start, checkpoint, stop, finish, fail
            metrics.jsonl      one record per step
            ray/               token (0600), cluster.json, ready.<run id>, stop.<run id>, failed/<node>
            logs/              slurm-<job id>.out, satellite-<job id>.out, <role>/rank<k>.log, <role>/rank<k>.calls.jsonl
                               (each call a rank ran: method, step, start, end, on a GPU its peak memory), ray/<node>.log
            ckpt/              the checkpoint store (its own layout: hpcrl/checkpoint/store.py)
            model/ prompts.jsonl   the built-in task's model and prompts, when the spec gives none
            cache/ tensorboard/ wandb/ report/ submitit/
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path


def log_stamp(t: float | None = None) -> str:
    """The date every log line of a run starts with (the driver's, a rank's, a Ray node task's), to
    the millisecond: `hpcrl logs` merges the files by it (hpcrl.observe.logs.line_time)."""
    t = time.time() if t is None else t
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))}.{int(t % 1 * 1000):03d}"


def rank_log(logs: Path, role: str, rank: int) -> Path:
    """One rank's log under a logs folder (the WorkerGroup writes it; RunDir.rank_log names it)."""
    return Path(logs) / role / f"rank{rank}.log"


def rank_calls(logs: Path, role: str, rank: int) -> Path:
    """The calls one rank ran, a JSON line each (its WorkerHost writes them; the report draws them)."""
    return Path(logs) / role / f"rank{rank}.calls.jsonl"


@dataclass(frozen=True)
class SweepDir:
    """A sweep's folder (`hpcrl sweep`): sweep.json (the spec, the axes, each run's name, values and
    job id) and one run directory per combination, SWEEP_DIR/<name>/."""
    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    @property
    def record(self) -> Path:
        return self.root / "sweep.json"

    def run(self, name: str) -> Path:
        return self.root / name

    def read(self) -> dict | None:
        """sweep.json, or None where this folder holds no sweep."""
        import json

        return json.loads(self.record.read_text()) if self.record.exists() else None

    @property
    def report(self) -> Path:
        return self.root / "report"


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    # --- written at submission
    @property
    def spec(self) -> Path:
        return self.root / "spec.yaml"

    @property
    def script(self) -> Path:
        return self.root / "job.sbatch"

    @property
    def job(self) -> Path:
        return self.root / "job.json"

    @property
    def secrets(self) -> Path:
        return self.root / "secrets.env"

    @property
    def submitit(self) -> Path:
        return self.root / "submitit"

    # --- hpcrl scale
    @property
    def satellites(self) -> Path:
        return self.root / "satellites.json"

    def satellite_script(self, members: str) -> Path:
        return self.root / f"satellite-{members}.sbatch"

    # --- written inside the job
    @property
    def allocation(self) -> Path:
        return self.root / "allocation.json"

    @property
    def stop(self) -> Path:
        return self.root / "stop"

    @property
    def cancel(self) -> Path:
        return self.root / "cancel"

    @property
    def status(self) -> Path:
        return self.root / "status.json"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def prompts(self) -> Path:
        return self.root / "prompts.jsonl"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    @property
    def report(self) -> Path:
        return self.root / "report"

    # --- the job's Ray cluster
    @property
    def ray(self) -> Path:
        return self.root / "ray"

    @property
    def ray_token(self) -> Path:
        return self.ray / "token"

    @property
    def ray_cluster(self) -> Path:
        return self.ray / "cluster.json"

    @property
    def ray_failed(self) -> Path:
        return self.ray / "failed"

    def ray_ready(self, run_id: str) -> Path:
        """Written once every node of this start of the job has joined (a requeued job starts again)."""
        return self.ray / f"ready.{run_id}"

    def ray_stop(self, run_id: str) -> Path:
        return self.ray / f"stop.{run_id}"

    # --- logs
    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def slurm_output(self) -> str:
        """The batch script's output file, as `#SBATCH --output` takes it (%j: the job id)."""
        return str(self.logs / "slurm-%j.out")

    def slurm_log(self, job_id: str = "*") -> Path:
        return self.logs / f"slurm-{job_id}.out"

    def role_logs(self, role: str) -> Path:
        return self.logs / role

    def rank_log(self, role: str, rank: int) -> Path:
        return rank_log(self.logs, role, rank)

    def rank_calls(self, role: str, rank: int) -> Path:
        return rank_calls(self.logs, role, rank)

    @property
    def ray_logs(self) -> Path:
        return self.logs / "ray"
