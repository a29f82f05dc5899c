"""The product path on real GPUs, through Slurm: the GPU machine's local cluster (`slurm/cluster up
--packages DIR`: virtual nodes whose GRES are the machine's /dev/nvidiaN) runs jobs/smollm2-chain-sum-gpu.yaml
(GRPO: actor on h100, rollout on a100, verifier on cpu) and its PPO variant as heterogeneous jobs, with
`python -m hpcrl submit`, as a user on a login node would. Prints a table and writes JSON.

    python bench/gpu_slurm.py --model MODEL_DIR --data DATA_DIR [--work DIR] [--json bench/gpu_slurm.json]
    python bench/gpu_slurm.py --cpu --work DIR     # the same path on a CPU machine's cluster: tiny model, copy task

In order, each alone on the machine:
1. bare: the GRPO spec's layout without Slurm: one local Ray node per component, with the roles and GPU
   counts Slurm would give it (on one GPU every node names GPU 0), the driver in a process of its own,
   --bare-steps steps. Its step times are what the Slurm run's are held against (same steps, same seed),
   and its metrics what the preempted run's are compared with, step by step (`against_uninterrupted`).
2. learn: the GRPO spec through Slurm to --steps steps, held-out greedy accuracy every val_every steps.
   At a random step in [--preempt-lo, --preempt-hi] (seeded by --seed, printed; inside the bare run's
   steps) an `urgent` job on the actor's node preempts it: the job checkpoints, Slurm requeues it, it
   resumes from the committed step.
3. kill: the PPO spec through Slurm, --kill-steps steps; at a random step, once the critic's standby process
   is warm (status.json), the critic's process is killed (SIGKILL): its group is rebuilt on its node's GPU
   and the step completes.
4. observe: `hpcrl status`, `logs` and `report` of the learn run, their output kept in WORK/observe/.
5. modes (not in the default stages): the GRPO spec through Slurm for --mode-steps steps in each of
   `train.rollout.pipeline` off, one_step_off and async (partial_rollout: continue, --segment tokens a
   call, max_staleness 2), one after the other: held-out accuracy against training time, wall time per
   step, and the off-policy gap (`rollout/log_prob_diff`) by `policy/lag`.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
SPECS = {"grpo": ROOT / "jobs" / "smollm2-chain-sum-gpu.yaml", "ppo": ROOT / "jobs" / "smollm2-chain-sum-gpu-ppo.yaml"}
CPU_SETTINGS = ["train.model.path=", "train.data.dataset=", "train.validation.dataset=",
                "train.validation.before_train=false", "train.validation.every=0", "train.data.batch_size=8",
                "train.rollout.n_samples=4", "train.rollout.max_new_tokens=3", "train.optim.mini_batch_size=32",
                "train.optim.micro_batch_size=32", "train.optim.actor_lr=1e-3", "train.optim.critic_lr=2e-3",
                "train.checkpoint.save_every=10"]


def say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)


def hpcrl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The hpcrl command line, as a user runs it (`python -m hpcrl`: the GPU image installs no scripts)."""
    out = subprocess.run([sys.executable, "-m", "hpcrl", *args], capture_output=True, text=True, cwd=ROOT)
    if check and out.returncode != 0:
        raise RuntimeError(f"hpcrl {' '.join(args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def cpu_settings(kind: str) -> list[str]:
    """CPU_SETTINGS, and the GPU roles' mem within the CPU machine's 8 GB nodes."""
    import yaml

    roles = yaml.safe_load(SPECS[kind].read_text())["roles"]
    return CPU_SETTINGS + [f"roles.{r}.mem=4G" for r, role in roles.items() if role.get("gpus_per_node")]


def overrides(args, steps: int, kind: str = "grpo") -> list[str]:
    data = [] if args.cpu else [f"train.model.path={args.model}", f"train.data.dataset={args.data / 'train.parquet'}",
                                f"train.validation.dataset={args.data / 'test.parquet'}"]
    return [*data, *(cpu_settings(kind) if args.cpu else []), f"train.total_steps={steps}", f"train.seed={args.seed}",
            "train.progress=true", *([] if args.cpu or args.val_every is None else [f"train.validation.every={args.val_every}"])]


def records(run: Path) -> list[dict]:
    from hpcrl.observe.metrics import read_metrics

    return read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []


def events(run: Path) -> list[dict]:
    path = run / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train_seconds(r: dict) -> float:
    return r.get("timing/step", 0.0) - r.get("timing/validate", 0.0)


def step_times(recs: list[dict], lo: int, hi: int) -> list[float]:
    """Each step's time less its validation, for steps lo..hi (the steps before lo compile)."""
    return [train_seconds(r) for r in recs if "reward/mean" in r and lo <= r["step"] <= hi]


def wall_times(recs: list[dict], lo: int, hi: int) -> list[float]:
    """Seconds from one step's record to the next, for the steps lo..hi that validated nothing: the
    step and everything between steps (snapshots, checkpoints, status)."""
    steps = [r for r in recs if "reward/mean" in r]
    return [b["time"] - a["time"] for a, b in zip(steps, steps[1:])
            if lo <= b["step"] <= hi and b["step"] == a["step"] + 1 and not b.get("timing/validate")]


# ---------------------------------------------------------------- 1. bare: the same layout without Slurm
def run_bare(args) -> dict:
    from hpcrl.jobspec import load_spec
    from hpcrl.slurm.sbatch import write_spec

    run = args.work / "bare"
    subprocess.run(["rm", "-rf", str(run)], check=True)
    spec = load_spec(SPECS["grpo"], run_dir=run, overrides=overrides(args, args.bare_steps))
    write_spec(run, spec.as_data())
    # on one GPU every GPU node names GPU 0, as the local cluster's do
    nodes = [(members, "0" if spec.roles[members[0]].gpus_per_node else "", spec.roles[members[0]].cpus_per_task)
             for members in spec.component_roles()]
    say(f"bare: {len(nodes)} local Ray nodes as the job's components: {[n[0] for n in nodes]}")
    proc = subprocess.run([sys.executable, __file__, "--bare-driver", str(run), "--nodes", json.dumps(nodes)], cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"the bare run exited {proc.returncode}; see {run}")
    return {"run_dir": str(run), "records": records(run)}


def bare_driver(run: Path, nodes: list) -> int:
    """In a process of its own: the nodes (bench/local_nodes.py), then the driver, all with the
    run's token as in a job."""
    from hpcrl.raycluster.node import ray_env
    from hpcrl.raycluster.session import _write_token
    from hpcrl.run_dir import RunDir
    from local_nodes import local_nodes

    paths = RunDir(run)
    paths.ray.mkdir(parents=True, exist_ok=True)
    _write_token(paths.ray_token)
    os.environ.update(ray_env(run))     # before Ray is imported: it reads its auth mode then
    import ray

    from hpcrl.jobspec import load_spec
    from hpcrl.ppo.config import TrainConfig
    from hpcrl.ppo.loop import train

    with local_nodes([tuple(n) for n in nodes], dict(os.environ), paths.ray_logs) as address:
        ray.init(address=address, _node_ip_address="127.0.0.1", log_to_driver=False)
        try:
            train(TrainConfig.parse(load_spec(paths.spec, run_dir=run).train), run)
        finally:
            ray.shutdown()
    return 0


# ---------------------------------------------------------------- 2. and 3.: jobs through Slurm
class Job:
    """A run submitted as a user submits it, followed through its files and scontrol."""

    def __init__(self, name: str, kind: str, args, steps: int, extra: tuple[str, ...] = ()):
        self.run = args.work / name
        subprocess.run(["rm", "-rf", str(self.run)], check=True)
        self.submitted = time.time()
        out = hpcrl("submit", str(SPECS[kind]), "--run-dir", str(self.run), *overrides(args, steps, kind), *extra)
        self.job_id = json.loads((self.run / "job.json").read_text())["job_id"]
        self.steps, self.running_at = steps, None
        say(f"{name}: job {self.job_id} submitted ({out.stdout.strip().splitlines()[-1]})")

    def states(self) -> dict[int, str]:
        from hpcrl.slurm.sbatch import component_states

        return component_states(self.job_id)

    def step(self) -> int:
        recs = [r for r in records(self.run) if "reward/mean" in r]
        return recs[-1]["step"] if recs else 0

    def node_of(self, component: int) -> str:
        alloc = json.loads((self.run / "allocation.json").read_text())
        return alloc["components"][component]["nodes"][0]["name"]

    def follow(self, timeout_s: float, at_step=None) -> dict[int, str]:
        """Until every component has ended; at_step(step) is called as steps go by."""
        from hpcrl.slurm.sbatch import TERMINAL

        deadline, said = time.time() + timeout_s, 0.0
        while time.time() < deadline:
            states, step = self.states(), self.step()
            if self.running_at is None and all(s == "RUNNING" for s in states.values()):
                self.running_at = time.time()     # the first allocation, within the 0.5 s poll
            if at_step:
                at_step(step)
            if all(s in TERMINAL for s in states.values()):
                return states
            if time.time() - said > 30:
                say(f"job {self.job_id}: step {step}/{self.steps} {states}")
                said = time.time()
            time.sleep(0.5)
        raise TimeoutError(f"job {self.job_id} still running after {timeout_s:.0f} s: {self.states()}")


def first_times(run: Path) -> dict:
    """Seconds from sbatch to every Ray node joined, to the workers built and to the first step's
    end (the first start of the job)."""
    from hpcrl.observe.logs import line_time

    submitted = json.loads((run / "job.json").read_text())["submitted_at"]
    out = next(run.glob("logs/slurm-*.out")).read_text()
    line = next(ln for ln in out.splitlines() if "all nodes joined after" in ln)
    # the barrier step's line ends "(at EPOCH)"; the driver's own (it waits at the barrier itself since
    # 7d22ca8) begins with its log stamp
    joined = float(line.split("(at ")[1].split(")")[0]) if "(at " in line else line_time(line)
    start = next(e["time"] for e in events(run) if e["event"] == "start")
    first = next(r["time"] for r in records(run) if "reward/mean" in r)
    return {"sbatch_to_ray_ready_s": round(joined - submitted, 2), "sbatch_to_workers_s": round(start - submitted, 2),
            "sbatch_to_first_step_s": round(first - submitted, 2)}


def run_learn(args, rng: random.Random) -> dict:
    from hpcrl.observe.metrics import score_over_training_time

    at = rng.randint(args.preempt_lo, args.preempt_hi)
    say(f"learn: the urgent job goes in once step {at} is done (random step in [{args.preempt_lo}, "
        f"{args.preempt_hi}], seed {args.seed})")
    job = Job("learn", "grpo", args, args.steps)
    preempt: dict = {}

    def at_step(step: int) -> None:
        if not preempt and step >= at:
            node = job.node_of(0)
            urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-w", node, "--exclusive", "-o", "/dev/null",
                                     "--wrap", "sleep 5"], capture_output=True, text=True, check=True).stdout.strip()
            preempt.update(urgent_job=urgent, node=node, after_step=step, time=time.time())
            say(f"learn: urgent job {urgent} on {node} after step {step}")

    states = job.follow(args.timeout, at_step)
    recs, evs = records(job.run), events(job.run)
    starts = [e for e in evs if e["event"] == "start"]
    stop = next((e for e in evs if e["event"] == "stop"), None)
    committed = [e["step"] for e in evs if e["event"] == "checkpoint" and stop and e["time"] <= stop["time"]]
    steps = [r["step"] for r in recs if "reward/mean" in r]
    if preempt and len(starts) > 1:
        resumed_first = next(r for r in recs if "reward/mean" in r and r["step"] == starts[1]["step"] + 1)
        preempt.update(stopped_at_step=stop["step"] if stop else None, committed_step=committed[-1] if committed else None,
                       resumed_from_step=starts[1]["step"], stop_reason=stop["reason"] if stop else None,
                       urgent_to_checkpoint_s=round(stop["time"] - preempt["time"], 2) if stop else None,
                       urgent_to_resumed_start_s=round(starts[1]["time"] - preempt["time"], 2),
                       urgent_to_next_step_s=round(resumed_first["time"] - preempt["time"], 2))
    points = score_over_training_time(recs)
    reached = next((p for p in points if p[1] >= 0.65), None)
    firsts = {"sbatch_to_allocation_s": round(job.running_at - job.submitted, 2), **first_times(job.run)}
    return {"job_id": job.job_id, "states": states, "run_dir": str(job.run), "steps_done": len(steps),
            "steps_unique": steps == list(range(1, len(steps) + 1)), "starts": len(starts),
            "preemption": preempt, "first_times": firsts, "startup": start_phases(evs), "held_out": points,
            "first_at_or_above_0.65": reached, "trained_s": round(sum(map(train_seconds, recs)), 1),
            "records": recs}


