"""Elastic roles: how long `hpcrl scale` takes to give a role new ranks, and what they buy, in one run.

On the local Slurm cluster (slurm/cluster up), jobs/tiny-cpu-elastic.yaml as it ships: GRPO with
the reward on a cpu component of its own, scored by a slow verifier (20 ms a sample, 64 samples a
step). After --before steps on one reward rank, `hpcrl scale RUN reward=3` submits two satellites;
the run goes on --after more steps on three ranks.

    scale → first call   from the start of `hpcrl scale` to the first call on the new ranks
                         (logs/reward/rank<k>.calls.jsonl), with the stations in between: the
                         satellite jobs running (sacct), their Ray nodes joined (their logs), the
                         driver's resize (events.jsonl)
    step, score          medians over the steps on one rank and on three ranks

    python bench/elastic.py [--before 12] [--after 15] [--json bench/elastic.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import yaml

from hpcrl.ppo.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 3


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, cwd=ROOT).stdout


def wait(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(what)


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def events(run: Path) -> list[dict]:
    path = run / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def joined_at(log: Path) -> float | None:
    """When a satellite's node said it joined (the date its log line begins with; whole seconds)."""
    line = next((x for x in log.read_text().splitlines() if "joined run start" in x), None) if log.exists() else None
    return datetime.strptime(line[:19], "%Y-%m-%d %H:%M:%S").timestamp() if line else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=int, default=12, help="steps on one reward rank before scaling")
    ap.add_argument("--after", type=int, default=15, help="steps on three ranks after the resize")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "elastic.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hpcrl-bench-elastic-"))
    spec = yaml.safe_load((ROOT / "jobs" / "tiny-cpu-elastic.yaml").read_text())
    spec["train"] = TrainConfig.model_validate(spec["train"]).updated(
        total_steps=1000, progress=False, checkpoint={"save_last": False}).model_dump(mode="json", exclude_unset=True)
    path, run = work / "elastic.yaml", work / "run"
    path.write_text(yaml.safe_dump(spec))
    sh(sys.executable, "-m", "hpcrl", "submit", str(path), "--run-dir", str(run))
    wait(lambda: len(records(run)) >= args.before, 600, f"{args.before} steps")
    t_scale = time.time()
    sh(sys.executable, "-m", "hpcrl", "scale", str(run), "reward=3")
    t_scaled = time.time()
    sats = [j["job_id"] for j in json.loads((run / "satellites.json").read_text())["jobs"]]
    resize = wait(lambda: next((e for e in events(run) if e["event"] == "resize"), None), 300, "the resize")

    def first_calls() -> list[float] | None:
        files = [run / "logs" / "reward" / f"rank{k}.calls.jsonl" for k in (1, 2)]
        if not all(f.exists() and f.read_text().strip() for f in files):
            return None
        return [json.loads(f.read_text().splitlines()[0])["start"] for f in files]
    firsts = wait(first_calls, 300, "calls on the new ranks")
    wait(lambda: len(records(run)) >= resize["step"] + args.after, 600, f"{args.after} steps on three ranks")
    sh(sys.executable, "-m", "hpcrl", "cancel", str(run), "--now")
    starts = []
    for j in sats:
        line = sh("sacct", "-n", "-P", "-X", "-j", j, "-o", "Start").strip()
        starts.append(datetime.strptime(line, "%Y-%m-%dT%H:%M:%S").timestamp())
    joins = [joined_at(run / "logs" / f"satellite-{j}.out") for j in sats]
    steps = records(run)
    one = [r for r in steps if WARMUP < r["step"] <= args.before]
    three = [r for r in steps if r["step"] > resize["step"] + 1]

    def med(rs, key):
        return statistics.median(r[key] for r in rs)

    result = {"cpus": os.cpu_count(), "samples_per_step": 64, "scorer_s_per_sample": 0.02,
              "scale_command_s": round(t_scaled - t_scale, 2),
              "satellites_running_s": [round(s - t_scale, 1) for s in starts],     # sacct: whole seconds
              "satellites_joined_s": [round(j - t_scale, 1) for j in joins if j],      # whole seconds
              "resize_done_s": round(resize["time"] - t_scale, 2), "resize_s": resize["seconds"],
              "first_call_on_new_ranks_s": round(min(firsts) - t_scale, 2),
              "steps_on_1": len(one), "steps_on_3": len(three),
              "step_s_1_rank": med(one, "timing/step"), "step_s_3_ranks": med(three, "timing/step"),
              "score_s_1_rank": med(one, "timing/score"), "score_s_3_ranks": med(three, "timing/score")}
    result["score_speedup"] = result["score_s_1_rank"] / result["score_s_3_ranks"]
    result["step_speedup"] = result["step_s_1_rank"] / result["step_s_3_ranks"]
    print(f"\nlocal cluster, {os.cpu_count()} CPUs; the reward's verifier 20 ms a sample, 64 samples a step")
    print(f"hpcrl scale reward=3 → seconds: command {result['scale_command_s']}, satellites running "
          f"{result['satellites_running_s']}, joined {result['satellites_joined_s']}, resized "
          f"{result['resize_done_s']} (the resize itself {result['resize_s']}), first call on the new ranks "
          f"{result['first_call_on_new_ranks_s']}")
    print(f"{'reward ranks':14} {'step s':>8} {'score s':>8}  (medians of {len(one)} and {len(three)} steps)")
    print(f"{'1':14} {result['step_s_1_rank']:>8.3f} {result['score_s_1_rank']:>8.3f}")
    print(f"{'3':14} {result['step_s_3_ranks']:>8.3f} {result['score_s_3_ranks']:>8.3f}")
    print(f"score {result['score_speedup']:.2f}x faster, step {result['step_speedup']:.2f}x")
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
