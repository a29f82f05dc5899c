"""`hpcrl scale RUN_DIR ROLE=N`: more (or fewer) nodes for a role while its run trains.

A role's nodes are its hetjob component's plus satellites: one-node jobs of their own
(hpcrl/slurm/satellite.py) on the role's partition, or another given by a flag, whose Ray node
joins the run's cluster with the run's token and the role's label. The driver gives their ranks work
from the next step on (hpcrl/controller: an elastic WorkerGroup follows its nodes), and a satellite
that ends (cancelled, preempted, timed out) only shrinks the role.

Which roles scale: those whose worker class is `elastic` (no trained state of their own, so a new
rank is as good as an old one): the reward role (rule or model), the reference, the separate rollout
role (it takes the actor's weights at every step), and your own roles without `state_dict`. The
actor and the critic cannot yet: their ranks train together (a new rank would need their parameters
and optimizer state, and the world size decides how each batch is split); roles sharing processes
(train.layout.colocate) cannot either.

The targets are recorded in RUN_DIR/satellites.json: each start of the job ends its satellites, and
the next start asks for them again (`reconcile`, run by the driver as it starts).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from hpcrl.jobspec import SpecError, load_spec
from hpcrl.jobspec.models import JobSpec
from hpcrl.run_dir import RunDir
from hpcrl.slurm import satellite
from hpcrl.slurm.job import Gres, HetJob, parse_mem_mb, parse_time_minutes
from hpcrl.slurm.sbatch import SubmitError, component_states

FLAGS = {"partition": ("partition", str), "time": ("time_min", parse_time_minutes),
         "gres": ("gres", lambda v: None if v == "none" else Gres.parse(v)), "cpus_per_task": ("cpus_per_task", int),
         "mem": ("mem_mb", parse_mem_mb), "account": ("account", str), "qos": ("qos", str),
         "constraint": ("constraint", str)}
"""What a satellite may ask for other than its role's component (hpcrl scale --partition ...): the
Component field each sets, parsed from Slurm's syntax (--gres none: no GRES)."""


def _spec(paths: RunDir) -> JobSpec:
    if not paths.job.exists():
        raise SubmitError(f"{paths.root}: no job.json; hpcrl scale grows a run submitted to Slurm (hpcrl submit), "
                          "not a local one")
    return load_spec(paths.spec, run_dir=paths.root)


def elastic_problem(spec: JobSpec, role: str) -> str | None:
    """Why `role` of this spec cannot take or give nodes while it trains, or None."""
    from hpcrl.ppo.loop import worker_classes

    if role not in spec.roles:
        return f"no role {role!r} in the run (roles: {', '.join(spec.roles)})"
    cfg = spec.train
    classes = worker_classes(cfg, {r: (x.worker, x.worker_args) for r, x in spec.roles.items() if x.worker})
    if role not in classes:
        return f"role {role} runs no workers in this training (it runs {', '.join(classes)})"
    if any(role in group for group in cfg.layout.colocate):
        return f"role {role} shares its processes with others (train.layout.colocate); only a role in processes of its own scales"
    if not getattr(classes[role], "elastic", False):
        return (f"role {role} cannot scale: its ranks train together, so a new rank would need their parameters and "
                "optimizer state, and the world size decides how each batch is split; the roles that scale are "
                "reward, ref, rollout and your own roles without state_dict")
    return None


def satellite_job(spec: JobSpec, role: str, options: dict) -> HetJob:
    """The one-node job of a satellite of `role`: its component's resources per node, `options` over them."""
    import sys

    job = spec.to_hetjob(python=sys.executable)     # the job's interpreter, as `hpcrl submit` gives it
    c = next(c for c in job.components if role in c.members)
    c = replace(c, nodes=1, members=[role], **{FLAGS[k][0]: FLAGS[k][1](v) for k, v in options.items()})
    return replace(job, name=f"{spec.name}-{role}-satellite", components=[c], driver="")


def scale(run_dir: str | Path, targets: dict[str, int], *, partition: str | None = None, time: str | None = None,
          gres: str | None = None, cpus_per_task: int | None = None, mem: str | None = None,
          account: str | None = None, qos: str | None = None, constraint: str | None = None,
          offline: bool = False, say: Callable[[str], None] = print) -> dict:
    """`hpcrl scale` from Python: each role of `targets` to that many nodes in all (its component's
    plus satellites), e.g. scale("runs/x", {"reward": 3}). The options ask the satellites for other
    resources than the role's component (partition, time, gres, ...). Checked (the role scales, the
    satellite's job against the live cluster unless offline) before anything is submitted or
    cancelled; SpecError lists every problem. Returns reconcile's record per role."""
    paths = RunDir(Path(run_dir).resolve())
    spec = _spec(paths)
    given = {"partition": partition, "time": time, "gres": gres, "cpus_per_task": cpus_per_task, "mem": mem,
             "account": account, "qos": qos, "constraint": constraint}
    options = {k: v for k, v in given.items() if v is not None}
    problems = _problems(spec, paths, targets, options, offline)
    if problems:
        raise SpecError(problems, f"hpcrl scale {paths.root}")
    with satellite.locked_record(paths.root) as record:
        record["targets"].update({role: {"nodes": n, "options": options} for role, n in targets.items()})
        satellite.write_record(paths.root, record)
    return reconcile(paths.root, say)


