"""One PPO step, phase by phase, split vs colocated, in one run on a local Ray.

Each layout trains jobs/tiny-cpu.yaml's settings for --steps steps in a fresh process (fresh Ray);
the table holds the median over the steps after the first two (warm-up) of each phase's
seconds, and tokens/s (prompt + response tokens of a step / the step's time).

    split      every role its own process (the hetjob's layout)
    colocated  actor_rollout+ref in one process, critic+reward in another

    python bench/ppo_step.py [--steps 20] [--json bench/ppo_step.json]
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

from hpcrl.launch.entrypoint import write_local_spec
from hpcrl.ppo.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"split": [], "colocated": [["actor_rollout", "ref"], ["critic", "reward"]]}
PHASES = ["generate", "score", "advantage", "update_critic", "update_actor", "sync_weights", "step"]


def run_layout(colocate: list, steps: int) -> list[dict]:
    train = TrainConfig.model_validate(yaml.safe_load((ROOT / "jobs" / "tiny-cpu.yaml").read_text())["train"]).updated(
        total_steps=steps, progress=False, layout={"colocate": colocate})
    run = Path(tempfile.mkdtemp(prefix="hpcrl-bench-ppo-"))
    write_local_spec(run, train)
    subprocess.run([sys.executable, "-m", "hpcrl.launch", str(run), "--local"], check=True, cwd=ROOT)
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "ppo_step.json")
    args = ap.parse_args()
    results = {}
    for name, colocate in LAYOUTS.items():
        records = run_layout(colocate, args.steps)[2:]
        results[name] = {p: statistics.median(r[f"timing/{p}"] for r in records) for p in PHASES}
        results[name]["tokens_per_s"] = statistics.median(r["throughput/tokens_per_s"] for r in records)
    print(f"\nPPO step on {os.cpu_count()} CPUs, median of {args.steps - 2} steps (seconds; tokens/s last)")
    print(f"{'phase':<16}" + "".join(f"{n:>12}" for n in LAYOUTS) + f"{'coloc/split':>13}")
    for p in [*PHASES, "tokens_per_s"]:
        row = [results[n][p] for n in LAYOUTS]
        ratio = row[1] / row[0] if row[0] else float("nan")
        print(f"{p:<16}" + "".join(f"{v:>12.4f}" if p != "tokens_per_s" else f"{v:>12.0f}" for v in row) + f"{ratio:>13.2f}")
    args.json.write_text(json.dumps({"cpus": os.cpu_count(), "steps": args.steps, "layouts": LAYOUTS,
                                     "median": results}, indent=1) + "\n")
    print(f"\nwritten {args.json}")


if __name__ == "__main__":
    main()
