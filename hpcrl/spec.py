"""The job spec: one YAML file that maps each RL role to the hardware that suits it.

    name: tiny-ppo
    run_dir: runs/tiny-ppo          # shared filesystem; relative paths are taken from the cwd
    roles:
      actor_rollout: {partition: a100, nodes: 1, gpus_per_node: 1, gpu_type: a100, mem: 4G, time: "00:30:00"}
      critic:        {partition: h100, nodes: 1, gpus_per_node: 1, gpu_type: h100, mem: 4G}
      ref:           {partition: cpu, mem: 4G}
      reward:        {same_nodes_as: ref}   # shares ref's hetjob component
    train: {...}                    # the training settings (read by the trainer, opaque here)

Every role either declares resources (and becomes one hetjob component) or names another role
with `same_nodes_as` (and joins that role's component). Nothing here talks to Slurm.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from hpcrl.slurm.job import Component, Gres, HetJob, parse_mem_mb, parse_time_minutes

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_RESOURCE_FIELDS = ("partition", "nodes", "gpus_per_node", "gpu_type", "gres", "cpus_per_task", "mem",
                    "time", "account", "qos", "constraint", "exclusive", "sbatch_extra")


class SpecError(ValueError):
    """Every problem of a spec at once; each line is `field.path: what is wrong (fix)`."""

    def __init__(self, problems: list[str], source: str = "spec"):
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: {len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in problems))


class RoleSpec(BaseModel):
    """Where one role runs: the resources of its hetjob component, per node."""
    model_config = ConfigDict(extra="forbid")

    same_nodes_as: str | None = None
    """Put this role in the named role's component instead of one of its own (no resource fields then)."""
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
    cpus_per_task: int = Field(1, ge=1)
    """CPUs of the one task per node (the node's Ray worker and everything it runs)."""
    mem: str | None = None
    """Memory per node in Slurm syntax (`16G`); None takes the partition default."""
    time: str | None = None
    """Time limit in Slurm syntax (`HH:MM:SS`, `D-HH:MM:SS`); None takes the partition default."""
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    sbatch_extra: list[str] = Field(default_factory=list)
    """Extra `#SBATCH` flags for this component, e.g. `--reservation=rlhf`."""

    @field_validator("time")
    @classmethod
    def _time(cls, v):
        if v is not None:
            parse_time_minutes(v)
        return v

    @field_validator("mem")
    @classmethod
    def _mem(cls, v):
        if v is not None:
            parse_mem_mb(v)
        return v

    @field_validator("gres")
    @classmethod
    def _gres(cls, v):
        if v is not None:
            Gres.parse(v)
        return v

    @field_validator("sbatch_extra")
    @classmethod
    def _extra(cls, v):
        bad = [f for f in v if not f.startswith("--")]
        if bad:
            raise ValueError(f"flags must be long options like --reservation=x; got {bad}")
        return v

    def gres_spec(self) -> Gres | None:
        if self.gres:
            return Gres.parse(self.gres)
        return Gres("gpu", self.gpu_type, self.gpus_per_node) if self.gpus_per_node else None


class MetricsSpec(BaseModel):
    """Where the per-step metrics go besides RUN_DIR/metrics.jsonl."""
    model_config = ConfigDict(extra="forbid")

    tensorboard: bool = False
    """Also write TensorBoard events to RUN_DIR/tensorboard/ (needs the tensorboard package)."""


