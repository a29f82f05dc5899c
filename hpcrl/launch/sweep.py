"""`sweep(spec, axes)`: one hetjob per combination of values, every one checked before any is submitted.

    hpcrl sweep SPEC train.optim.actor_lr=1e-6,3e-6,1e-5 train.seed=1,2 [PATH=VALUE ...] [--max-running N]

Slurm job arrays cannot hold heterogeneous jobs, so each combination is a hetjob of its own, in
SWEEP_DIR/<name>/ (SWEEP_DIR: run_dir, or the spec's), named by its values (`actor_lr-1e-6_seed-1`).
Each combination is merged and checked as `hpcrl submit` checks one spec, against the live
cluster, and the run directories are checked free, before the first is submitted: one bad
combination submits nothing. `max_running=N` keeps at most N running through Slurm dependencies
(the run N places later waits, afterany, for this one to end), so nothing has to stay running on
the login node. SWEEP_DIR/sweep.json records the spec, the axes and every run's values and job id
(`hpcrl sweep status`, `hpcrl ls`, `hpcrl report SWEEP_DIR`).
"""
from __future__ import annotations

import itertools
import json
import re
import time
from pathlib import Path
from typing import Any, Callable

from hpcrl.files import atomic_write_text
from hpcrl.jobspec.checks import problems_before_submit
from hpcrl.jobspec.load import configure, parse_spec, read_spec_data
from hpcrl.jobspec.overrides import OverrideError, parse_overrides, parse_sweep
from hpcrl.jobspec.models import JobSpec, SpecError
from hpcrl.launch.submit import hetjob_of
from hpcrl.launch.submitit import training_function
from hpcrl.run_dir import SweepDir
from hpcrl.slurm.cluster_info import ClusterInfo
from hpcrl.slurm.sbatch import JobHandle, SubmitError, check_run_dir, submit_hetjob


def run_name(values: dict[str, str]) -> str:
    """The run's folder: each axis by its last part (the whole path where two share it) and value."""
    last = [p.rsplit(".", 1)[-1] for p in values]
    parts = [f"{p if last.count(p.rsplit('.', 1)[-1]) > 1 else p.rsplit('.', 1)[-1]}-{text}"
             for p, text in values.items()]
    return re.sub(r"[^A-Za-z0-9._+-]", "_", "_".join(parts))


def combinations(axes: dict[str, list[tuple[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """(name, {path: value}) for every combination, the last axis varying fastest."""
    out = []
    for combo in itertools.product(*axes.values()):
        out.append((run_name({p: text for p, (text, _) in zip(axes, combo)}),
                    {p: value for p, (_, value) in zip(axes, combo)}))
    return out


def sweep(spec: str | Path | JobSpec, axes: list[str] | dict[str, list], via: str = "sbatch", *,
          overrides: list[str] | dict[str, Any] | None = None, run_dir: str | Path | None = None,
          max_running: int | None = None, dry_run: bool = False,
          say: Callable[[str], None] = lambda _: None) -> list[JobHandle] | list[tuple[str, dict]]:
    """`hpcrl sweep` from Python: submit one hetjob per combination of the axes' values.

    spec: a spec file's path, or a JobSpec. axes: the command's words (["train.optim.actor_lr=1e-6,3e-6",
    "train.seed=1,2", "train.total_steps=40"]: a single value is an override of every run) or
    {path: [values]}. overrides: set in every run, as for `hpcrl submit`. run_dir: the sweep's
    folder (default the spec's run_dir). max_running: at most this many jobs at once (None: all).
    dry_run: check everything, submit nothing, return [(name, values)]. Returns the JobHandles in
    the order of the combinations. SpecError naming each bad combination, before any submission."""
    base = spec if isinstance(spec, JobSpec) else parse_spec(read_spec_data(spec), str(spec))
    source = base.source
    try:
        fixed, grid = parse_sweep(axes) if isinstance(axes, list) else ({}, {
            p: [(json.dumps(v) if not isinstance(v, str) else v, v) for v in vs] for p, vs in axes.items()})
        fixed = {**parse_overrides(overrides or {}), **fixed}     # overrides are never axes
    except OverrideError as e:
        raise SpecError([f"override {p}" for p in e.problems], source) from None
    if not grid:
        raise SpecError(["a sweep needs an axis: PATH=VALUE,VALUE,... (e.g. train.seed=1,2)"], source)
    if max_running is not None and max_running < 1:
        raise SpecError([f"--max-running: {max_running}; at least 1 (or leave it out: all at once)"], source)
    where = SweepDir(Path(run_dir or base.run_dir).expanduser().resolve())
    runs, problems, info = combinations(grid), [], ClusterInfo.live()
    if where.record.exists():
        problems.append(f"run_dir: {where.root} holds a sweep already ({where.record.name}); choose another --run-dir")
    checked = []
    for name, values in runs:
        try:
            one = configure(base, where.run(name), {**fixed, **values})
            job = hetjob_of(one)
            problems += [f"{name}: {p}" for p in problems_before_submit(one, job, info)]
            check_run_dir(job.run_dir, resume=False)
            checked.append((name, values, one, job))
        except SpecError as e:
            problems += [f"{name}: {p}" for p in e.problems]
        except SubmitError as e:
            problems.append(f"{name}: {e}")
    if problems:
        raise SpecError(problems + ["nothing of the sweep was submitted"], source)
    if dry_run:
        return runs
    record = {"spec": str(Path(source).resolve()) if not isinstance(spec, JobSpec) else source, "via": via,
              "axes": {p: [text for text, _ in vs] for p, vs in grid.items()}, "overrides": fixed,
              "max_running": max_running, "submitted_at": time.time(), "runs": []}
    handles = []
    for i, (name, values, one, job) in enumerate(checked):
        after = handles[i - max_running].job_id if max_running and i >= max_running else None
        handle = submit_hetjob(job, via, spec_data=one.as_data(), fn=training_function(one, via),
                               dependency=f"afterany:{after}" if after else None)
        handles.append(handle)
        record["runs"].append({"name": name, "values": values, "job_id": handle.job_id, "after": after})
        atomic_write_text(where.record, json.dumps(record, indent=1))      # what was submitted, even if a later one fails
        say(f"submitted job {handle.job_id}: {name}" + (f" (starts once job {after} has ended)" if after else ""))
    return handles

