"""How the Ray nodes of a job find each other: by polling the head, or through MPI.

`poll`: each node task waits until the head's GCS port accepts, then joins; the batch shell's
`wait` step polls Ray until every expected node is alive.

`mpi`: the node tasks are one MPI job (`srun --mpi=<plugin>` over every node of every component,
one heterogeneous step). Rank 0 (the first node of component 0) starts the head and broadcasts
its address once the head is up; the others join; rank 0 gathering every "started" is the readiness
signal, after which rank 0 writes `ray/ready.<run_id>`, which the `wait` step waits for.

`auto`: `mpi` when mpi4py loads and `srun --mpi=list` offers the plugin, else `poll`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from hpcrl.probe import interpreter_problem

MODES = ("poll", "mpi", "auto")
PMI_VARIABLES = ("PMIX_RANK", "PMI_RANK", "PMI_FD")


def mpi4py_problem(python: str = sys.executable) -> str | None:
    """Why mpi4py cannot be used by `python` (None: it can). Loads the MPI library without
    initialising MPI (outside a step there is no PMI to initialise against)."""
    why = interpreter_problem(python, "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI")
    return why and f"mpi4py does not load in {python}: {why}"


def srun_plugin_problem(plugin: str) -> str | None:
    """Why `srun --mpi=<plugin>` is not available here (None: it is)."""
    try:
        out = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"srun --mpi=list did not run: {e}"
    listed = (out.stdout + out.stderr).split()
    if plugin not in listed:
        return f"srun offers no MPI plugin {plugin!r} (srun --mpi=list: {' '.join(w for w in listed if w.islower()) or 'nothing'})"
    return None


def mpi_problems(python: str, plugin: str) -> list[str]:
    """Everything that stops an MPI bootstrap with this interpreter and srun plugin."""
    return [p for p in (mpi4py_problem(python), srun_plugin_problem(plugin)) if p]


def resolve(mode: str, plugin: str) -> tuple[str, str]:
    """(mode to use, why), in the batch shell before the node step starts."""
    if mode not in MODES:
        raise ValueError(f"bootstrap: {mode!r} is not one of {', '.join(MODES)}")
    if mode == "poll":
        return "poll", "bootstrap: poll"
    problems = mpi_problems(sys.executable, plugin)
    if not problems:
        return "mpi", f"MPI rendezvous through srun --mpi={plugin}"
    if mode == "mpi":
        raise RuntimeError(f"bootstrap: mpi, but {'; '.join(problems)}. Install MPI (.ci/install-mpi, or "
                           "pip install 'hpcrl[mpi]' where the cluster has an MPI) or set bootstrap: poll")
    return "poll", f"polling ({'; '.join(problems)})"


def launched_with_pmi() -> bool:
    return any(v in os.environ for v in PMI_VARIABLES)


def without_pmi(env: dict[str, str]) -> dict[str, str]:
    """env minus the step's PMI/MPI identity: Ray's processes are not ranks of the node step, and a
    worker that loads MPI must not take the node task's rank for its own."""
    return {k: v for k, v in env.items() if not k.startswith(("PMI", "PMIX", "OMPI_", "SLURM_PMIX"))}


def own_component(env: dict[str, str], component: int) -> dict[str, str]:
    """In one step over several hetjob components, srun sets X_HET_GROUP_<k> for every component and
    X itself to one of them: give X this node's component's value, as a step per component would."""
    suffix = f"_HET_GROUP_{component}"
    return {**env, **{k[:-len(suffix)]: v for k, v in env.items() if k.endswith(suffix)}}


def world():
    """MPI_COMM_WORLD of the node step."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def finish() -> None:
    """Finalize MPI once the rendezvous is done: the node tasks then live on (holding their Ray
    nodes) as plain processes, and end at different times without a collective between them."""
    from mpi4py import MPI

    if not MPI.Is_finalized():
        MPI.Finalize()


def wait(request, poll_s: float = 0.01):
    """The message of a non-blocking MPI request. Polled with sleeps: a blocking MPI call spins a
    core, and Ray is starting on the same cores."""
    while True:
        done, message = request.test()
        if done:
            return message
        time.sleep(poll_s)


def share_head_address(comm, address: str | None) -> str:
    """Rank 0 sends the head's address ("" if it failed) to every rank; each returns it."""
    if comm.rank == 0:
        for request in [comm.isend(address or "", dest=r, tag=1) for r in range(1, comm.size)]:
            wait(request)
        return address or ""
    return wait(comm.irecv(source=0, tag=1))


def gather_started(comm, started: bool) -> list[bool] | None:
    """Rank 0 learns which ranks' Ray nodes started (the readiness barrier); the others get None."""
    if comm.rank != 0:
        wait(comm.isend(started, dest=0, tag=2))
        return None
    return [started] + [wait(comm.irecv(source=r, tag=2)) for r in range(1, comm.size)]