class JobSpec(BaseModel):
    """A whole hpcrl job: name, run directory, requeue policy, roles and training settings."""
    model_config = ConfigDict(extra="forbid")

    name: str
    """Slurm job name."""
    run_dir: Path
    """Run directory on a filesystem every node sees: script, logs, checkpoints, metrics."""
    roles: dict[str, RoleSpec]
    """Role name -> where it runs. The first role with resources is component 0 (runs the driver)."""
    requeue: bool = True
    """Checkpoint and requeue on preemption or before the time limit."""
    signal_lead: int = Field(120, ge=10)
    """Seconds before the time limit when the job is told (USR1) to checkpoint. Slurm checks about
    every 30 s, so keep this at 60 or more."""
    max_restarts: int = Field(3, ge=0)
    """Requeue at most this many times."""
    ray_start_timeout: int = Field(180, ge=5)
    """Seconds for every node's Ray to join before the job fails, naming the missing nodes."""
    bootstrap: Literal["poll", "mpi", "auto"] = "poll"
    """How the Ray nodes find each other: "poll" (each waits for the head's port, the script polls
    Ray until all joined), "mpi" (one `srun --mpi` step: rank 0 broadcasts the head's address, an MPI
    barrier marks all joined; needs mpi4py), "auto" (mpi where mpi4py loads and srun has the plugin)."""
    mpi: Literal["pmix", "pmi2"] = "pmix"
    """The srun --mpi plugin for bootstrap: mpi/auto (what the cluster's MPI was built for)."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run before anything else in the batch script (module load, venv activation)."""
    python: str | None = None
    """Python interpreter on the compute nodes; None: the one running hpcrl (shared filesystem)."""
    train: dict[str, Any] = Field(default_factory=dict)
    """Training settings, read by the trainer."""
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    """metrics.tensorboard: true adds TensorBoard output."""
    _source: str = PrivateAttr("")

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not _NAME.match(v):
            raise ValueError("use letters, digits, '_', '.', '-' (a Slurm job name without spaces)")
        return v

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

    def component_roles(self) -> list[list[str]]:
        """Roles grouped by hetjob component, components in spec order."""
        groups: dict[str, list[str]] = {}
        for role, r in self.roles.items():
            owner = role
            while self.roles[owner].same_nodes_as is not None:
                owner = self.roles[owner].same_nodes_as
            groups.setdefault(owner, []).append(role)
        return list(groups.values())

    def to_hetjob(self, python: str) -> HetJob:
        comps = []
        for members in self.component_roles():
            r = self.roles[members[0]]
            comps.append(Component(
                partition=r.partition, nodes=r.nodes, gres=r.gres_spec(), cpus_per_task=r.cpus_per_task,
                mem_mb=parse_mem_mb(r.mem) if r.mem else None,
                time_min=parse_time_minutes(r.time) if r.time else None, account=r.account, qos=r.qos,
                constraint=r.constraint, exclusive=r.exclusive, extra=list(r.sbatch_extra),
                members=members, source=f"roles.{members[0]}"))
        return HetJob(name=self.name, run_dir=self.run_dir, components=comps, requeue=self.requeue,
                      signal_lead_s=self.signal_lead, setup=list(self.setup), python=self.python or python,
                      bootstrap=self.bootstrap, mpi=self.mpi,
                      env={"HPCRL_RAY_START_TIMEOUT": str(self.ray_start_timeout),
                           "HPCRL_BOOTSTRAP": self.bootstrap, "HPCRL_MPI": self.mpi,
                           "HPCRL_SIGNAL_LEAD": str(self.signal_lead), "HPCRL_MAX_RESTARTS": str(self.max_restarts),
                           "HPCRL_REQUEUE": "1" if self.requeue else "0"},
                      driver=f'{self.python or python} -m hpcrl.trainer "$HPCRL_RUN_DIR"' if self.train else "",
                      source_file=self._source)


def _check_roles(spec: JobSpec) -> list[str]:
    """Cross-field problems pydantic cannot see field by field."""
    problems = []
    for role, r in spec.roles.items():
        path = f"roles.{role}"
        if r.same_nodes_as is not None:
            set_fields = sorted(set(r.model_fields_set) & set(_RESOURCE_FIELDS))
            if set_fields:
                problems.append(f"{path}: has same_nodes_as and resource fields {set_fields} "
                                f"(drop them; the component's resources come from roles.{r.same_nodes_as})")
            seen = {role}
            owner = r.same_nodes_as
            while owner is not None:
                if owner not in spec.roles:
                    problems.append(f"{path}.same_nodes_as: unknown role {owner!r} "
                                    f"(one of: {', '.join(spec.roles)})")
                    break
                if owner in seen:
                    problems.append(f"{path}.same_nodes_as: cycle through {sorted(seen)} "
                                    "(one role of the group must declare resources)")
                    break
                seen.add(owner)
                owner = spec.roles[owner].same_nodes_as
            continue
        if r.partition is None:
            problems.append(f"{path}.partition: missing (name the Slurm partition, or use same_nodes_as: <role>)")
        if r.gres and ({"gpus_per_node", "gpu_type"} & r.model_fields_set):
            problems.append(f"{path}.gres: given together with gpus_per_node/gpu_type (use one of the two)")
        if r.gpu_type and not r.gpus_per_node:
            problems.append(f"{path}.gpu_type: set but gpus_per_node is 0 (set gpus_per_node: N)")
    return problems