def run_kill(args, rng: random.Random) -> dict:
    at = rng.randint(3, max(3, args.kill_steps // 2))
    say(f"kill: the critic's process is killed during step {at + 1} (random, seed {args.seed})")
    job = Job("kill", "ppo", args, args.kill_steps)
    killed: dict = {}

    def at_step(step: int) -> None:
        if killed or step < at:
            return
        critic = json.loads((job.run / "status.json").read_text())["roles"]["critic"]
        standby = critic.get("standby", {"processes": 0, "ready": 0})
        if standby["ready"] < standby["processes"]:
            return      # a rebuild then waits for the standby's imports: the kill of a run long under way is timed
        pid, node = critic["ranks"][0]["pid"], critic["ranks"][0]["node"]
        os.kill(pid, signal.SIGKILL)
        killed.update(pid=pid, node=node, after_step=step, time=time.time(), standby=standby)
        say(f"kill: critic pid {pid} on {node} killed after step {step}")

    states = job.follow(args.timeout, at_step)
    evs, recs = events(job.run), records(job.run)
    status = json.loads((job.run / "status.json").read_text())
    rebuild = next((e for e in evs if e["event"] == "rebuild" and e.get("role") == "critic"), None)
    rebuilt = next((e for e in evs if e["event"] == "rebuilt" and e.get("role") == "critic"), None)
    steps = [r["step"] for r in recs if "reward/mean" in r]
    critic = status["roles"]["critic"]
    return {"job_id": job.job_id, "states": states, "run_dir": str(job.run), "killed": killed,
            "rebuild_event": rebuild, "rebuilt_event": rebuilt,
            "kill_to_rebuilt_s": round(rebuilt["time"] - killed["time"], 2) if rebuilt and killed else None,
            "critic_after": {"restarts": critic["restarts"], "node": critic["ranks"][0]["node"],
                             "pid": critic["ranks"][0]["pid"]},
            "startup": start_phases(evs),
            "steps_done": len(steps), "steps_unique": steps == list(range(1, len(steps) + 1)), "records": recs}


MODES = {"off": (), "one_step_off": ("train.rollout.pipeline=one_step_off",),
         "async": ("train.rollout.pipeline=async", "train.rollout.max_staleness=2", "train.rollout.partial_rollout=continue")}


def run_modes(args) -> dict:
    """The GRPO spec in each pipeline mode, each alone on the machine (5. in the module's docstring)."""
    from hpcrl.observe.metrics import score_over_training_time

    out = {}
    for mode, extra in MODES.items():
        extra = (*extra, f"train.rollout.segment_tokens={args.segment}") if mode == "async" else extra
        job = Job(f"mode-{mode}", "grpo", args, args.mode_steps, extra)
        states = job.follow(args.timeout)
        recs = [r for r in records(job.run) if "reward/mean" in r]
        gap: dict[int, list[float]] = {}
        for r in recs:
            if r.get("rollout/log_prob_diff") is not None:
                gap.setdefault(r["policy/lag"], []).append(r["rollout/log_prob_diff"])
        out[mode] = {"states": states, "steps_done": len(recs), "trained_s": round(sum(map(train_seconds, recs)), 1),
                     "wall_per_step_s": round(statistics.median(wall_times(recs, args.compare_from, args.mode_steps)), 4),
                     "held_out": score_over_training_time(records(job.run)),
                     "log_prob_diff_by_lag": {lag: round(statistics.mean(v), 5) for lag, v in sorted(gap.items())},
                     "response_length": round(statistics.mean(r["response_length/mean"] for r in recs), 2),
                     **({"versions_per_response": round(statistics.mean(r["rollout/versions_per_response"] for r in recs), 3)}
                        if mode == "async" else {})}
        say(f"modes: {mode} {({k: v for k, v in out[mode].items() if k != 'held_out'})}")
    return out


def start_phases(evs: list[dict]) -> list[dict]:
    """Each start's phases (hpcrl/observe/startup.py's `starts`), JSON-ready."""
    from hpcrl.observe.startup import starts

    return [{"phases": s["phases"], "slowest": {k: list(v) for k, v in s["slowest"].items()}} for s in starts(evs)]


def observe(run: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    said = {}
    for name, argv in (("status", ["status", str(run)]), ("logs", ["logs", str(run)]), ("report", ["report", str(run)])):
        got = hpcrl(*argv, check=False)
        (out / f"{name}.txt").write_text(got.stdout + got.stderr)
        said[name] = {"exit": got.returncode, "lines": len(got.stdout.splitlines())}
    return said


# ---------------------------------------------------------------- the table
COMPARED = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy")


def against_uninterrupted(bare: list[dict], learn: list[dict], resumed_from: int | None) -> dict:
    """The Slurm run, preempted and resumed, against the bare run, uninterrupted, step by step over the
    steps both made: which steps are bitwise equal in COMPARED, and the largest difference before the
    preemption and after the resume (before it, two uninterrupted runs: what the kernels alone change)."""
    b = {r["step"]: r for r in bare if "reward/mean" in r}
    s = {r["step"]: r for r in learn if "reward/mean" in r}
    steps = sorted(set(b) & set(s))
    equal = [k for k in steps if all(b[k].get(m) == s[k].get(m) for m in COMPARED)]

    def widest(keep) -> dict:
        return {m: max((abs((b[k].get(m) or 0.0) - (s[k].get(m) or 0.0)) for k in steps if keep(k)), default=None)
                for m in COMPARED}
    after = resumed_from if resumed_from is not None else max(steps, default=0)
    return {"steps": [steps[0], steps[-1]] if steps else [], "resumed_from_step": resumed_from,
            "bitwise_equal_steps": len(equal), "first_differing_step": next((k for k in steps if k not in equal), None),
            "max_abs_diff_before_preemption": widest(lambda k: k <= after),
            "max_abs_diff_after_resume": widest(lambda k: k > after)}


def summary(result: dict, lo: int) -> dict:
    bare, learn = result["bare"]["records"], result["learn"]["records"]
    hi = max(r["step"] for r in bare if "reward/mean" in r)
    b, s = step_times(bare, lo, hi), step_times(learn, lo, hi)
    first_bare = next(r for r in bare if "reward/mean" in r)
    first_slurm = next(r for r in learn if "reward/mean" in r)
    wb, ws = statistics.median(wall_times(bare, lo, hi)), statistics.median(wall_times(learn, lo, hi))
    return {"steps_compared": [lo, hi], "bare_step_s": round(statistics.median(b), 4),
            "slurm_step_s": round(statistics.median(s), 4), "slurm_over_bare": round(statistics.median(s) / statistics.median(b), 3),
            "bare_wall_per_step_s": round(wb, 4), "slurm_wall_per_step_s": round(ws, 4),
            "slurm_over_bare_wall": round(ws / wb, 3),
            "step1_reward_bare": first_bare["reward/mean"], "step1_reward_slurm": first_slurm["reward/mean"],
            "against_uninterrupted": against_uninterrupted(
                bare, learn, result["learn"]["preemption"].get("resumed_from_step"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="SmolLM2-135M-Instruct as an HF folder (hpcrl data smollm2)")
    ap.add_argument("--data", type=Path, help="the chain-sum data (hpcrl data reasoning-gym chain_sum ...)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-slurm"), help="run directories and outputs")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "gpu_slurm.json")
    ap.add_argument("--cpu", action="store_true", help="tiny model and copy task: the path on a CPU machine")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=400, help="steps of the learn run")
    ap.add_argument("--bare-steps", type=int, default=40)
    ap.add_argument("--compare-from", type=int, default=10, help="first step of the step-time comparison")
    ap.add_argument("--preempt-lo", type=int, default=15)
    ap.add_argument("--preempt-hi", type=int, default=30)
    ap.add_argument("--kill-steps", type=int, default=20)
    ap.add_argument("--val-every", type=int, help="held-out validation every N steps (default: the spec's; none with --cpu)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a job may take")
    ap.add_argument("--mode-steps", type=int, default=120, help="steps of each run of the modes stage")
    ap.add_argument("--segment", type=int, default=16, help="the modes stage's async run: tokens a call")
    ap.add_argument("--stages", default="bare,learn,kill,observe", help="of bare, learn, kill, observe, modes")
    ap.add_argument("--bare-driver", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--nodes", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_driver:
        return bare_driver(args.bare_driver, json.loads(args.nodes))
    if not args.cpu and (args.model is None or args.data is None):
        ap.error("--model and --data are needed (or --cpu)")
    args.work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    stages = args.stages.split(",")
    result: dict = {"settings": {k: str(v) for k, v in vars(args).items() if k not in ("bare_driver", "nodes")}}
    partial = args.work / "gpu_slurm.partial.json"
    for stage in stages:
        t0 = time.time()
        say(f"== {stage}")
        if stage == "bare":
            result["bare"] = run_bare(args)
        elif stage == "learn":
            result["learn"] = run_learn(args, rng)
        elif stage == "kill":
            result["kill"] = run_kill(args, rng)
        elif stage == "observe":
            result["observe"] = observe(Path(result["learn"]["run_dir"]), args.work / "observe")
        elif stage == "modes":
            result["modes"] = run_modes(args)
        result.setdefault("stage_seconds", {})[stage] = round(time.time() - t0, 1)
        partial.write_text(json.dumps(result, indent=1))
    if "bare" in result and "learn" in result:
        result["overhead"] = summary(result, args.compare_from)
    args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result.get("overhead", {}), indent=1))
    for name in ("learn", "kill"):
        if name in result:
            r = result[name]
            print(name, {k: v for k, v in r.items() if k not in ("records", "held_out")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
