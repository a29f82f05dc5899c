"""`submit(spec)`: a JobSpec checked before anything is written, then submitted as one hetjob."""
from __future__ import annotations

import sys
from typing import Callable

from hpcrl.job.checks import problems_before_submit
from hpcrl.job.spec import JobSpec, SpecError
from hpcrl.launch.submitit import training_function
from hpcrl.slurm.cluster_info import ClusterInfo
from hpcrl.slurm.job import HetJob
from hpcrl.slurm.render import render_hetjob
from hpcrl.slurm.submit import JobHandle, submit_hetjob


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


def submit(spec: JobSpec, via: str = "sbatch", *, resume: bool = False, dry_run: bool = False,
           fn: Callable | None = None, args: tuple = ()) -> JobHandle | str:
    """Submit a JobSpec (see `hpcrl.load_spec`) as one heterogeneous job; returns its JobHandle (with
    dry_run, the batch script instead, nothing written). With `train:` the job trains (through
    submitit, the driver is a Checkpointable); `fn` runs another function in component 0 (submitit)."""
    job = checked_hetjob(spec)
    if dry_run:
        return render_hetjob(job)
    return submit_hetjob(job, via, resume=resume, spec_data=spec.as_data(),
                         fn=fn or training_function(spec, via), args=args)
