"""HetJob -> a readable heterogeneous sbatch script, through `templates/hetjob.sbatch.j2`."""
from __future__ import annotations

import os
import shlex
from pathlib import Path

import jinja2

from hpcrl.slurm.job import HetJob

TEMPLATES = Path(os.environ.get("HPCRL_TEMPLATES", Path(__file__).resolve().parents[2] / "templates"))


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    env.filters["q"] = lambda v: shlex.quote(str(v))
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
    `--signal` value (default: USR1 to the batch shell `signal_lead` seconds before the time limit)."""
    from hpcrl import __version__

    return _environment().get_template("hetjob.sbatch.j2").render(
        job=job, version=__version__, table=component_table(job), payload=(payload or "").strip(), driver=job.driver.strip() if payload is None else "",
        signal=signal or f"B:USR1@{job.signal_lead_s}")
