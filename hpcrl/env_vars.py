"""`JobEnv`: every HPCRL_* variable, with its default, read and written here only.

The spec's job-wide settings travel to the batch script as exported variables; the steps of the job
(the Ray bootstrap, the requeue step, the driver, an MPI step) read them back with `JobEnv.read()`.

    HPCRL_RUN_DIR            the run directory
    HPCRL_RAY_START_TIMEOUT  seconds for every Ray node to join
    HPCRL_BOOTSTRAP          poll | mpi | auto
    HPCRL_MPI                the srun --mpi plugin (pmix | pmi2)
    HPCRL_SIGNAL_LEAD        seconds before the time limit that Slurm signals the job
    HPCRL_MAX_RESTARTS       requeues allowed
    HPCRL_REQUEUE            1 | 0
    HPCRL_DEADLINE           epoch seconds by which the driver stops (set by the batch script itself)
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

PREFIX = "HPCRL_"

EXIT_REQUEUE = 3
"""Exit status of a driver that stopped at a committed checkpoint (signal or deadline) and wants
its job requeued; the batch script's requeue step acts on it."""


@dataclass(frozen=True)
class JobEnv:
    run_dir: str = "."
    ray_start_timeout: float = 180.0
    bootstrap: str = "poll"
    mpi: str = "pmix"
    signal_lead: int = 120
    max_restarts: int = 3
    requeue: bool = True
    deadline: float | None = None

    @staticmethod
    def var(field: str) -> str:
        """The variable of a field: run_dir -> HPCRL_RUN_DIR."""
        return PREFIX + field.upper()

    def exports(self) -> dict[str, str]:
        """The variables the batch script exports (the deadline comes from Slurm inside the job)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[self.var(f.name)] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return out

    @classmethod
    def read(cls, environ: dict[str, str] | None = None) -> JobEnv:
        """The job's settings from the environment; a variable that is unset or empty keeps its default."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(cls.var(f.name), "")
            if raw == "":
                continue
            kind = type(f.default) if f.default is not None else float
            values[f.name] = raw == "1" if kind is bool else kind(raw)
        return cls(**values)
