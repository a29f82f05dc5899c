"""What a model role's process costs to start on a real model, before and after a change: each role's
engines (and tokenizer) built for a model directory in a fresh Python process, the checkout's code and
a base commit's (a git worktree) taking turns, several times each. A role's process on a GPU node pays
the same imports and builds first (bench/gpu_slurm.py measures it there, through Slurm).

    python bench/role_start.py [--model DIR] [--base REF] [--repeats N] [--json bench/role_start.json]

Per role: the process's CPU time from its start to its engines built (user + system: torch, the
model's code, the weights, the tokenizer), its wall time, and whether it imported transformers.
Default model: SmolLM2-135M-Instruct (hpcrl.models.smollm2.fetch). The machine is shared: compare the
two columns of one run of this script, not figures of different runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from startup import ROOT, _env, worktree

ROLES = {   # what each role's __init__ builds (hpcrl/ppo/roles)
    "actor_rollout": "a = make_train_engine(cfg, d, 'log_probs', cpu, 1e-6); make_rollout_engine(cfg, d, 0, cpu, a)",
    "critic": "make_train_engine(cfg, d, 'values', cpu, 1e-6)",
    "ref": "make_train_engine(cfg, d, 'log_probs', cpu, None)",
    "reward": "load_tokenizer(d)",
}
CODE = """
import resource, sys, torch
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.roles.common import make_train_engine
from hpcrl.ppo.roles.rollout import make_rollout_engine
cfg, cpu, d = TrainConfig(), torch.device("cpu"), sys.argv[1]
{build}
r = resource.getrusage(resource.RUSAGE_SELF)
print(round(r.ru_utime + r.ru_stime, 3), "transformers" in sys.modules)
"""


def one_role(code: Path, model: str, role: str) -> dict:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", CODE.format(build=ROLES[role]), model], cwd=code,
                         capture_output=True, text=True, env={**_env(), "PYTHONPATH": str(code)})
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    cpu, transformers = out.stdout.split()[-2:]
    return {"cpu_s": float(cpu), "wall_s": round(time.time() - t0, 3), "transformers": transformers == "True"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--base", default="HEAD", help="the commit to hold the checkout's code against (default HEAD)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=str(ROOT / "bench" / "role_start.json"))
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from hpcrl.models.smollm2 import fetch

        args.model = str(fetch())
    base = worktree(args.base)
    runs = {"base": {r: [] for r in ROLES}, "now": {r: [] for r in ROLES}}
    try:
        for _ in range(args.repeats):
            for role in ROLES:
                for side, code in (("base", base), ("now", ROOT)):
                    runs[side][role].append(one_role(code, args.model, role))
                    Path(args.json).write_text(json.dumps({"model": args.model, "base": args.base, "runs": runs},
                                                          indent=1))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    print(f"{args.model}, base {args.base}, median of {args.repeats}")
    print(f"{'role':<14} {'base CPU s':>10} {'now CPU s':>10} {'now/base':>9} {'base wall s':>11} {'now wall s':>10}  transformers (base, now)")
    for role in ROLES:
        med = {side: {k: statistics.median(r[k] for r in runs[side][role] if "error" not in r) for k in ("cpu_s", "wall_s")}
               for side in runs}
        imports = [any(r.get("transformers") for r in runs[side][role]) for side in runs]
        print(f"{role:<14} {med['base']['cpu_s']:>10.2f} {med['now']['cpu_s']:>10.2f} "
              f"{med['now']['cpu_s'] / med['base']['cpu_s']:>9.2f} {med['base']['wall_s']:>11.2f} {med['now']['wall_s']:>10.2f}  {imports}")


if __name__ == "__main__":
    main()
