"""`hpcrl` command line: validate, render, submit and run job specs; a run's status, logs, report, checkpoints."""
from __future__ import annotations

import argparse
import shlex
import sys
import time

from hpcrl import __version__
from hpcrl.slurm.submit import SubmitError
from hpcrl.spec import SpecError, load_spec


def _load(args):
    spec = load_spec(args.spec, run_dir=args.run_dir)
    return spec, spec.to_hetjob(python=shlex.quote(sys.executable))


def _live_problems(job, offline: bool):
    """(cluster info or None, problems) — no cluster is read with --offline."""
    if offline:
        return None, []
    from hpcrl.slurm.cluster import ClusterInfo

    info = ClusterInfo.live()
    return info, info.check(job)


def cmd_validate(args) -> int:
    from hpcrl.slurm.cluster import format_table

    _, job = _load(args)
    info, problems = _live_problems(job, args.offline)
    if problems:
        raise SpecError(problems, args.spec)
    print(f"OK: {args.spec} ({'offline, cluster not checked' if info is None else 'checked against the live cluster'})")
    from hpcrl.slurm.cluster import ClusterInfo

    print(format_table((info or ClusterInfo({}, {})).summary(job)))
    return 0


def cmd_render(args) -> int:
    from hpcrl.slurm.render import render_hetjob

    _, job = _load(args)
    _, problems = _live_problems(job, args.offline)
    if problems:
        raise SpecError(problems, args.spec)
    sys.stdout.write(render_hetjob(job))
    return 0


def cmd_submit(args) -> int:
    from hpcrl.slurm.submit import submit_hetjob
    from hpcrl.submitit_training import training_function

    spec, job = _load(args)
    handle = submit_hetjob(job, args.via, resume=args.resume, spec_data=spec.as_data(),
                           dry_run=args.dry_run, fn=training_function(spec, args.via))
    if args.dry_run:
        sys.stdout.write(handle)
        return 0
    print(f"submitted job {handle.job_id} via {args.via}; run dir {handle.run_dir}", flush=True)
    if not args.wait:
        return 0
    t0 = time.monotonic()
    roles = {i: ",".join(r for r, c in handle.members.items() if c == i) for i in set(handle.members.values())}

    def say(text):
        print(f"[{time.monotonic() - t0:7.1f}s] job {handle.job_id}: {text}", flush=True)

    def show(states):
        say("  ".join(f"{i}:{roles.get(i, '?')}={s}" for i, s in sorted(states.items())))

    states = handle.wait(on_change=show, on_poll=_run_progress(handle.run_dir, say))
    if handle.submitit_job is not None and states.get(0) == "COMPLETED":
        print(f"result: {handle.result()}")
    _print_metrics(handle.run_dir)
    return 0 if all(s == "COMPLETED" for s in states.values()) else 1


def _run_progress(run_dir, say):
    """A poll callback that says when Ray is up and how far training got (from the run's files)."""
    from hpcrl.status import read_status

    seen = {"ray": set(), "step": None, "printed": 0.0, "state": None}

    def poll():
        for ready in (run_dir / "ray").glob("ready.*"):     # one per start: a requeued job starts Ray again
            if ready.name not in seen["ray"]:
                seen["ray"].add(ready.name)
                say(f"Ray cluster ready: {ready.read_text().strip()}")
        run = read_status(run_dir)
        if not run:
            return
        where = run["phase"] if run["state"] == "starting" else f"step {run['step']}/{run['total_steps']}"
        if where != seen["step"] and (time.monotonic() - seen["printed"] > 5 or run["state"] != "running"):
            seen["step"], seen["printed"] = where, time.monotonic()
            say(where if run["state"] == "starting" else f"{where} ({run['phase'] or run['state']})")
        if run["state"] != seen["state"] and run["state"] in ("finished", "stopped", "failed"):
            say(f"driver {run['state']}" + (f": {run['error']}" if run.get("error") else ""))
        seen["state"] = run["state"]
    return poll


def _print_metrics(run_dir) -> None:
    from hpcrl.metrics import read_metrics, reward_table

    path = run_dir / "metrics.jsonl"
    records = read_metrics(path)
    if records:
        print(f"metrics: {path}\n{reward_table(records)}")


def cmd_run(args) -> int:
    """The training loop of a spec on this machine: one local Ray node carrying every role."""
    import ray

    from hpcrl.config import PPOConfig
    from hpcrl.raycluster.session import start_local
    from hpcrl.trainer import train

    if not args.local:
        raise SpecError(["hpcrl run needs --local (on a cluster use `hpcrl submit`)"], args.spec)
    spec, _ = _load(args)
    if not spec.train:
        raise SpecError(["train: empty; there is nothing to run (see hpcrl/config.py for the settings)"], args.spec)
    cfg = PPOConfig.from_dict(spec.train)
    run_dir = spec.run_dir
    if (run_dir / "metrics.jsonl").exists() and not args.resume:
        raise SpecError([f"run_dir: {run_dir} already holds a run (metrics.jsonl); add --resume to continue it "
                         "from its newest checkpoint, or choose a new --run-dir"], args.spec)
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"run dir {run_dir}; roles {', '.join(cfg.roles())} on one local Ray node", flush=True)
    start_local(list(spec.roles), run_dir=run_dir, num_cpus=args.num_cpus)
    try:
        train(cfg, run_dir, tensorboard=spec.metrics.tensorboard)
    finally:
        ray.shutdown()
    _print_metrics(run_dir)
    return 0


