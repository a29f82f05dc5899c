"""What `hpcrl status` shows of a run, from Slurm and the run directory's files only: no Ray
connection from the login node."""
from __future__ import annotations

import json
import time

import yaml

from hpcrl.checkpoint.store import CheckpointStore
from hpcrl.observe.startup import format_startup
from hpcrl.observe.status import read_events, read_status
from hpcrl.run_dir import RunDir
from hpcrl.slurm.cluster_info import SlurmCommandError
from hpcrl.slurm.sbatch import SubmitError, component_states


def gather_status(run_dir) -> dict:
    """Everything `hpcrl status` shows, from Slurm and the run's files (no Ray connection)."""
    paths = RunDir(run_dir)

    def read(path):
        return json.loads(path.read_text()) if path.exists() else None

    job, alloc, cluster = read(paths.job), read(paths.allocation), read(paths.ray_cluster)
    if job is None and read_status(run_dir) is None:
        raise SubmitError(f"{run_dir} has neither job.json nor status.json: not a run directory")
    out = {"run_dir": str(run_dir.resolve()), "job": None, "components": [], "run": read_status(run_dir)}
    if job:
        try:
            states, slurm_error = component_states(job["job_id"]), None
        except (SubmitError, SlurmCommandError) as e:    # Slurm unreachable or the job forgotten: show the rest
            states, slurm_error = {}, str(e).splitlines()[0]
        out["job"] = {"id": job["job_id"], "name": job["name"], "via": job["via"], "slurm_error": slurm_error,
                      "restart_count": alloc["restart_count"] if alloc else 0}
        comps = {c["index"]: c for c in (alloc or {}).get("components", [])}
        for index in sorted(set(job["members"].values())):
            c = comps.get(index, {})
            out["components"].append({"index": index, "roles": [r for r, i in job["members"].items() if i == index],
                                      "state": states.get(index, "?"), "partition": c.get("partition"),
                                      "nodes": [n["name"] for n in c.get("nodes", [])]})
    store = CheckpointStore(run_dir)
    steps = store.committed_steps() if store.root.exists() else []
    if steps:
        manifest = store.manifest(steps[-1])
        out["checkpoint"] = {"step": steps[-1], "committed_at": manifest.get("time"),
                             "path": str(store.step_dir(steps[-1]))}
    else:
        out["checkpoint"] = None
    spec = yaml.safe_load(paths.spec.read_text()) if paths.spec.exists() else None
    out["overridden"] = (spec or {}).get("overridden") or {}      # set on the command line
    out["ray"] = None
    if cluster:
        ready = paths.ray_ready(cluster["run_id"])     # this start's barrier, not an earlier one's
        out["ray"] = {"address": cluster["address"], "head": cluster["head"]["name"],
                      "nodes": [f"{n['name']}@{n['addr']}" for n in cluster["nodes"]],
                      "ready": ready.read_text().strip() if ready.exists() else None,
                      "token": str(paths.ray_token)}
    names = {n["addr"]: n["name"] for n in (cluster or {}).get("nodes", [])}
    for role in ((out["run"] or {}).get("roles") or {}).values():
        for r in role["ranks"]:
            r.setdefault("node", names.get(r["node_ip"], r["node_ip"]))
    out["satellites"] = _satellites(paths)
    out["resizes"] = [e for e in read_events(paths.root) if e["event"] in ("resize", "resize_failed")]
    return out


def _satellites(paths: RunDir) -> dict | None:
    """hpcrl scale's targets and satellite jobs, each with its Slurm state (ended: left the queue)."""
    from hpcrl.slurm import satellite

    if not paths.satellites.exists():
        return None
    record = satellite.read_record(paths.root)
    try:
        live, error = satellite.live_states([j["job_id"] for j in record["jobs"]]), None
    except SlurmCommandError as e:
        live, error = {}, str(e).splitlines()[0]
    return {"targets": {r: t["nodes"] for r, t in record["targets"].items()}, "slurm_error": error,
            "jobs": [{**j, "state": "?" if error else live.get(j["job_id"], "ended")} for j in record["jobs"]]}


def _age(t) -> str:
    if not t:
        return "?"
    s = max(0, time.time() - t)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def _innermost(stacks: str, frames: int = 3) -> list[str]:
    """The innermost frames of the thread a hung rank was running (faulthandler's "Current thread")."""
    blocks = stacks.split("\n\n")
    block = next((b for b in blocks if b.startswith("Current thread")), blocks[0])
    return [line.strip().removeprefix("File ") for line in block.splitlines() if line.startswith("  File")][:frames]


