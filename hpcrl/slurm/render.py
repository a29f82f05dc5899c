"""HetJob -> a readable heterogeneous sbatch script, through `templates/hetjob.sbatch.j2`.

The checkout's templates/ folder is the package `hpcrl.templates` once installed (setup.cfg maps it),
so a wheel carries its template and renders without the checkout."""
from __future__ import annotations

import functools

import jinja2

from hpcrl._version import __version__
from hpcrl.env_vars import JobEnv
from hpcrl.run_dir import RunDir
from hpcrl.slurm import directives
from hpcrl.slurm.job import HetJob


@functools.cache     # one per process: an environment compiles each template once (~50 ms), on first use
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


def component_steps(job: HetJob) -> list[dict[str, str]]:
    """Per component, the shell text of the steps that run hpcrl's Ray and training code: `node`
    (after `srun ... --overlap`), and for component 0 `wait` (the barrier) and `driver` (both in the
    batch shell); each in the component's container where it has one (hpcrl/slurm/container.py)."""
    run = f'"${JobEnv.var("run_dir")}"'
    out = []
    for c in job.components:
        box, python = c.container, job.python
        if box is None:
            steps = {"node": f"{python} -m hpcrl.raycluster node {run}", "wait": f"{python} -m hpcrl.raycluster wait {run}",
                     "driver": f"exec {job.driver.strip()}"}
        elif box.runtime == "pyxis":
            srun = " ".join(map(directives.shell_word, box.srun_options(str(job.run_dir))))
            one = f"srun {'--het-group=0 ' if len(job.components) > 1 else ''}--nodes=1 --ntasks=1 --overlap {srun}"
            py = directives.shell_word(box.python)
            steps = {"node": f"{srun} {py} -m hpcrl.raycluster node {run}", "wait": f"{one} {py} -m hpcrl.raycluster wait {run}",
                     "driver": f"exec {one} {py} -m hpcrl.launch {run}"}
        else:
            inside = " ".join(map(directives.shell_word, [box.image if box.image_is_path else "", *box.prefix(str(job.run_dir), c.gpus_per_node > 0),
                                                          box.python]))
            steps = {"node": f"bash -c 'hpcrl_in \"$@\"' hpcrl_in {inside} -m hpcrl.raycluster node {run}",
                     "wait": f"(hpcrl_in {inside} -m hpcrl.raycluster wait {run})",
                     "driver": f"hpcrl_in {inside} -m hpcrl.launch {run}"}
        out.append(steps)
    return out


def render_hetjob(job: HetJob, payload: str | None = None, signal: str | None = None) -> str:
    """The batch script. Once every node's Ray has joined it runs the job's driver (with signal
    forwarding and the requeue step) or, given instead, `payload` (submitit's step) as it is, then
    the requeue step of a job that submitit requeues itself (after-submitit); `signal` is the
    `--signal` value (default: USR1 to the batch shell `signal_lead` seconds before the time limit).
    Raises directives.UnsafeValue, naming each field, when a value cannot stand in the script."""
    problems = directives.problems(job, str(job.run_dir))
    if problems:
        raise directives.UnsafeValue(problems)
    return template_environment().get_template("hetjob.sbatch.j2").render(
        job=job, version=__version__, table=component_table(job), payload=(payload or "").strip(),
        options=[directives.component_lines(c)[0] for c in job.components],
        driver=job.driver.strip() if payload is None else "", signal=signal or f"B:USR1@{job.signal_lead_s}",
        steps=component_steps(job), containers=any(c.container for c in job.components),
        container_env=[kv for c in job.components if c.container for kv in c.container.exports()],
        paths=RunDir(job.run_dir), run_dir_var=JobEnv.var("run_dir"), deadline_var=JobEnv.var("deadline"))