def _run_dir_of(target: str):
    """A run directory, or a job id whose Slurm output file lies in RUN_DIR/logs/."""
    from pathlib import Path

    from hpcrl.slurm.cluster import SlurmCommandError, parse_records, slurm_cmd

    if not target.isdigit() or Path(target).is_dir():
        return Path(target)
    try:
        rec = parse_records(slurm_cmd("scontrol", "show", "job", "-o", target))[0]
    except SlurmCommandError:
        raise SubmitError(f"job {target} is not known to slurmctld (any more); pass its run directory instead") from None
    return Path(rec["StdOut"]).parent.parent


def gather_status(run_dir) -> dict:
    """Everything `hpcrl status` shows, from Slurm and the run's files (no Ray connection)."""
    import json

    from hpcrl.checkpoint import CheckpointStore
    from hpcrl.slurm.cluster import SlurmCommandError
    from hpcrl.slurm.submit import component_states
    from hpcrl.status import read_status

    def read(name):
        path = run_dir / name
        return json.loads(path.read_text()) if path.exists() else None

    job, alloc, cluster = read("job.json"), read("allocation.json"), read("ray/cluster.json")
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
    out["ray"] = None
    if cluster:
        ready = run_dir / "ray" / f"ready.{cluster['run_id']}"     # this start's barrier, not an earlier one's
        out["ray"] = {"address": cluster["address"], "head": cluster["head"]["name"],
                      "nodes": [f"{n['name']}@{n['addr']}" for n in cluster["nodes"]],
                      "ready": ready.read_text().strip() if ready.exists() else None,
                      "token": str(run_dir / "ray" / "token")}
    names = {n["addr"]: n["name"] for n in (cluster or {}).get("nodes", [])}
    for role in ((out["run"] or {}).get("roles") or {}).values():
        for r in role["ranks"]:
            r["node"] = names.get(r["node_ip"], r["node_ip"])
    return out


def _age(t) -> str:
    if not t:
        return "?"
    s = max(0, time.time() - t)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def format_status(st: dict) -> str:
    lines = []
    job, run = st["job"], st["run"]
    if job:
        lines.append(f"job {job['id']} ({job['name']}, via {job['via']}), restarts {job['restart_count']}"
                     + (f"; {job['slurm_error']}" if job["slurm_error"] else ""))
        for c in st["components"]:
            lines.append(f"  component {c['index']} {','.join(c['roles']):22s} {c['state']:11s} "
                         f"partition {c['partition'] or '?':8s} nodes {' '.join(c['nodes']) or '-'}")
    if st["ray"]:
        ray_ = st["ray"]
        lines.append(f"ray: {ray_['address']} (head {ray_['head']}), nodes {' '.join(ray_['nodes'])}; "
                     + (f"ready: {ray_['ready']}" if ray_["ready"] else "not all joined yet"))
    if run:
        where = f", {run['phase']} for {time.time() - run['phase_since']:.0f} s" if run.get("phase") and run.get("phase_since") else ""
        step = "" if run["state"] == "starting" else f", step {run['step']}/{run['total_steps']}"
        lines.append(f"run: {run['state']}{step}{where} (status written {_age(run['updated'])})")
        if run.get("error"):
            lines.append(f"  error: {run['error']}")
        for name, role in run["roles"].items():
            ranks = " ".join(f"rank{r['rank']}@{r['node']}(pid {r['pid']})" for r in role["ranks"])
            lines.append(f"  {name:16s} {role['state']:10s} restarts {role['restarts']}  {ranks}")
            if role.get("last_error"):
                lines.append(f"  {'':16s} last error: {role['last_error']}")
    else:
        lines.append("run: no driver status (not started yet, or the spec has no train: section)")
    ck = st["checkpoint"]
    lines.append(f"checkpoint: step {ck['step']}, committed {_age(ck['committed_at'])}, {ck['path']}" if ck
                 else "checkpoint: none committed yet")
    return "\n".join(lines)


def cmd_status(args) -> int:
    """From Slurm and the run directory's files only: no Ray connection from the login node."""
    import json

    st = gather_status(_run_dir_of(args.target))
    print(json.dumps(st, indent=1) if args.json else format_status(st))
    return 0