def _check_train(spec: JobSpec) -> list[str]:
    """The training settings, and that every role they run has a place to run."""
    if not spec.train:
        return []
    from hpcrl.config import PPOConfig

    try:
        cfg = PPOConfig.from_dict(spec.train)
    except ValueError as e:
        return str(e).splitlines()
    problems = [f"roles.{r}: missing; train needs it (advantage={cfg.advantage}, kl_coef={cfg.kl_coef}) — "
                f"give it resources or same_nodes_as: <role>" for r in cfg.roles() if r not in spec.roles]
    if cfg.checkpoint_io == "parallel":
        from hpcrl.checkpoint_mpio import h5py_problem

        problem = h5py_problem(spec.python or sys.executable)
        if problem:
            problems.append(f"train.checkpoint_io: parallel, but {problem}; build h5py against an MPI HDF5 "
                            "(.ci/install-mpi), or use checkpoint_io: auto (serial where it cannot)")
    component = {m: i for i, members in enumerate(spec.component_roles()) for m in members}
    for k, group in enumerate(cfg.colocate):
        unknown = [r for r in group if r not in cfg.roles()]
        if unknown:
            problems.append(f"train.colocate[{k}]: {unknown} not among the roles this training runs {cfg.roles()}")
        elif len({component.get(r) for r in group}) > 1:
            problems.append(f"train.colocate[{k}]: {group} are in different Slurm components; colocated roles "
                            f"need the same nodes (same_nodes_as: {group[0]})")
    problems += [f"train.processes_per_node.{r}: not a role of this spec" for r in cfg.processes_per_node
                 if r not in spec.roles]
    if cfg.train_engine == "megatron":
        owner = {m: members[0] for members in spec.component_roles() for m in members}
        need = cfg.tensor_parallel * cfg.pipeline_parallel
        for r in ("actor_rollout", "critic", "ref"):
            if r not in cfg.roles() or r not in owner:
                continue
            role = spec.roles[owner[r]]
            gres = role.gres_spec()
            gpus = gres.count * role.nodes if gres and gres.name == "gpu" else 0
            if not gpus:
                problems.append(f"roles.{owner[r]}: no GPUs, but train.train_engine: megatron runs role {r} on GPUs "
                                "(set gpus_per_node, or use train_engine: torch)")
            elif gpus % need:
                problems.append(f"train.tensor_parallel × pipeline_parallel = {need} does not divide the {gpus} GPUs "
                                f"of role {r} (roles.{owner[r]})")
    return problems


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML silently keeps the last of two equal keys; a duplicated role must be an error."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark)
            seen[key] = True
        return super().construct_mapping(node, deep)


def _pydantic_problem(err: dict) -> str:
    path = ".".join(str(p) for p in err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = err["loc"][:-1]
        model = RoleSpec if len(parent) == 2 and parent[0] == "roles" else JobSpec
        return f"{path}: unknown field (valid fields: {', '.join(model.model_fields)})"
    if kind == "missing":
        return f"{path}: required field is missing"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{path}: {msg} (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) \
        else f"{path}: {msg}"


def parse_spec(data: Any, source: str = "spec", run_dir: str | Path | None = None) -> JobSpec:
    """A validated JobSpec from parsed YAML, or a SpecError listing every problem."""
    if not isinstance(data, dict):
        raise SpecError([f"top level: expected a mapping of fields, got {type(data).__name__}"], source)
    if run_dir is not None:
        data = {**data, "run_dir": str(run_dir)}
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError([_pydantic_problem(err) for err in e.errors()], source) from None
    problems = _check_roles(spec) or _check_train(spec)
    if problems:
        raise SpecError(problems, source)
    spec.run_dir = spec.run_dir.expanduser().resolve()
    spec._source = source
    return spec


def load_spec(path: str | Path, run_dir: str | Path | None = None) -> JobSpec:
    """Read and validate a YAML job spec; `run_dir` overrides the spec's run directory."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError([f"cannot read the spec: {e.strerror}"], str(path)) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise SpecError([f"not valid YAML: {e}"], str(path)) from None
    return parse_spec(data, str(path), run_dir)
