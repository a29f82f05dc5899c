"""`hpcrl` command line: validate, render, submit and run job specs; status of a run."""
from __future__ import annotations

import argparse
import shlex
import sys
import time

from hpcrl import __version__
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

    def show(states):
        line = "  ".join(f"{i}:{roles.get(i, '?')}={s}" for i, s in sorted(states.items()))
        print(f"[{time.monotonic() - t0:7.1f}s] job {handle.job_id}: {line}", flush=True)

    states = handle.wait(on_change=show)
    if handle.submitit_job is not None and states.get(0) == "COMPLETED":
        print(f"result: {handle.result()}")
    _print_metrics(handle.run_dir)
    return 0 if all(s == "COMPLETED" for s in states.values()) else 1


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
        train(cfg, run_dir)
    finally:
        ray.shutdown()
    _print_metrics(run_dir)
    return 0


def cmd_status(args) -> int:
    """From the run directory's files and Slurm only: no Ray connection from the login node."""
    import json
    from pathlib import Path

    from hpcrl.slurm.submit import SubmitError, component_states

    run_dir = Path(args.run_dir)
    try:
        rec = json.loads((run_dir / "job.json").read_text())
    except OSError:
        raise SubmitError(f"{run_dir} has no job.json: not a run directory of a submitted job") from None
    try:
        states = component_states(rec["job_id"])
    except SubmitError as e:
        states = {}
        print(f"job {rec['job_id']}: {e}")
    alloc_path, cluster_path = run_dir / "allocation.json", run_dir / "ray" / "cluster.json"
    alloc = json.loads(alloc_path.read_text()) if alloc_path.exists() else None
    cluster = json.loads(cluster_path.read_text()) if cluster_path.exists() else None
    print(f"job {rec['job_id']} ({rec['name']}, via {rec['via']})"
          + (f", restarts {alloc['restart_count']}" if alloc else ""))
    for role, comp in rec["members"].items():
        nodes = [n for n in (cluster or {}).get("nodes", []) if n["component"] == comp]
        where = " ".join(f"{n['name']}@{n['addr']}" + ("(head)" if cluster["head"]["name"] == n["name"] else "")
                         for n in nodes) or "not started"
        print(f"  {role:16s} component {comp}  {states.get(comp, '?'):10s} ray nodes: {where}")
    if cluster:
        print(f"  ray: {cluster['address']}, token {run_dir / 'ray' / 'token'}")
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
    c = sub.add_parser("status", help="a run's Slurm state per component and its Ray nodes by role")
    c.add_argument("run_dir", help="run directory of a submitted job")
    c.set_defaults(fn=cmd_status)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from hpcrl.slurm.cluster import SlurmCommandError
    from hpcrl.slurm.submit import SubmitError

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
