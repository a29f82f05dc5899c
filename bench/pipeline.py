"""Step time, sequential vs pipelined (train.rollout.pipeline: one_step_off) vs asynchronous
(pipeline: async, one run per --async-staleness k), side by side in one run.

On the local Slurm cluster (slurm/cluster up), two hetjobs of jobs/tiny-cpu-pipelined.yaml's
layout, changed so that two roles do nearly all the work: GRPO without a reference (no critic, no
ref), the rollout on a100 and the actor on h100, every role's torch on one thread
(cpus_per_task: 1), so that on two cores the rollout and the actor can really run at once. The
response length (--new-tokens) and the actor's epochs (--ppo-epochs) set the balance of the
two lanes. Medians over the steps after the first three:

    sequential  step, generate (the rollout lane), the rest (the actor lane: scores, updates, sync)
    pipelined   step; its ideal is max(generate, rest) of the sequential run
    busy        seconds per step each role spent in its calls (logs/<role>/rank0.calls.jsonl):
                where two lanes share two cores with everything else, each runs slower at once
    modes       per mode (off, one_step_off, async_k<k>): the median step, seconds per trained
                sample, the mean reward of the last 5 steps, the median policy/lag (and for async,
                buffer/depth and timing/rollout_idle), and the speed-up over one_step_off

--slow-scorer S adds a role of its own on the cpu partition (jobs/slow_scorer.py: a verifier that
answers after S seconds per batch), a term of the reward in both runs.

A long tail of response lengths: --digits-sigma σ draws each copy prompt's digits from a lognormal
(median --digits), --segment S runs the async modes with partial rollouts (partial_rollout: continue,
S tokens a call; 0: finish), --pack trains on packed sequences (the actor's work then follows
the responses' real lengths, not the longest one's), and --reward-level L adds each mode's time to a reward of L (the mean
of 10 steps), its training seconds summed to there.

    python bench/pipeline.py [--steps 25] [--new-tokens 80] [--ppo-epochs 1] [--slow-scorer 0]
                             [--async-staleness 1,2,4] [--digits 2] [--digits-sigma 0] [--segment 0]
                             [--pack] [--eos-penalty 0] [--reward-level 0] [--json bench/pipeline.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from hpcrl.observe.logs import read_calls
from hpcrl.ppo.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 3
BATCH, N_SAMPLES = 16, 4      # prompts a step, responses a prompt
CURVE = ("step", "reward/mean", "timing/step", "policy/lag", "response_length/mean", "response_length/max")


def spec(args, pipeline: str, staleness: int = 1) -> dict:
    data = yaml.safe_load((ROOT / "jobs" / "tiny-cpu-pipelined.yaml").read_text())
    for role in ("critic", "ref"):
        data["roles"].pop(role)
    data["roles"]["reward"] = {"partition": "cpu", "cpus_per_task": 1, "mem": "2G", "time": "00:30:00"}
    for role in data["roles"].values():
        role["cpus_per_task"] = 1
    if args.slow_scorer:
        data["roles"]["verifier"] = {"partition": "cpu", "cpus_per_task": 1, "mem": "2G", "time": "00:30:00",
                                     "worker": "hpcrl.jobs.slow_scorer:SlowRuleEngine",
                                     "worker_args": {"seconds": args.slow_scorer}}
        data["train"]["reward"] = {"scorers": [{"role": "reward"},
                                               {"role": "verifier", "method": "compute_rule_score", "weight": 0.5}]}
    data["name"] = f"bench-pipeline-{pipeline}-{staleness}"
    partial = {"partial_rollout": "continue", "segment_tokens": args.segment} if pipeline == "async" and args.segment else {}
    data["train"] = TrainConfig.model_validate(data["train"]).updated(
        total_steps=args.steps, progress=False,
        data={"batch_size": BATCH, "task_digits": args.digits, "task_digits_sigma": args.digits_sigma},
        rollout={"n_samples": N_SAMPLES, "max_new_tokens": args.new_tokens, "pipeline": pipeline, "max_staleness": staleness,
                 **partial},
        algorithm={"advantage": "grpo", "kl_coef": 0.0}, reward={"missing_eos_penalty": args.eos_penalty},
        optim={"mini_batch_size": 64, "ppo_epochs": args.ppo_epochs, "pack": args.pack},
        checkpoint={"save_last": False}).model_dump(mode="json", exclude_unset=True)
    return data


def run(args, pipeline: str, work: Path, staleness: int = 1) -> tuple[list[dict], dict, list[dict]]:
    """One mode's hetjob: its records after the warm-up steps, each role's busy seconds per step, every record."""
    name = f"{pipeline}_k{staleness}" if pipeline == "async" else pipeline
    path, run_dir = work / f"{name}.yaml", work / name
    path.write_text(yaml.safe_dump(spec(args, pipeline, staleness)))
    subprocess.run([sys.executable, "-m", "hpcrl", "submit", str(path), "--run-dir", str(run_dir), "--wait"],
                   check=True, cwd=ROOT, capture_output=True, text=True)
    every = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    every = [r for r in every if r["step"] > 0]
    records = every[WARMUP:]
    steps = {r["step"] for r in records}
    busy = {role: sum(c["end"] - c["start"] for c in calls if c["step"] in steps) / len(steps)
            for role, calls in read_calls(run_dir).items()}
    curve = [{k: r.get(k) for k in CURVE} for r in every]      # the reward curve, beside the JSON
    (args.json.parent / f"{args.json.stem}_{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in curve))
    return records, busy, every


def median(records, key) -> float:
    return statistics.median(r[key] for r in records)


def summary(records: list[dict], every: list[dict], level: float) -> dict:
    """One mode's line: its median step, seconds per trained sample (the steps' seconds over their
    samples), final reward and lag; with a reward `level`, the step whose 10-step mean reward first
    reached it and the seconds of every step to there (`every`: all the steps, the first ones too)."""
    samples = sum(r["batch/kept_groups"] * N_SAMPLES for r in records)
    out = {"step_s": median(records, "timing/step"), "reward_last5": statistics.mean(r["reward/mean"] for r in records[-5:]),
           "reward_last20": statistics.mean(r["reward/mean"] for r in records[-20:]),
           "lag": median(records, "policy/lag"), "sample_s": sum(r["timing/step"] for r in records) / samples,
           "response_length": statistics.mean(r["response_length/mean"] for r in records)}
    if "buffer/depth" in records[0]:
        out |= {"buffer_depth": median(records, "buffer/depth"), "rollout_idle_s": median(records, "timing/rollout_idle")}
    if "rollout/versions_per_response" in records[0]:
        out["versions_per_response"] = statistics.mean(r["rollout/versions_per_response"] for r in records)
    if level:
        means = [statistics.mean(r["reward/mean"] for r in every[max(0, i - 9):i + 1]) for i in range(len(every))]
        reached = next((i for i, m in enumerate(means) if i >= 9 and m >= level), None)
        out["reached_step"] = every[reached]["step"] if reached is not None else None
        out["seconds_to_level"] = round(sum(r["timing/step"] for r in every[:reached + 1]), 2) if reached is not None else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--new-tokens", type=int, default=80)
    ap.add_argument("--ppo-epochs", type=int, default=1)
    ap.add_argument("--slow-scorer", type=float, default=0.0, help="seconds per batch of a verifier role (0: none)")
    ap.add_argument("--async-staleness", default="1,2,4", help="max_staleness of each async run (empty: none)")
    ap.add_argument("--digits", type=int, default=2, help="the copy task's digits (the median, with --digits-sigma)")
    ap.add_argument("--digits-sigma", type=float, default=0.0, help="σ of the lognormal of the digits (0: all --digits)")
    ap.add_argument("--segment", type=int, default=0, help="async: partial rollouts of this many tokens a call (0: finish)")
    ap.add_argument("--eos-penalty", type=float, default=0.0, help="reward.missing_eos_penalty (a response cut short)")
    ap.add_argument("--pack", action="store_true", help="the actor's forwards on packed sequences (no padding)")
    ap.add_argument("--reward-level", type=float, default=0.0, help="time each mode to this 10-step mean reward (0: not)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "pipeline.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hpcrl-bench-pipeline-"))
    seq, seq_busy, seq_every = run(args, "off", work)
    pipe, pipe_busy, pipe_every = run(args, "one_step_off", work)
    modes = {"off": summary(seq, seq_every, args.reward_level), "one_step_off": summary(pipe, pipe_every, args.reward_level)}
    result = {"cpus": os.cpu_count(), "steps_timed": len(seq), "new_tokens": args.new_tokens, "ppo_epochs": args.ppo_epochs,
              "slow_scorer_s": args.slow_scorer, "digits": args.digits, "digits_sigma": args.digits_sigma,
              "segment": args.segment, "pack": args.pack, "eos_penalty": args.eos_penalty, "reward_level": args.reward_level, "modes": modes}
    for k in [int(k) for k in args.async_staleness.split(",") if k]:
        records, _, every = run(args, "async", work, k)
        modes[f"async_k{k}"] = summary(records, every, args.reward_level)
        args.json.write_text(json.dumps(result, indent=1) + "\n")     # after every run
    for line in modes.values():
        line["over_one_step_off"] = modes["one_step_off"]["sample_s"] / line["sample_s"]
    generate = median(seq, "timing/generate")
    rest = statistics.median(r["timing/step"] - r["timing/generate"] for r in seq)
    result |= {"sequential_step_s": median(seq, "timing/step"), "generate_s": generate, "rest_s": rest,
               "pipelined_step_s": median(pipe, "timing/step"), "busy_sequential_s": seq_busy, "busy_pipelined_s": pipe_busy}
    result["pipelined_over_sequential"] = result["pipelined_step_s"] / result["sequential_step_s"]
    result["pipelined_over_ideal"] = result["pipelined_step_s"] / max(generate, rest)
    print(f"\nlocal cluster, {os.cpu_count()} CPUs, one torch thread per role; median of {len(seq)} steps (s)"
          + (f"; a verifier role of {args.slow_scorer} s per batch" if args.slow_scorer else ""))
    print(f"{'':12} {'step':>7} {'generate':>9} {'rest':>7}")
    print(f"{'sequential':12} {result['sequential_step_s']:>7.3f} {generate:>9.3f} {rest:>7.3f}")
    print(f"{'pipelined':12} {result['pipelined_step_s']:>7.3f}")
    print(f"pipelined / sequential {result['pipelined_over_sequential']:.2f}   "
          f"pipelined / max(generate, rest) {result['pipelined_over_ideal']:.2f}")
    print("busy per step: " + "  ".join(f"{role} {seq_busy.get(role, 0):.3f} → {pipe_busy.get(role, 0):.3f}"
                                         for role in sorted(seq_busy | pipe_busy)))
    print(f"\n{'mode':14} {'step':>7} {'s/sample':>9} {'reward':>7} {'lag':>4} {'vs 1-off':>8} {'to level s':>10}")
    for mode, line in modes.items():
        print(f"{mode:14} {line['step_s']:>7.3f} {line['sample_s']:>9.4f} {line['reward_last20']:>7.3f} "
              f"{line['lag']:>4.0f} {line['over_one_step_off']:>8.2f} {line.get('seconds_to_level') or '-':>10}")
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
