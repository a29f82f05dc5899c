"""`submit(spec)`: a JobSpec checked before anything is written, then submitted as one hetjob."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from hpcrl.jobspec.checks import problems_before_submit
from hpcrl.jobspec.load import configure, load_spec
from hpcrl.jobspec.models import JobSpec, SpecError
from hpcrl.launch.submitit import training_function
from hpcrl.slurm.cluster_info import ClusterInfo
from hpcrl.slurm.job import HetJob
from hpcrl.slurm.render import render_hetjob
from hpcrl.slurm.sbatch import JobHandle, submit_hetjob


def hetjob_of(spec: JobSpec) -> HetJob:
    """The spec as Slurm sees it, its steps run by this interpreter unless the spec names another."""
    return spec.to_hetjob(python=sys.executable)


def checked_hetjob(spec: JobSpec, offline: bool = False) -> HetJob:
    """The HetJob, once the job's interpreter and (unless offline) the live cluster have no problem
    with it; a SpecError listing every problem otherwise."""
    job = hetjob_of(spec)
    problems = problems_before_submit(spec, job, None if offline else ClusterInfo.live())
    if problems:
        raise SpecError(problems, job.source_file or spec.name)
    return job


def submit(spec: JobSpec | str | Path, via: str = "sbatch", *, overrides: list[str] | dict | None = None,
           run_dir: str | Path | None = None, resume: bool = False, wait: bool = False, dry_run: bool = False,
           fn: Callable | None = None, args: tuple = ()) -> JobHandle | str:
    """`hpcrl submit` from Python: submit a job spec as one heterogeneous job, checked first.

    spec: a JobSpec (`hpcrl.load_spec`) or the path of its YAML file, as the command takes it.
    via: "sbatch" (the rendered batch script) or "submitit" (the driver as a Checkpointable).
    overrides: fields set by dotted path, ["train.optim.actor_lr=1e-6"] or {"train.optim.actor_lr": 1e-6}
    (PATH=VALUE). run_dir: the run directory instead of the spec's (--run-dir). resume: continue the run already
    in it (--resume). wait: return once every component has ended (--wait). dry_run: return the
    batch script, nothing written (--dry-run). fn, args: run another function in component 0
    (submitit). Returns the JobHandle (job_id, state(), wait(), logs(role))."""
    if not isinstance(spec, JobSpec):
        spec = load_spec(spec, run_dir=run_dir, overrides=overrides)
    elif run_dir is not None or overrides:
        spec = configure(spec, run_dir, overrides)
    job = checked_hetjob(spec)
    if dry_run:
        return render_hetjob(job)
    handle = submit_hetjob(job, via, resume=resume, spec_data=spec.as_data(),
                           fn=fn or training_function(spec, via), args=args)
    if wait:
        handle.wait()
    return handle
