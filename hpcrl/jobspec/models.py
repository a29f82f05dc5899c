"""The job spec: one YAML file that maps each RL role to the hardware that suits it.

    name: tiny-ppo
    run_dir: runs/tiny-ppo          # shared filesystem; relative paths are taken from the cwd
    roles:
      actor_rollout: {partition: a100, nodes: 1, gpus_per_node: 1, gpu_type: a100, mem: 4G, time: "00:30:00"}
      critic:        {partition: h100, nodes: 1, gpus_per_node: 1, gpu_type: h100, mem: 4G}
      ref:           {partition: cpu, mem: 4G}
      reward:        {same_nodes_as: ref}   # shares ref's hetjob component
    train: {...}                    # the training settings, in sections: hpcrl/ppo/config.py

Every role either declares resources (and becomes one hetjob component) or names another role
with `same_nodes_as` (and joins that role's component). A role of your own names its worker class
(`worker: mypkg.rules:RuleEngineWorker`); `driver: mypkg.train:main` runs your own loop. Nothing here talks to Slurm. Reading a
spec (YAML, every problem at once) is hpcrl/jobspec/load.py; the checks that span fields, and those
against the live cluster and the job's interpreter, are hpcrl/jobspec/checks.py.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from hpcrl.env_vars import JobEnv
from hpcrl.ppo.config import TrainConfig
from hpcrl.slurm.container import Container
from hpcrl.slurm.directives import control_characters
from hpcrl.slurm.job import Component, Gres, HetJob, parse_mem_mb, parse_time_minutes

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class SpecError(ValueError):
    """Every problem of a spec at once; each line is `field.path: what is wrong (fix)`."""

    def __init__(self, problems: list[str], source: str = "spec"):
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: {len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in problems))


class ContainerSpec(BaseModel):
    """An image the steps of a component run in (docs: how-to/containers.md)."""
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    runtime: Literal["apptainer", "pyxis", "charliecloud"]
    """apptainer (`apptainer exec` inside each srun), pyxis (srun --container-image), charliecloud (ch-run)."""
    image: str
    """A .sif file or folder (apptainer), a folder (charliecloud), a squashfs file or registry reference
    (pyxis), on storage the compute nodes see."""
    python: str = "python3"
    """hpcrl's interpreter inside the image."""
    mounts: list[str] = Field(default_factory=list)
    """More host paths in the image, `path` or `host/path:/path/in/image` (relative ones are taken
    from where hpcrl runs, as run_dir is); the run directory always is, unless a mount holds it."""
    env: dict[str, str] = Field(default_factory=dict)
    """Variables set inside the image."""
    flags: list[str] = Field(default_factory=list)
    """More of the runtime's own flags, as written (e.g. `--writable-tmpfs`)."""

    @field_validator("image", "python", "mounts", "flags")
    @classmethod
    def _one_line(cls, v):
        for text in [v] if isinstance(v, str) else v:
            if not text or control_characters(text):
                raise ValueError(f"{text!r}: give one non-empty line (no control characters)")
        return v

    @field_validator("env")
    @classmethod
    def _names(cls, v):
        bad = [k for k in v if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)] + \
              [f"{k}={x!r}" for k, x in v.items() if control_characters(x)]
        if bad:
            raise ValueError(f"{bad}: names of letters, digits and '_' (not first), values of one line")
        return v

    @model_validator(mode="after")
    def _absolute(self):
        """Relative paths are taken from where hpcrl runs, as run_dir's are (a registry reference stays)."""
        def absolute(p: str) -> str:
            return str((Path.cwd() / Path(p).expanduser()).resolve()) if not p.startswith("/") else p
        self.mounts = [":".join(absolute(p) for p in m.split(":", 1)) for m in self.mounts]
        if self.runtime == "charliecloud" or self.image.startswith(("./", "../", "~")):
            self.image = absolute(self.image)
        return self

    def container(self, source: str) -> Container:
        return Container(self.runtime, self.image, self.python, tuple(self.mounts), tuple(self.env.items()),
                         tuple(self.flags), source)


