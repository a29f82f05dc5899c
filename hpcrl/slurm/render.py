"""HetJob -> a readable heterogeneous sbatch script, through `templates/hetjob.sbatch.j2`.

The checkout's templates/ folder is the package `hpcrl.templates` once installed (setup.cfg maps it),
so a wheel carries its template and renders without the checkout."""
from __future__ import annotations

import jinja2

from hpcrl._version import __version__
from hpcrl.job_env import JobEnv
from hpcrl.run_dir import RunDir
from hpcrl.slurm import directives
from hpcrl.slurm.job import HetJob


def template_environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("hpcrl.templates", ""), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    env.filters["q"] = directives.shell_word
    env.filters["comment"] = directives.comment
    return env


def component_table(job: HetJob) -> list[str]:
    rows = [("component", "roles", "partition", "nodes", "gres/node")]
    rows += [(str(i), ",".join(c.members), c.partition, str(c.nodes), str(c.gres or "-"))
             for i, c in enumerate(job.components)]
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def render_hetjob(job: HetJob, payload: str | None = None, signal: str | None = None) -> str:
    """The batch script. Once every node's Ray has joined it runs the job's driver (with signal
    forwarding and the requeue step) or, given instead, `payload` as it is; `signal` is the
    `--signal` value (default: USR1 to the batch shell `signal_lead` seconds before the time limit).
    Raises directives.UnsafeValue, naming each field, when a value cannot stand in the script."""
    problems = directives.problems(job, str(job.run_dir))
    if problems:
        raise directives.UnsafeValue(problems)
    return template_environment().get_template("hetjob.sbatch.j2").render(
        job=job, version=__version__, table=component_table(job), payload=(payload or "").strip(),
        options=[directives.component_lines(c)[0] for c in job.components],
        driver=job.driver.strip() if payload is None else "", signal=signal or f"B:USR1@{job.signal_lead_s}",
        paths=RunDir(job.run_dir), run_dir_var=JobEnv.var("run_dir"), deadline_var=JobEnv.var("deadline"))
