"""Where a start's time goes, before and after a change: a two-step local run of jobs/tiny-cpu.yaml
(`hpcrl run --local`), the checkout's code and a base commit's (a git worktree) taking turns, several
times each; the `startup` events (hpcrl/observe/startup.py) of the checkout's runs say phase by phase
where the time went. Prints a table and writes JSON after every run.

    python bench/startup.py [--base REF] [--repeats N] [--json bench/startup.json]
    python bench/startup.py --gpu bench/gpu_slurm.json     # the table of a GPU run through Slurm (bench/gpu_slurm.py)
    python bench/startup.py --gpu-pair BASE.json NOW.json [--json OUT]   # two of them side by side: before and after
                                                                       # (bench/gpu_run.sh startup)

Each run's wall time is from the command's start to its exit; "to first step" from the command's start
to the first step's metrics record. The machine is shared: compare the two columns of one run of this
script, not figures of different runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hpcrl.observe.startup import starts  # noqa: E402
from hpcrl.observe.status import read_events  # noqa: E402


def one_run(code: Path, run: Path) -> dict:
    """`hpcrl run` of the tiny spec for two steps with the code in `code` (its hpcrl package first on the path)."""
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "hpcrl", "run", str(code / "jobs" / "tiny-cpu.yaml"), "--local",
                          "--run-dir", str(run), "train.total_steps=2"], cwd=code, capture_output=True, text=True,
                         env={**_env(), "PYTHONPATH": str(code)})
    wall = time.time() - t0
    if out.returncode != 0:
        return {"error": (out.stdout + out.stderr)[-2000:]}
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    started = starts(read_events(run))
    return {"wall_s": round(wall, 2), "to_first_step_s": round(first["time"] - t0, 2),
            "phases": started[0]["phases"] if started else None,
            "slowest": {k: list(v) for k, v in started[0]["slowest"].items()} if started else None}


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def worktree(ref: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="hpcrl-base-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), ref], cwd=ROOT, check=True, capture_output=True)
    return path


def table(result: dict) -> str:
    lines = [f"{'':24s} {'base ' + result['base_ref']:>18s} {'now':>10s}"]
    for key in ("wall_s", "to_first_step_s"):
        cols = [statistics.median([r[key] for r in result[side] if key in r] or [float("nan")]) for side in ("base", "now")]
        lines.append(f"{key:24s} {cols[0]:18.2f} {cols[1]:10.2f}")
    now = [r for r in result["now"] if r.get("phases")]
    if now:
        lines.append("now, phase ends (s since the driver's start, median):")
        for phase in now[0]["phases"]:
            lines.append(f"  {phase:22s} {statistics.median(r['phases'][phase] for r in now if phase in r['phases']):10.2f}")
        lines.append("now, slowest rank's seconds per phase of its own (median):")
        for phase in now[0]["slowest"]:
            lines.append(f"  {phase:22s} {statistics.median(r['slowest'][phase][2] for r in now):10.2f}")
    return "\n".join(lines)


def gpu_table(path: Path) -> str:
    data = json.loads(path.read_text())
    lines = []
    for stage in ("learn", "kill"):
        for k, s in enumerate((data.get(stage) or {}).get("startup") or []):
            lines.append(f"{stage} start {k + 1}: " + ", ".join(f"{p} {t:.1f}" for p, t in s["phases"].items()))
            lines.append("  slowest rank: " + ", ".join(f"{p} {v[2]:.1f} ({v[0]})" for p, v in s["slowest"].items()))
    rebuilt = (data.get("kill") or {}).get("rebuilt_event")
    if rebuilt:
        lines.append(f"rebuilt {rebuilt['role']} in {rebuilt['seconds']:.2f} s: "
                     + ", ".join(f"{p} {s:.2f}" for p, s in rebuilt.get("phases", {}).items()))
        if restore := rebuilt.get("restore"):     # its state, then the calls made since it was taken
            lines.append(f"  restore: state {restore['state']:.2f}, replay {restore['replay']:.2f} "
                         f"({restore['calls']} calls), after {restore['after']:.2f}")
    return "\n".join(lines)


def gpu_pair(base: Path, now: Path) -> dict:
    """The learn stage of two GPU runs through Slurm (bench/gpu_slurm.py --stages learn) side by side:
    each phase's end of the first start (seconds since sbatch) and of the start after the preemption
    (seconds since the start before it ended), the urgent job to the next step, and the first steps'
    timings."""
    def one(path: Path) -> dict:
        learn = json.loads(path.read_text())["learn"]
        records = [r for r in learn["records"] if "timing/step" in r]
        resumed = learn["preemption"].get("resumed_from_step")
        firsts = [r for r in records if r["step"] in (1, (resumed or 0) + 1)]
        return {"first start": learn["startup"][0]["phases"], "after the preemption": learn["startup"][1]["phases"],
                "urgent job to": {k.removeprefix("urgent_to_").removesuffix("_s"): v for k, v in learn["preemption"].items()
                                  if k.startswith("urgent_to_")},
                "first steps": {f"step {r['step']}": {k.removeprefix("timing/"): v for k, v in r.items()
                                                      if k.startswith("timing/") and k != "timing/startup"} for r in firsts},
                "steady step_s": statistics.median(r["timing/step"] for r in records[-5:])}
    return {"base": one(base), "now": one(now)}


def pair_table(pair: dict) -> str:
    lines = [f"{'':34s} {'base':>8s} {'now':>8s}"]
    for part in ("first start", "after the preemption", "urgent job to"):
        lines.append(part + ":")
        for key in pair["now"][part]:
            b = pair["base"][part].get(key)
            lines.append(f"  {key:32s} {b if b is not None else float('nan'):8.2f} {pair['now'][part][key]:8.2f}")
    lines.append("first steps (s):")
    for (step, b), n in zip(pair["base"]["first steps"].items(), pair["now"]["first steps"].values()):
        lines.append(f"  {step}: " + ", ".join(f"{k} {b.get(k, float('nan')):.2f}/{v:.2f}" for k, v in n.items()))
    lines.append(f"  steady step_s {pair['base']['steady step_s']:.3f}/{pair['now']['steady step_s']:.3f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the commit to hold the checkout's code against (default HEAD)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "startup.json")
    ap.add_argument("--gpu", type=Path, help="print the startup table of bench/gpu_slurm.py's JSON and exit")
    ap.add_argument("--gpu-pair", type=Path, nargs=2, metavar=("BASE", "NOW"),
                    help="two bench/gpu_slurm.py JSONs (learn stage) side by side; with --json, written there")
    args = ap.parse_args()
    if args.gpu:
        print(gpu_table(args.gpu))
        return 0
    if args.gpu_pair:
        pair = gpu_pair(*args.gpu_pair)
        print(pair_table(pair))
        if args.json != ap.get_default("json"):
            args.json.write_text(json.dumps(pair, indent=1))
        return 0
    base = worktree(args.base)
    result = {"base_ref": args.base, "repeats": args.repeats, "base": [], "now": []}
    try:
        with tempfile.TemporaryDirectory(prefix="hpcrl-startup-") as tmp:
            for k in range(args.repeats):
                for side, code in (("base", base), ("now", ROOT)):     # in turns: both see the same load
                    result[side].append(one_run(code, Path(tmp) / f"{side}{k}"))
                    args.json.write_text(json.dumps(result, indent=1))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