def cmd_logs(args) -> int:
    from hpcrl.logs import follow, log_files, merged_lines
    from hpcrl.status import read_status

    run_dir = _run_dir_of(args.target)
    try:
        files = log_files(run_dir, args.source, args.rank)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.follow:
        follow(run_dir, args.source, args.rank,
               until=lambda: (read_status(run_dir) or {}).get("state") in ("finished", "failed"))
        return 0
    for line in merged_lines(files):
        print(line)
    return 0


def cmd_report(args) -> int:
    from hpcrl.report import write_report

    try:
        index = write_report(_run_dir_of(args.target))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {index}")
    return 0


def cmd_ckpt(args) -> int:
    """Committed steps of a run, or the verification of one step (or all)."""
    from pathlib import Path

    from hpcrl.checkpoint import CheckpointStore

    store = CheckpointStore(Path(args.run_dir), keep_last=0)
    steps = store.committed_steps()
    if not steps:
        print(f"{store.root}: no committed checkpoint")
        return 1
    if args.action == "ls":
        print(f"{'step':>8} {'status':8} {'MB':>8}  roles (file)")
        for step in steps:
            m = store.manifest(step)
            status = "ok" if not store.verify(step) else "BAD"
            mb = sum(i["bytes"] for i in m["roles"].values()) / 2**20
            roles = ", ".join(f"{r} ({i['path']})" for r, i in m["roles"].items())
            print(f"{step:>8} {status:8} {mb:>8.1f}  {roles}")
        return 0
    bad = 0
    for step in [args.step] if args.step is not None else steps:
        problems = store.verify(step)
        bad += bool(problems)
        print(f"step {step}: " + ("ok" if not problems else "BAD\n  - " + "\n  - ".join(problems)))
    return 1 if bad else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcrl", description="Slurm-native multi-controller RLHF (PPO).")
    p.add_argument("--version", action="version", version=f"hpcrl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def spec_cmd(name, help_):
        c = sub.add_parser(name, help=help_, description=help_)
        c.add_argument("spec", help="job spec (YAML)")
        c.add_argument("--run-dir", help="run directory (overrides the spec's run_dir)")
        return c

    c = spec_cmd("validate", "check a spec, and by default the live cluster; print a per-component table")
    c.add_argument("--offline", action="store_true", help="skip the live cluster check (no Slurm needed)")
    c.set_defaults(fn=cmd_validate)
    c = spec_cmd("render", "print the heterogeneous sbatch script of a spec, without submitting")
    c.add_argument("--offline", action="store_true", help="skip the live cluster check (no Slurm needed)")
    c.set_defaults(fn=cmd_render)
    c = spec_cmd("submit", "validate against the live cluster and submit one heterogeneous job")
    c.add_argument("--via", choices=["sbatch", "submitit"], default="sbatch",
                   help="sbatch (default), or submitit (a pickled Python function in component 0)")
    c.add_argument("--wait", action="store_true", help="follow the job's state until it ends; exit 0 if it completed")
    c.add_argument("--dry-run", action="store_true", help="validate and print the script; submit nothing")
    c.add_argument("--resume", action="store_true", help="continue the run in an existing run directory")
    c.set_defaults(fn=cmd_submit)
    c = spec_cmd("run", "run the spec's training here, on a local Ray (no Slurm)")
    c.add_argument("--local", action="store_true", help="one local Ray node carrying every role (required)")
    c.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use (default: all)")
    c.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its newest checkpoint")
    c.set_defaults(fn=cmd_run)
    c = sub.add_parser("ckpt", help="a run's checkpoints: ls (steps, sizes, roles, status) or verify [STEP]")
    c.add_argument("action", choices=["ls", "verify"])
    c.add_argument("run_dir", help="run directory")
    c.add_argument("step", nargs="?", type=int, help="verify only this step")
    c.set_defaults(fn=cmd_ckpt)
    c = sub.add_parser("status", help="a run's Slurm components, its roles' ranks and health, step, phase, "
                                      "last checkpoint (no Ray connection needed)")
    c.add_argument("target", help="run directory, or the job id of a job slurmctld still knows")
    c.add_argument("--json", action="store_true", help="the same as JSON, for scripts")
    c.set_defaults(fn=cmd_status)
    c = sub.add_parser("logs", help="a run's logs merged by time: driver (Slurm output), each role's ranks, Ray nodes")
    c.add_argument("target", help="run directory, or job id")
    c.add_argument("source", nargs="?", help="only this: a role name, `driver` or `ray`")
    c.add_argument("--rank", type=int, help="only this rank of the role")
    c.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the run ends (or Ctrl-C)")
    c.set_defaults(fn=cmd_logs)
    c = sub.add_parser("report", help="write RUN_DIR/report/: PNG curves, per-phase time chart, index.html")
    c.add_argument("target", help="run directory, or job id")
    c.set_defaults(fn=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from hpcrl.slurm.cluster import SlurmCommandError

    try:
        return args.fn(args)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (SubmitError, SlurmCommandError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
