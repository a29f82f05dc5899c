"""`run_mpi_step`: one MPI program as a new step of the job this process runs in, rank i on hosts[i].

Called from inside a running step (a Ray worker started by a node task), where the environment is
that step's: its task counts and node lists would constrain the new step, and in a heterogeneous
job `SLURM_JOB_ID` names the leader (or, under the MPI bootstrap, this component, which srun
refuses). So the step is described only by its own options: the leader's id and this component's
`--het-group`, `--overlap` (the node task holds the CPUs), and `--distribution=arbitrary` with a
hostfile to put each rank on its node.
"""
from __future__ import annotations

import os
import subprocess
import tempfile

from hpcrl.env_vars import JobEnv

STEP_VARIABLES = ("SLURM_", "PMI_", "PMIX_")     # this step's; OMPI_MCA_* tuning passes on


def inside_job() -> bool:
    return "SLURM_JOB_ID" in os.environ


def job_options(env: dict) -> list[str]:
    """--jobid (the leader's, in a heterogeneous job) and --het-group naming this process's
    component: the one whose node list is this step's (components never share a node)."""
    prefix = "SLURM_JOB_NODELIST_HET_GROUP_"
    for k in sorted(int(key[len(prefix):]) for key in env if key.startswith(prefix)):
        if env[f"{prefix}{k}"] == env.get("SLURM_JOB_NODELIST"):
            return [f"--jobid={env['SLURM_JOB_ID_HET_GROUP_0']}", f"--het-group={k}"]
    return [f"--jobid={env['SLURM_JOB_ID']}"]


def step_command(hosts: list[str], argv: list[str], plugin: str, env: dict) -> list[str]:
    return ["srun", *job_options(env), "--overlap", "--overcommit", f"--mpi={plugin}", f"--ntasks={len(hosts)}",
            "--distribution=arbitrary", "--kill-on-bad-exit=1", "--quiet", *argv]


def run_mpi_step(hosts: list[str], argv: list[str], plugin: str | None = None) -> str:
    """Run argv as len(hosts) MPI tasks, rank i on node hosts[i]; its output, or RuntimeError with it."""
    env = dict(os.environ)
    plugin = plugin or JobEnv.read(env).mpi
    cmd = step_command(hosts, argv, plugin, env)
    clean = {k: v for k, v in env.items() if not k.startswith(STEP_VARIABLES) or k == "SLURM_CONF"}
    with tempfile.NamedTemporaryFile("w", prefix="hpcrl-hosts-", suffix=".txt") as hostfile:
        hostfile.write("\n".join(hosts) + "\n")
        hostfile.flush()
        out = subprocess.run(cmd, env={**clean, "SLURM_HOSTFILE": hostfile.name}, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"MPI step failed (exit {out.returncode}): {' '.join(cmd)}\n{out.stdout}{out.stderr}".rstrip())
    return out.stdout

