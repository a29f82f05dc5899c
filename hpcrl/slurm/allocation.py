"""Which nodes each component (and so each member role) got: `RUN_DIR/allocation.json`.

Written in the batch shell from Slurm's own records (`scontrol show job` of the leader, one record
per component, and `scontrol show node` for addresses). Members are labels passed through untouched.

    {"job_id": "12", "restart_count": 0,
     "components": [{"index": 0, "members": ["actor_rollout"], "partition": "a100", "job_id": "12",
                     "gres": "gpu:a100:1", "cpus_per_node": 2, "mem_mb": 3072,
                     "nodes": [{"name": "a100n1", "addr": "127.0.0.13"}]}, ...],
     "members": {"actor_rollout": 0, ...}}
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hpcrl.files import atomic_write_text
from hpcrl.run_dir import RunDir
from hpcrl.slurm.cluster_info import parse_records, slurm_cmd
from hpcrl.slurm.job import parse_mem_mb


def node_name() -> str:
    """This node's Slurm name, as allocation.json records it (the hostname outside a step)."""
    import socket

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _gres(tres_per_node: str) -> str:
    # TresPerNode=gres:gpu:a100:1 (22.05) or gres/gpu:a100=1 (newer)
    t = tres_per_node.removeprefix("gres:").replace("gres/", "").replace("=", ":")
    return "" if t in ("", "(null)") else t


def gpu_type(gres: str) -> str | None:
    """The GPU type of a GRES as allocation.json records it (gpu:a100:1 -> a100), or None."""
    parts = gres.split(":")
    return parts[1] if len(parts) == 3 and parts[0] == "gpu" else None


def _addresses() -> dict[str, str]:
    return {r["NodeName"]: r.get("NodeAddr", r["NodeName"]) for r in parse_records(slurm_cmd("scontrol", "show", "node", "-o"))}


def this_job() -> dict:
    """The one-node job this step runs in (a satellite): {"job_id", "node", "addr", "partition", "gpu_type"}."""
    job_id = os.environ["SLURM_JOB_ID"]
    rec = parse_records(slurm_cmd("scontrol", "show", "job", "-o", job_id))[0]
    name = node_name()
    return {"job_id": job_id, "node": name, "addr": _addresses().get(name, name), "partition": rec["Partition"],
            "gpu_type": gpu_type(_gres(rec.get("TresPerNode", "")))}


def from_job(job_id: str, members: list[list[str]]) -> dict:
    recs = sorted(parse_records(slurm_cmd("scontrol", "show", "job", "-o", job_id)),
                  key=lambda r: int(r.get("HetJobOffset", 0)))
    if len(recs) != len(members):
        raise RuntimeError(f"job {job_id} has {len(recs)} components, the script names {len(members)}")
    addrs = _addresses()
    comps = []
    for i, (r, m) in enumerate(zip(recs, members)):
        names = slurm_cmd("scontrol", "show", "hostnames", r["NodeList"]).split()
        n_nodes = max(1, len(names))
        comps.append({
            "index": i, "members": m, "partition": r["Partition"], "job_id": r["JobId"],
            "gres": _gres(r.get("TresPerNode", "")),
            "cpus_per_node": int(r.get("NumCPUs", "0")) // n_nodes,
            "mem_mb": parse_mem_mb(r.get("MinMemoryNode") or "0"),
            "nodes": [{"name": n, "addr": addrs.get(n, n)} for n in names],
        })
    return {"job_id": job_id, "restart_count": restart_count(),
            "components": comps, "members": {x: c["index"] for c in comps for x in c["members"]}}


def restart_count() -> int:
    """The restart this start of the job is (0: its first start; Slurm leaves the variable unset or empty then)."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def read_allocation(run_dir: str | Path) -> dict:
    return json.loads(RunDir(run_dir).allocation.read_text())


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m hpcrl.slurm.allocation RUN_DIR MEMBERS_OF_COMPONENT_0 [MEMBERS_OF_1 ...]\n"
              "       (members comma-separated; run inside the batch script)", file=sys.stderr)
        return 2
    run_dir = RunDir(argv[0])
    alloc = from_job(os.environ["SLURM_JOB_ID"], [a.split(",") for a in argv[1:]])
    atomic_write_text(run_dir.allocation, json.dumps(alloc, indent=1))
    for c in alloc["components"]:
        print(f"[hpcrl] component {c['index']} ({','.join(c['members'])}) on {c['partition']}: "
              + " ".join(f"{n['name']}@{n['addr']}" for n in c["nodes"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
