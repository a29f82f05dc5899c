"""What Slurm is asked for: a heterogeneous job of components. Knows nothing about RL.

A component's `members` are opaque labels (hpcrl puts role names there) and `source` is where it
came from in the user's spec (e.g. ``roles.critic``), so every message can point at the field to fix.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from hpcrl.env_vars import JobEnv
from hpcrl.slurm.container import Container

_TIME = re.compile(r"^(?:(?P<d>\d+)-)?(?P<a>\d+)(?::(?P<b>\d+))?(?::(?P<c>\d+))?$")
_MEM = re.compile(r"^(?P<n>\d+(?:\.\d+)?)\s*(?P<u>[KMGT]?)B?$", re.IGNORECASE)


def parse_time_minutes(text: str) -> int:
    """Slurm's time syntax (`MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS`) in whole minutes,
    rounded up as Slurm does. Raises ValueError on anything else."""
    m = _TIME.match(str(text).strip())
    if not m:
        raise ValueError(f"{text!r} is not a Slurm time; use MM, HH:MM:SS or D-HH:MM:SS")
    d, a, b, c = (int(m[k]) if m[k] is not None else None for k in "dabc")
    if d is None:  # MM | MM:SS | HH:MM:SS
        h, mi, s = (0, a, b or 0) if c is None else (a, b, c)
    else:  # D-HH | D-HH:MM | D-HH:MM:SS
        h, mi, s = a, b or 0, c or 0
    seconds = (((d or 0) * 24 + h) * 60 + mi) * 60 + s
    return -(-seconds // 60)


def parse_mem_mb(text: str | int) -> int:
    """Slurm's memory syntax (`512`, `512M`, `4G`, `1T`; bare numbers are MB) in MB."""
    if isinstance(text, int):
        return text
    m = _MEM.match(str(text).strip())
    if not m:
        raise ValueError(f"{text!r} is not a memory size; use e.g. 4G, 512M or a number of MB")
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[m["u"].upper()]
    return int(float(m["n"]) * scale)


@dataclass(frozen=True)
class Gres:
    """A generic resource per node, e.g. ``gpu:a100:4`` -> Gres("gpu", "a100", 4)."""
    name: str
    type: str | None
    count: int

    @classmethod
    def parse(cls, text: str) -> "Gres":
        parts = text.split("(")[0].split(":")  # scontrol may append "(S:0-1)" socket info
        if len(parts) == 2 and parts[1].isdigit():
            return cls(parts[0], None, int(parts[1]))
        if len(parts) == 3 and parts[2].isdigit():
            return cls(parts[0], parts[1], int(parts[2]))
        if len(parts) == 1 and parts[0]:
            return cls(parts[0], None, 1)
        raise ValueError(f"{text!r} is not a GRES; use name:count or name:type:count, e.g. gpu:a100:4")

    def __str__(self) -> str:
        return ":".join([self.name] + ([self.type] if self.type else []) + [str(self.count)])


@dataclass
class Component:
    """One `#SBATCH hetjob` component: resources on one partition."""
    partition: str
    nodes: int = 1
    gres: Gres | None = None
    cpus_per_task: int = 1
    mem_mb: int | None = None  # per node
    time_min: int | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    extra: list[str] = field(default_factory=list)  # raw sbatch flags, e.g. "--reservation=x"
    members: list[str] = field(default_factory=list)
    source: str = ""
    container: Container | None = None   # its steps run in this image (hpcrl/slurm/container.py)

    @property
    def gpus_per_node(self) -> int:
        return self.gres.count if self.gres and self.gres.name == "gpu" else 0

    def options(self) -> list[tuple[str, str | None, str]]:
        """The component's own `#SBATCH` options as (option, value or None for a flag, the spec field
        it comes from), in the order an admin reads them; `extra` follows as written
        (hpcrl.slurm.directives checks every one before it is written)."""
        src = self.source
        opts = [("partition", self.partition, f"{src}.partition"), ("nodes", str(self.nodes), f"{src}.nodes"),
                ("ntasks-per-node", "1", src), ("cpus-per-task", str(self.cpus_per_task), f"{src}.cpus_per_task")]
        if self.mem_mb is not None:
            opts.append(("mem", format_mem(self.mem_mb), f"{src}.mem"))
        if self.gres is not None:
            opts.append(("gres", str(self.gres), f"{src}.gres"))
        if self.time_min is not None:
            opts.append(("time", format_minutes(self.time_min), f"{src}.time"))
        opts += [(k, v, f"{src}.{k}") for k, v in (("account", self.account), ("qos", self.qos),
                                                    ("constraint", self.constraint)) if v]
        if self.exclusive:
            opts.append(("exclusive", None, f"{src}.exclusive"))
        return opts


def format_mem(mb: int) -> str:
    return f"{mb // 1024}G" if mb % 1024 == 0 else f"{mb}M"


def format_minutes(minutes: int) -> str:
    d, rest = divmod(minutes, 24 * 60)
    h, m = divmod(rest, 60)
    return f"{d}-{h:02d}:{m:02d}:00" if d else f"{h:02d}:{m:02d}:00"


@dataclass
class HetJob:
    """A whole heterogeneous job. Component 0 runs the batch script (and so the driver)."""
    name: str
    run_dir: Path
    components: list[Component]
    requeue: bool = True
    signal_lead_s: int = JobEnv.signal_lead
    setup: list[str] = field(default_factory=list)
    python: str = "python3"
    env: dict[str, str] = field(default_factory=dict)  # exported at the top of the script
    driver: str = ""     # shell line run in component 0 once every node's Ray has joined
    bootstrap: str = JobEnv.bootstrap   # how the Ray nodes find each other: poll, mpi or auto (hpcrl.raycluster.rendezvous)
    mpi: str = JobEnv.mpi         # srun --mpi plugin of an MPI bootstrap
    source_file: str = ""
    secrets: tuple[str, ...] = ()   # variables the script reads from RUN_DIR/secrets.env at start (values never in it)
    group_access: bool = False      # a new run directory is opened to the group (else 0700)

    def members(self) -> dict[str, int]:
        return {m: i for i, c in enumerate(self.components) for m in c.members}

    def sbatch_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """`environ` without the secrets, for sbatch: it passes the environment it is given to the job,
        where Slurm keeps it (`scontrol show job -d`, the accounting database); the secrets reach the
        job's processes through RUN_DIR/secrets.env alone."""
        return {k: v for k, v in environ.items() if k not in self.secrets}