def _component_nodes(spec: JobSpec, paths: RunDir, role: str) -> int:
    if paths.allocation.exists():
        from hpcrl.slurm.allocation import read_allocation

        alloc = read_allocation(paths.root)
        return len(alloc["components"][alloc["members"][role]]["nodes"])
    owner = next(m[0] for m in spec.component_roles() if role in m)
    return spec.roles[owner].nodes


def _problems(spec: JobSpec, paths: RunDir, targets: dict[str, int], options: dict, offline: bool) -> list[str]:
    from hpcrl.slurm import directives
    from hpcrl.slurm.cluster_info import ClusterInfo

    problems = []
    for role, n in targets.items():
        why = elastic_problem(spec, role)
        if why:
            problems.append(f"{role}: {why}")
            continue
        base = _component_nodes(spec, paths, role)
        if not isinstance(n, int) or n < base:
            problems.append(f"{role}={n}: the role's hetjob component has {base} node(s), which stay until the run ends; "
                            f"ask for {base} or more")
        try:
            job = satellite_job(spec, role, options)
        except ValueError as e:
            problems.append(f"{role}: {e}")
            continue
        found = directives.problems(job, str(paths.logs / "satellite-0.out"))
        found += [] if offline else ClusterInfo.live().check(job)
        source = job.components[0].source
        for p in found:       # a value given on the command line is named by its flag
            for flag in options:
                p = p.replace(f"{source}.{flag}:", f"--{flag.replace('_', '-')}:")
            problems.append(f"{role}: {p}")
    return problems


def _running_start(paths: RunDir) -> str | None:
    """The run id of the job's start that runs now (its Ray cluster up, not stopping), or None."""
    import json

    if not paths.ray_cluster.exists():
        return None
    cluster = json.loads(paths.ray_cluster.read_text())
    job_id = json.loads(paths.job.read_text())["job_id"]
    running = component_states(job_id).get(0) == "RUNNING"
    up = paths.ray_ready(cluster["run_id"]).exists() and not paths.ray_stop(cluster["run_id"]).exists()
    return cluster["run_id"] if running and up else None


def reconcile(run_dir: str | Path, say: Callable[[str], None] = print) -> dict:
    """Submit or cancel satellites until every role has its target for the start that runs now:
    satellites of an earlier start are cancelled; pending ones go first when a role shrinks, then
    the newest. Where no start runs, the targets wait for the next one. Returns role -> {"target",
    "component_nodes", "satellites" (job ids), "submitted", "cancelled"}."""
    import json

    paths = RunDir(Path(run_dir).resolve())
    spec = _spec(paths)
    run_id = _running_start(paths)
    if run_id is None:
        say(f"the run in {paths.root} is not running now; its next start asks for the satellites")
        return {}
    main_job = json.loads(paths.job.read_text())["job_id"]
    with satellite.locked_record(paths.root) as record:     # until written back: another scale or start waits
        live = satellite.live_states([j["job_id"] for j in record["jobs"]])
        stale = [j["job_id"] for j in record["jobs"] if j["job_id"] in live and j["run_id"] != run_id]
        satellite.cancel_jobs(stale)
        record["jobs"] = [j for j in record["jobs"] if j["job_id"] in live and j["run_id"] == run_id]
        out = {}
        for role, target in record["targets"].items():
            base = _component_nodes(spec, paths, role)
            mine = [j for j in record["jobs"] if j["members"] == role]
            jobs = [satellite_job(spec, role, target["options"]) for _ in range(target["nodes"] - base - len(mine))]
            submitted, cancelled = satellite.submit_recorded(paths.root, record, jobs, main_job, run_id), []
            extra = len(mine) - (target["nodes"] - base)
            if extra > 0:
                # pending ones first (they serve nothing yet), then the newest
                order = sorted(mine, key=lambda j: (live.get(j["job_id"]) == "PENDING", j["submitted_at"]), reverse=True)
                cancelled = [j["job_id"] for j in order[:extra]]
                satellite.cancel_jobs(cancelled)
                record["jobs"] = [j for j in record["jobs"] if j["job_id"] not in cancelled]
            out[role] = {"target": target["nodes"], "component_nodes": base, "submitted": submitted,
                         "cancelled": cancelled, "satellites": [j["job_id"] for j in record["jobs"] if j["members"] == role]}
            if submitted or cancelled:
                say(f"role {role}: {target['nodes']} node(s) = {base} of its component + {len(out[role]['satellites'])} "
                    f"satellite(s)" + (f"; submitted {' '.join(submitted)}" if submitted else "")
                    + (f"; cancelled {' '.join(cancelled)}" if cancelled else ""))
        satellite.write_record(paths.root, record)
    return out