class RoleSpec(BaseModel):
    """Where one role runs: the resources of its hetjob component, per node."""
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    same_nodes_as: str | None = None
    """Put this role in the named role's component instead of one of its own (no resource fields then)."""
    worker: str | None = None
    """A role of your own: its worker class, `package.module:Class` (a subclass of hpcrl.Worker whose
    methods carry @hpcrl.register), importable where the job runs. The built-in roles have theirs."""
    worker_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the worker class's __init__."""
    partition: str | None = None
    """Slurm partition of this role's component."""
    nodes: int = Field(1, ge=1)
    """Number of nodes."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node (rendered as `--gres=gpu[:type]:N`)."""
    gpu_type: str | None = None
    """GPU type as the cluster's GRES names it (`a100`, `h100`); None takes any."""
    gres: str | None = None
    """A raw GRES per node instead of gpus_per_node/gpu_type, e.g. `gpu:a100:4`."""
    gpu_mem: str | None = None
    """Memory of each of the component's GPUs in Slurm's syntax (`80G`), for the memory plan where
    the GPU type does not say it or says it wrongly (hpcrl/jobspec/gpus.py lists the types it knows);
    None: from gpu_type."""
    cpus_per_task: int = Field(1, ge=1)
    """CPUs of the one task per node (the node's Ray worker and everything it runs)."""
    mem: str | None = None
    """Memory per node in Slurm syntax (`16G`); None takes the partition default."""
    time: str | None = None
    """Time limit in Slurm syntax (`HH:MM:SS`, `D-HH:MM:SS`); None takes the partition default."""
    account: str | None = None
    """Slurm account to charge; None: the user's default (checked with sacctmgr where accounting is on)."""
    qos: str | None = None
    """Quality of service; None: the association's default (checked with sacctmgr where accounting is on)."""
    constraint: str | None = None
    """Node features the component's nodes must have, in Slurm's syntax (`ib&a100_80gb`, `[rack1|rack2]`)."""
    exclusive: bool = False
    """Whole nodes for this component (`--exclusive`)."""
    sbatch_extra: list[str] = Field(default_factory=list)
    """Extra `#SBATCH` flags for this component, one long option each, e.g. `--reservation=rlhf`
    (checked like every value of the script: hpcrl/slurm/directives.py)."""
    container: ContainerSpec | Literal["host"] | None = None
    """This component's image instead of the job's `container:`; `host`: no image for it."""

    @field_validator("time", "mem", "gres", "gpu_mem")
    @classmethod
    def _slurm_syntax(cls, v, info):
        """The value parses as Slurm reads it (the parser's error names the syntax)."""
        if v is not None:
            {"time": parse_time_minutes, "mem": parse_mem_mb, "gpu_mem": parse_mem_mb,
             "gres": Gres.parse}[info.field_name](v)
        return v

    def gres_spec(self) -> Gres | None:
        if self.gres:
            return Gres.parse(self.gres)
        return Gres("gpu", self.gpu_type, self.gpus_per_node) if self.gpus_per_node else None


class WandbSpec(BaseModel):
    """A Weights & Biases run of the job (needs the wandb package: pip install 'hpcrl[wandb]')."""
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    project: str
    """The W&B project the run is logged to."""
    entity: str | None = None
    """The W&B team or user that owns the project; None: your default entity."""
    name: str | None = None
    """The run's name in W&B; None: W&B chooses one."""
    mode: Literal["offline", "online"] = "offline"
    """offline: written to RUN_DIR/wandb/ only (compute nodes often have no network; `wandb sync` later)."""


class MetricsSpec(BaseModel):
    """Where the per-step metrics go besides RUN_DIR/metrics.jsonl."""
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    tensorboard: bool = False
    """Also write TensorBoard events to RUN_DIR/tensorboard/ (needs the tensorboard package)."""
    wandb: WandbSpec | None = None
    """Also log every step to Weights & Biases."""


