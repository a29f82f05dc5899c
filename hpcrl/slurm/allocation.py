"""Which nodes each component (and so each role) got: `RUN_DIR/allocation.json`.

Runs inside the job. `probe` is one task per node of one component's step and writes what that
node sees; `collect` (in the batch shell) joins the probes with each node's address from
`scontrol show node`. Component index, partition, nodes and addresses are Slurm facts; members
(role names) are labels passed through untouched.

    {"job_id": "12", "restart_count": 0,
     "components": [{"index": 0, "members": ["actor_rollout"], "partition": "a100", "job_id": "12",
                     "nodes": [{"name": "a100n1", "addr": "127.0.0.13", "cpus": 2, "gpus": "0"}]}, ...],
     "members": {"actor_rollout": 0, ...}}
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from hpcrl.slurm.cluster import parse_records, slurm_cmd
from hpcrl.util import atomic_write_text

PROBE_DIR = ".allocation"


def probe(run_dir: Path, component: int, members: list[str]) -> dict:
    env = os.environ
    rec = {
        "component": component, "members": members, "name": env.get("SLURMD_NODENAME", socket.gethostname()),
        "partition": env.get("SLURM_JOB_PARTITION", ""), "job_id": env.get("SLURM_JOB_ID", ""),
        "cpus": int(env.get("SLURM_CPUS_ON_NODE", "0") or 0),
        # SLURM_STEP_GPUS is right per component; CUDA_VISIBLE_DEVICES leaks from the batch shell.
        "gpus": env.get("SLURM_STEP_GPUS", ""),
    }
    d = run_dir / PROBE_DIR
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_text(d / f"{component}.{rec['name']}.json", json.dumps(rec))
    return rec


def collect(run_dir: Path) -> dict:
    probes = [json.loads(p.read_text()) for p in sorted((run_dir / PROBE_DIR).glob("*.json"))]
    addrs = {r["NodeName"]: r.get("NodeAddr", r["NodeName"])
             for r in parse_records(slurm_cmd("scontrol", "show", "node", "-o"))}
    comps: dict[int, dict] = {}
    for p in probes:
        c = comps.setdefault(p["component"], {"index": p["component"], "members": p["members"],
                                               "partition": p["partition"], "job_id": p["job_id"], "nodes": []})
        c["nodes"].append({"name": p["name"], "addr": addrs.get(p["name"], p["name"]), "cpus": p["cpus"],
                           "gpus": p["gpus"]})
    alloc = {
        "job_id": os.environ.get("SLURM_JOB_ID", ""),
        "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "components": [comps[i] for i in sorted(comps)],
        "members": {m: i for i, c in comps.items() for m in c["members"]},
    }
    for c in alloc["components"]:
        c["nodes"].sort(key=lambda n: n["name"])
    atomic_write_text(run_dir / "allocation.json", json.dumps(alloc, indent=1))
    for p in (run_dir / PROBE_DIR).glob("*.json"):
        p.unlink()
    return alloc


def read_allocation(run_dir: str | Path) -> dict:
    return json.loads((Path(run_dir) / "allocation.json").read_text())


def main(argv: list[str]) -> int:
    if argv[:1] == ["probe"] and len(argv) == 4:
        probe(Path(argv[1]), int(argv[2]), argv[3].split(","))
    elif argv[:1] == ["collect"] and len(argv) == 2:
        alloc = collect(Path(argv[1]))
        for c in alloc["components"]:
            print(f"[hpcrl] component {c['index']} ({','.join(c['members'])}) on {c['partition']}: "
                  + " ".join(f"{n['name']}@{n['addr']}" for n in c["nodes"]), flush=True)
    else:
        print("usage: python -m hpcrl.slurm.allocation probe RUN_DIR COMPONENT MEMBERS | collect RUN_DIR",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
