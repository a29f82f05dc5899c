"""`run_mpi_step`: one MPI program as a new step of the job this process runs in, rank i on hosts[i].

Called from inside a running step (a Ray worker started by a node task), where the environment is
that step's: its task counts and node lists would constrain the new step, and in a heterogeneous
job `SLURM_JOB_ID` names the leader (or, under the MPI bootstrap, this component, which srun
refuses). So the step is described only by its own options: the leader's id and this component's
`--het-group`, `--overlap` (the node task holds the CPUs), and `--distribution=arbitrary` with a
hostfile to put each rank on its node.

A step has a bound of its own: past `timeout` it is cancelled (`scancel` of its step id, found by
its unique name) and srun's process group killed where srun does not end with it. srun runs in a
session of its own so that group is srun's alone; its `--time` (a minute past the bound) has
slurmctld end the step even where this process is gone before it could (a rank killed as hung by
the controller).
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import tempfile
import uuid

from hpcrl.env_vars import JobEnv
from hpcrl.slurm.cluster_info import SlurmCommandError, slurm_cmd

STEP_VARIABLES = ("SLURM_", "PMI_", "PMIX_")     # this step's; OMPI_MCA_* tuning passes on
STEP_END_S = 60.0     # a cancelled step's tasks get SIGTERM, SIGKILL after KillWait (30 s by default)


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


class StepTimeout(RuntimeError):
    """An MPI step ran past its bound and was cancelled."""


def step_command(hosts: list[str], argv: list[str], plugin: str, env: dict, name: str, timeout: float) -> list[str]:
    return ["srun", *job_options(env), "--overlap", "--overcommit", f"--mpi={plugin}", f"--ntasks={len(hosts)}",
            "--distribution=arbitrary", "--kill-on-bad-exit=1", "--quiet", f"--job-name={name}",
            f"--time={math.ceil(timeout / 60) + 1}", *argv]      # minutes: Slurm's backstop to our bound


def run_mpi_step(hosts: list[str], argv: list[str], timeout: float, plugin: str | None = None) -> str:
    """Run argv as len(hosts) MPI tasks, rank i on node hosts[i]; its output, or RuntimeError with
    it (StepTimeout past `timeout` seconds)."""
    env = dict(os.environ)
    plugin = plugin or JobEnv.read(env).mpi
    name = f"hpcrl-mpi-{uuid.uuid4().hex[:12]}"
    cmd = step_command(hosts, argv, plugin, env, name, timeout)
    clean = {k: v for k, v in env.items() if not k.startswith(STEP_VARIABLES) or k == "SLURM_CONF"}
    with tempfile.NamedTemporaryFile("w", prefix="hpcrl-hosts-", suffix=".txt") as hostfile:
        hostfile.write("\n".join(hosts) + "\n")
        hostfile.flush()
        return run_bounded(cmd, {**clean, "SLURM_HOSTFILE": hostfile.name}, name, timeout)


def run_bounded(cmd: list[str], env: dict, name: str, timeout: float) -> str:
    """cmd's output; past `timeout` seconds its step (named `name`) is cancelled, its process group
    killed, and StepTimeout raised with what it printed."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        step = cancel_step(name)
        out, err = stop(proc, STEP_END_S if step else 0)
        which = f"{step} ({name})" if step else f"{name} (not in squeue: not started)"
        done = f"cancelled (`scancel {step}`)" if step else "srun killed"
        raise StepTimeout(f"MPI step {which} ran past its bound of {timeout:g} s: {done}: "
                          f"{' '.join(cmd)}\n{out}{err}".rstrip()) from None
    except BaseException:
        stop(proc, 0)
        raise
    if proc.returncode:
        raise RuntimeError(f"MPI step failed (exit {proc.returncode}): {' '.join(cmd)}\n{out}{err}".rstrip())
    return out


def stop(proc: subprocess.Popen, wait_s: float) -> tuple[str, str]:
    """What proc printed, once it has ended by itself within wait_s (srun does once its cancelled
    step has) or its process group has been killed: srun and whatever it started, nothing else."""
    try:
        return proc.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        return proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:            # something outside the group holds its pipes open
        return "", ""


def cancel_step(name: str) -> str | None:
    """scancel the step named `name`; its id (`job.step`), or None where squeue does not list it.
    Found by name: srun prints no step id with --quiet, and a heterogeneous job's component lists
    its steps under its own job id, not the leader's."""
    try:
        steps = slurm_cmd("squeue", "-h", "--steps", "--me", "-o", "%i %j").split("\n")
        step = next((line.split()[0] for line in steps if line.split()[1:] == [name]), None)
        if step:
            slurm_cmd("scancel", step)
        return step
    except (SlurmCommandError, subprocess.TimeoutExpired):
        return None