class JobSpec(BaseModel):
    """A whole hpcrl job: name, run directory, requeue policy, roles and training settings."""
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str
    """Slurm job name."""
    run_dir: Path
    """Run directory on a filesystem every node sees: script, logs, checkpoints, metrics."""
    roles: dict[str, RoleSpec]
    """Role name -> where it runs. The first role with resources is component 0 (runs the driver)."""
    requeue: bool = JobEnv.requeue
    """Checkpoint and requeue on preemption or before the time limit."""
    signal_lead: int = Field(JobEnv.signal_lead, ge=10)
    """Seconds before the time limit when the job is told (USR1) to checkpoint. Slurm checks about
    every 30 s, so keep this at 60 or more."""
    max_restarts: int = Field(JobEnv.max_restarts, ge=0)
    """Requeue at most this many times."""
    ray_start_timeout: int = Field(int(JobEnv.ray_start_timeout), ge=5)
    """Seconds for every node's Ray to join before the job fails, naming the missing nodes."""
    bootstrap: Literal["poll", "mpi", "auto"] = JobEnv.bootstrap
    """How the Ray nodes find each other: "poll" (each waits for the head's port, the script polls
    Ray until all joined), "mpi" (one `srun --mpi` step: rank 0 broadcasts the head's address, an MPI
    barrier marks all joined; needs mpi4py), "auto" (mpi where mpi4py loads and srun has the plugin)."""
    mpi: Literal["pmix", "pmi2"] = JobEnv.mpi
    """The srun --mpi plugin for bootstrap: mpi/auto (what the cluster's MPI was built for)."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run before anything else in the batch script (module load, venv activation)."""
    python: str | None = None
    """Python interpreter on the compute nodes; None: the one running hpcrl (shared filesystem)."""
    train: TrainConfig | None = None
    """The training settings, in sections (hpcrl/ppo/config.py; docs: reference/spec.md); None or
    empty: no training (the allocation and its Ray cluster only)."""
    overridden: dict[str, Any] = Field(default_factory=dict)
    """The values set on the command line (`hpcrl submit SPEC train.optim.actor_lr=1e-6`), path -> value,
    already merged into the fields above: a record for `hpcrl status`, written by hpcrl."""
    driver: str | None = None
    """Your own training loop, `package.module:function`, called with the run's RunContext
    (hpcrl/ppo/context.py) instead of the built-in PPO driver; None: the built-in one."""
    container: ContainerSpec | None = None
    """The image every component's steps run in, unless its role says otherwise (docs: how-to/containers.md)."""
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    """metrics.tensorboard: true adds TensorBoard output; metrics.wandb: {project: ...} a W&B run."""
    secrets: list[str] = Field(default_factory=list)
    """Names of variables (HF_TOKEN, WANDB_API_KEY) whose values every step of the job gets, taken from
    the environment of `hpcrl submit`: they go into RUN_DIR/secrets.env (0600), which the batch script
    reads at start, never into spec.yaml, job.sbatch or a command line (docs: security of the run directory)."""
    run_dir_access: Literal["private", "group"] = "private"
    """Who may enter a run directory that hpcrl creates: private (mode 0700, you alone), or group (0770
    less your umask: your Unix group reads what your umask lets it, e.g. with umask 027). A folder that
    exists keeps its mode."""
    _source: str = PrivateAttr("")
    _notes: list[str] = PrivateAttr(default_factory=list)

    @field_validator("train", mode="before")
    @classmethod
    def _no_training(cls, v):
        return v or None

    @field_validator("run_dir")
    @classmethod
    def _run_dir(cls, v):
        if control_characters(str(v)):
            raise ValueError("a path with control characters (a newline, a NUL) cannot be a run directory")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not _NAME.match(v):
            raise ValueError("use letters, digits, '_', '.', '-' (a Slurm job name without spaces)")
        return v

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, v):
        bad = [k for k in v if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) or k.startswith(("HPCRL_", "SLURM_"))]
        if bad:
            raise ValueError(f"{bad}: names of variables (letters, digits and '_', not first), none of hpcrl's "
                             "(HPCRL_) or Slurm's (SLURM_)")
        return list(dict.fromkeys(v))

    @field_validator("roles")
    @classmethod
    def _roles(cls, v):
        if not v:
            raise ValueError("at least one role is needed")
        bad = [r for r in v if not _NAME.match(r)]
        if bad:
            raise ValueError(f"role names {bad} must be letters, digits, '_', '.', '-'")
        return v

    def as_data(self) -> dict:
        """The spec as written (fields given, resolved run_dir): what RUN_DIR/spec.yaml holds and
        the driver reads back with load_spec."""
        return {**self.model_dump(mode="json", exclude_unset=True), "run_dir": str(self.run_dir)}

    @property
    def source(self) -> str:
        """Where the spec was read from (its file), or its name: what messages about it start with."""
        return self._source or self.name

    @property
    def notes(self) -> list[str]:
        """What was read but should be written otherwise (a flat training key): said, not refused."""
        return list(self._notes)

    def exposed_env(self) -> list[str]:
        """Notes on container `env:` values that look secret (a token, a key, a password): those are written
        into spec.yaml and the job's script or command lines, where `secrets:` keeps them out."""
        boxes = {"container": self.container, **{f"roles.{r}.container": role.container for r, role in self.roles.items()}}
        return [f"{where}.env.{k}: its value is written into spec.yaml, job.sbatch and the steps' command lines; "
                f"if it is a secret, remove it there, list {k} under secrets: and export it before hpcrl submit"
                for where, box in boxes.items() if isinstance(box, ContainerSpec) for k in box.env
                if re.search(r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|_KEY$", k, re.I) and k not in self.secrets]

    def component_roles(self) -> list[list[str]]:
        """Roles grouped by hetjob component, components in spec order."""
        groups: dict[str, list[str]] = {}
        for role, r in self.roles.items():
            owner = role
            while self.roles[owner].same_nodes_as is not None:
                owner = self.roles[owner].same_nodes_as
            groups.setdefault(owner, []).append(role)
        return list(groups.values())

    def container_of(self, role: str) -> Container | None:
        """The container of the component `role` heads: its own, `host` (none), or the job's."""
        own = self.roles[role].container
        if own == "host":
            return None
        if own is not None:
            return own.container(f"roles.{role}.container")
        return self.container.container("container") if self.container else None

    @property
    def node_bootstrap(self) -> str:
        """bootstrap, but poll where a component runs in a container (auto would take the host's MPI)."""
        return "poll" if self.bootstrap == "auto" and any(
            self.container_of(m[0]) for m in self.component_roles()) else self.bootstrap

    def job_env(self) -> JobEnv:
        """What the batch script exports for the job's steps."""
        return JobEnv(run_dir=str(self.run_dir), ray_start_timeout=self.ray_start_timeout, bootstrap=self.node_bootstrap,
                      mpi=self.mpi, signal_lead=self.signal_lead, max_restarts=self.max_restarts,
                      requeue=self.requeue)

    def to_hetjob(self, python: str) -> HetJob:
        comps = []
        for members in self.component_roles():
            r = self.roles[members[0]]
            comps.append(Component(
                partition=r.partition, nodes=r.nodes, gres=r.gres_spec(), cpus_per_task=r.cpus_per_task,
                mem_mb=parse_mem_mb(r.mem) if r.mem else None,
                time_min=parse_time_minutes(r.time) if r.time else None, account=r.account, qos=r.qos,
                constraint=r.constraint, exclusive=r.exclusive, extra=list(r.sbatch_extra),
                members=members, source=f"roles.{members[0]}", container=self.container_of(members[0])))
        return HetJob(name=self.name, run_dir=self.run_dir, components=comps, requeue=self.requeue,
                      signal_lead_s=self.signal_lead, setup=list(self.setup), python=self.python or python,
                      bootstrap=self.node_bootstrap, mpi=self.mpi,
                      env=self.job_env().exports(),
                      driver=f'{self.python or python} -m hpcrl.launch "${JobEnv.var("run_dir")}"' if self.train else "",
                      source_file=self._source, secrets=tuple(self.secrets), group_access=self.run_dir_access == "group")
