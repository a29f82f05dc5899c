"""What the roles' snapshots cost (`train.checkpoint.snapshot_every`): PPO step time with a snapshot at every
step boundary against none, side by side (alternating runs, fresh local Ray each), and the host
memory a snapshot holds, on the tiny copy task and on SmolLM2-135M-Instruct, on this machine's CPU.
Prints a table and writes bench/snapshot.json.

    python bench/snapshot.py [--model MODEL_DIR] [--steps 6] [--repeats 2]

MODEL_DIR: SmolLM2 as an HF folder (`hpcrl data smollm2 DIR`); without it, the tiny task alone.
A step's time is the wall time from one step's record to the next (the snapshot included), median
of steps 2..N over the repeats; the snapshot's own time and size come from status.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SMOLLM2 = {"batch_size": 2, "max_new_tokens": 8, "mini_batch_size": 2, "micro_batch_size": 2, "ppo_epochs": 1,
           "actor_lr": 1e-6, "critic_lr": 1e-5, "max_prompt_length": 64}


def one_run(settings: dict, run: Path) -> dict:
    """PPO to settings' total_steps on a fresh local Ray: step seconds and the last snapshot."""
    import ray

    from hpcrl.observe.metrics import read_metrics
    from hpcrl.observe.status import read_status
    from hpcrl.ppo.config import TrainConfig
    from hpcrl.ppo.loop import train
    from hpcrl.raycluster.session import start_local

    cfg = TrainConfig(**settings)
    start_local(["actor_rollout", "critic", "ref", "reward"], run_dir=run, num_cpus=2)
    try:
        train(cfg, run)
    finally:
        ray.shutdown()
    times = [r["time"] for r in read_metrics(run / "metrics.jsonl") if "reward/mean" in r]
    return {"step_s": [round(b - a, 3) for a, b in zip(times, times[1:])], "snapshot": read_status(run)["last_snapshot"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="SmolLM2-135M-Instruct as an HF folder")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "snapshot.json")
    args = ap.parse_args()
    tasks = {"tiny copy task": {"total_steps": args.steps + 1, "batch_size": 32}}
    if args.model:
        tasks["SmolLM2-135M-Instruct"] = {**SMOLLM2, "total_steps": args.steps + 1, "model_dir": str(args.model)}
    rows = {}
    for name, task in tasks.items():
        seen = {"off": [], "on": []}
        snaps = []
        for _ in range(args.repeats):
            for mode in ("off", "on"):
                work = Path(tempfile.mkdtemp(prefix="hpcrl-snapshot-"))
                out = one_run({**task, "snapshot_every": 1 if mode == "on" else 0, "save_every": 0, "save_last": False,
                               "progress": False}, work)
                seen[mode] += out["step_s"]
                if mode == "on":
                    snaps.append(out["snapshot"])
                shutil.rmtree(work, ignore_errors=True)
        off, on = statistics.median(seen["off"]), statistics.median(seen["on"])
        rows[name] = {"step_s_without": round(off, 3), "step_s_with": round(on, 3), "ratio": round(on / off, 3),
                      "snapshot_s": round(statistics.median(s["seconds"] for s in snaps), 3),
                      "snapshot_bytes": snaps[-1]["bytes"], "steps": {k: v for k, v in seen.items()}}
    print(f"{'task':24s} {'step s, none':>13s} {'every step':>11s} {'ratio':>6s} {'snapshot s':>11s} {'host MB':>9s}")
    for name, r in rows.items():
        print(f"{name:24s} {r['step_s_without']:13.3f} {r['step_s_with']:11.3f} {r['ratio']:6.3f} "
              f"{r['snapshot_s']:11.3f} {r['snapshot_bytes'] / 1e6:9.1f}")
    args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                     "machine": "2 CPU cores (this checkout's CI machine), torch CPU", "rows": rows},
                                    indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