def format_status(st: dict) -> str:
    lines = []
    job, run = st["job"], st["run"]
    if job:
        lines.append(f"job {job['id']} ({job['name']}, via {job['via']}), restarts {job['restart_count']}"
                     + (f"; {job['slurm_error']}" if job["slurm_error"] else ""))
        for c in st["components"]:
            lines.append(f"  component {c['index']} {','.join(c['roles']):22s} {c['state']:11s} "
                         f"partition {c['partition'] or '?':8s} nodes {' '.join(c['nodes']) or '-'}")
    if st.get("overridden"):
        lines.append("overrides: " + " ".join(f"{k}={json.dumps(v)}" for k, v in st["overridden"].items()))
    if st["ray"]:
        ray_ = st["ray"]
        lines.append(f"ray: {ray_['address']} (head {ray_['head']}), nodes {' '.join(ray_['nodes'])}; "
                     + (f"ready: {ray_['ready']}" if ray_["ready"] else "not all joined yet"))
    if run:
        where = f", {run['phase']} for {time.time() - run['phase_since']:.0f} s" if run.get("phase") and run.get("phase_since") else ""
        step = "" if run["state"] == "starting" else f", step {run['step']}/{run['total_steps']}"
        lines.append(f"run: {run['state']}{step}{where} (status written {_age(run['updated'])})")
        if run.get("startup"):
            lines.append("  " + format_startup(run["startup"]))
        if run.get("error"):
            lines.append(f"  error: {run['error']}")
        for name, role in run["roles"].items():
            ranks = " ".join(f"rank{r['rank']}@{r['node']}({r.get('origin', 'component')}, pid {r['pid']})"
                             for r in role["ranks"])
            standby = role.get("standby") or {}
            warm = f"  standby {standby['ready']}/{standby['processes']} warm" if standby.get("processes") else ""
            lines.append(f"  {name:16s} {role['state']:10s} restarts {role['restarts']}  {ranks}{warm}")
            if role.get("last_error"):
                lines.append(f"  {'':16s} last error: {role['last_error']}")
            if hang := role.get("last_hang"):
                lines.append(f"  {'':16s} last hang {_age(hang['time'])}: ranks {hang['ranks']} did not answer "
                             f"{hang['call']} within {hang['deadline_s']:.0f} s (stacks: logs/{name}/rank<k>.log)")
                lines += [f"  {'':16s}   rank {rank} in {frame}" for rank, text in hang["stacks"].items()
                          for frame in _innermost(text)]
    else:
        lines.append("run: no driver status (not started yet, or the spec has no train: section)")
    sat = st.get("satellites")
    if sat:
        lines.append("satellites (hpcrl scale): " + "; ".join(f"{role} {n} node(s) asked" for role, n in sat["targets"].items())
                     + (f"; {sat['slurm_error']}" if sat["slurm_error"] else ""))
        for j in sat["jobs"]:
            lines.append(f"  job {j['job_id']:8s} {j['members']:16s} {j['state']:10s} for run start {j['run_id']}")
    for e in st.get("resizes") or []:
        lines.append(f"resize at step {e['step']}: {e['role']} {e['from']} -> {e['to']} ranks ({e['why']})"
                     if e["event"] == "resize" else f"resize failed at step {e['step']}: {e['error']}")
    val = (run or {}).get("validation")
    if val:
        sources = [f"{k.removeprefix('val/score/')} {v:.3f}" for k, v in val.items() if k.startswith("val/score/")]
        lines.append(f"validation: after step {val['step']}, score {val['val/score']:.3f}"
                     + (f" ({', '.join(sources)})" if sources else "")
                     + f", response length {val['val/response_length/mean']:.1f} tokens")
    ck = st["checkpoint"]
    lines.append(f"checkpoint: step {ck['step']}, committed {_age(ck['committed_at'])}, {ck['path']}" if ck
                 else "checkpoint: none committed yet")
    snap = (run or {}).get("last_snapshot")
    if snap:
        lines.append(f"snapshot: step {snap['step']}, {snap['bytes'] / 1e6:.1f} MB in the roles' nodes' memory "
                     f"(taken in {snap['seconds']:.2f} s): a rebuilt role goes on from there")
        lines += [f"  warning: {w}" for w in snap.get("spills", [])]
    return "\n".join(lines)
