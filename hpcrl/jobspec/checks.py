"""Every check of a spec before anything is written or submitted, each problem naming its field.

    spec_problems(spec)           the spec alone: relations between roles, and the training settings
                                  against the roles and resources they need (load_spec runs it)
    container_problems(spec)      what cannot run in a container (problems_before_submit adds what the login
                                  node sees of the containers: runtimes, images, mount points)
    environment_problems(spec)    the job's interpreter: mpi4py for bootstrap: mpi, h5py with MPI for
                                  checkpoint_io: parallel
    problems_before_submit(spec, job, cluster)
                                  the values that cannot stand in the batch script, the interpreter's
                                  problems, and against the live cluster (scontrol, sacctmgr:
                                  partitions, GRES, features, reservations, accounts, QoS, limits)
                                  and its storage (the run directory, the files the training settings
                                  name), as validate, render and submit run them
    run_dir_warnings(spec)        a run directory that looks node-local (said, not refused)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from hpcrl.ppo.config import BUILTIN_ROLES, TrainConfig

if TYPE_CHECKING:
    from hpcrl.jobspec.models import JobSpec
    from hpcrl.slurm.cluster_info import ClusterInfo
    from hpcrl.slurm.job import HetJob

_RESOURCE_FIELDS = ("partition", "nodes", "gpus_per_node", "gpu_type", "gres", "gpu_mem", "cpus_per_task", "mem",
                    "time", "account", "qos", "constraint", "exclusive", "sbatch_extra", "container")


def spec_problems(spec: JobSpec) -> list[str]:
    return role_problems(spec) or (time_problems(spec) + train_problems(spec) + code_problems(spec)
                                   + container_problems(spec))


def containers(spec: JobSpec) -> list:
    """The distinct containers of the spec's components (the job's once, each role's own)."""
    boxes = (spec.container_of(members[0]) for members in spec.component_roles())
    return list({b.source: b for b in boxes if b is not None}.values())


def container_problems(spec: JobSpec) -> list[str]:
    """What the rest of the spec cannot do where a component runs in a container."""
    boxes = containers(spec)
    problems = []
    if boxes and spec.bootstrap == "mpi":
        problems.append("bootstrap: mpi, but a component runs in a container, where the node tasks' MPI would have to "
                        "match the host's PMIx; use bootstrap: poll (auto polls where there are containers)")
    if boxes and spec.train and spec.train.checkpoint.io == "parallel":
        problems.append("train.checkpoint.io: parallel, but a component runs in a container: the parallel writers "
                        "are a Slurm step the roles start, and an image has no srun; use auto (serial in a container) "
                        "or serial")
    return problems


def role_problems(spec: JobSpec) -> list[str]:
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


def time_problems(spec: JobSpec) -> list[str]:
    """A component's time limit must outlast the signal lead, or the job is told to stop as it starts."""
    from hpcrl.slurm.job import format_minutes, parse_time_minutes

    problems = []
    for members in spec.component_roles():
        role = spec.roles[members[0]]
        if spec.requeue and role.time is not None and parse_time_minutes(role.time) * 60 <= spec.signal_lead:
            problems.append(f"roles.{members[0]}.time: {format_minutes(parse_time_minutes(role.time))} is not longer "
                            f"than signal_lead {spec.signal_lead} s: Slurm would tell the job to checkpoint before it "
                            "ran (raise the time, or lower signal_lead)")
    return problems


def run_dir_problems(spec: JobSpec) -> list[str]:
    """The run directory must be creatable and writable from here (the login node writes the script)."""
    import os
    import tempfile

    path = spec.run_dir
    while not path.exists() and path != path.parent:
        path = path.parent
    if not path.is_dir():
        return [f"run_dir: {spec.run_dir} cannot be made: {path} is not a directory"]
    doing = "written" if path == spec.run_dir else "made"
    if not os.access(path, os.W_OK | os.X_OK):
        return [f"run_dir: {spec.run_dir} cannot be {doing} from here: "
                f"{path} is not writable by this user (choose a run directory on storage you may write)"]
    try:        # access() does not see everything (root, /proc, some network filesystems): try it
        tempfile.TemporaryFile(dir=path).close()      # O_TMPFILE where it can: no name ever appears
    except OSError as e:
        return [f"run_dir: {spec.run_dir} cannot be {doing} from here: {path} refuses a new file "
                f"({e.strerror}; choose a run directory on storage you may write)"]
    return []


NODE_LOCAL_FS = {"tmpfs", "ramfs", "devtmpfs"}
NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")


def run_dir_warnings(spec: JobSpec) -> list[str]:
    """The run directory must be storage every node sees; a node-local filesystem is a likely mistake."""
    from pathlib import Path

    path, mounts = spec.run_dir, []
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return []
    mount = max((m for m in mounts if path == Path(m[0]) or Path(m[0]) in path.parents), key=lambda m: len(m[0]),
                default=None)
    local = (f"a {mount[1]} filesystem ({mount[0]})" if mount and mount[1] in NODE_LOCAL_FS else
             next((d for d in NODE_LOCAL_DIRS if path == Path(d) or Path(d) in path.parents), None))
    if local:
        return [f"run_dir: {path} is on {local}, which is usually node-local: every compute node must see the run "
                "directory (a shared filesystem: scratch, Lustre, GPFS, NFS)"]
    return []


class RolePlace(NamedTuple):
    """Where the spec puts a role: its hetjob component, its nodes and GPUs (all nodes), and the
    spec field that gives them (`roles.<the component's first role>`), for messages."""
    component: int
    nodes: int
    gpus: int
    field: str


def placements(spec: JobSpec) -> dict[str, RolePlace]:
    """Where each role runs, as the training settings see it: its component and its GPUs."""
    out = {}
    for index, members in enumerate(spec.component_roles()):
        owner = spec.roles[members[0]]
        gres = owner.gres_spec()
        gpus = gres.count * owner.nodes if gres and gres.name == "gpu" else 0
        out.update({m: RolePlace(index, owner.nodes, gpus, f"roles.{members[0]}") for m in members})
    return out


def train_problems(spec: JobSpec) -> list[str]:
    """The training settings across sections, and what they need of the spec's roles: every role
    they run placed, the scorers among the reward role and your own, colocated roles in one
    component, megatron's roles on GPUs that its TP × PP layout divides, a mini-batch for every rank
    of a training role, vLLM's tensor parallelism on the GPUs of the generating role."""
    cfg = spec.train
    if not cfg:
        return []
    places, own = placements(spec), own_roles(spec)
    runs = cfg.roles()
    problems = [f"train.{p}" for p in cfg.problems()]
    problems += [f"roles.{r}: missing; train needs it (" + ("judge.enabled" if r == "judge" else
                 f"advantage={cfg.algorithm.advantage}, kl_coef={cfg.algorithm.kl_coef}") +
                 ") — give it resources or same_nodes_as: <role>" for r in runs if r not in places]
    problems += [f"train.reward.scorers[{i}].role: {s.role} is not " + (
                 f"a role that scores (the reward role, or one of your own with roles.{s.role}.worker)"
                 if s.role in places else f"a role of this spec (roles: {', '.join(places)})")
                 for i, s in enumerate(cfg.reward.terms()) if s.role != "reward" and s.role not in own]
    for role in ("actor_rollout", "critic"):
        if role in runs and role in places:
            world = data_parallel_ranks(cfg, role, places[role])
            if cfg.optim.mini_batch_size % world:
                problems.append(f"train.optim.mini_batch_size: {cfg.optim.mini_batch_size} is not a multiple of the "
                                f"{world} ranks of role {role} ({places[role].field}); each rank takes an equal share")
    generator = "rollout" if cfg.rollout.own_role else "actor_rollout"
    if cfg.rollout.tensor_parallel > 1 and generator in places:
        gpus = places[generator].gpus // max(1, places[generator].nodes)
        if not gpus or gpus % cfg.rollout.tensor_parallel:
            problems.append(f"train.rollout.tensor_parallel: {cfg.rollout.tensor_parallel} GPUs per vLLM engine, "
                            f"but role {generator} has {gpus} GPUs per node ({places[generator].field}); it must "
                            "divide them")
    for k, group in enumerate(cfg.layout.colocate):
        unknown = [r for r in group if r not in [*runs, *own] and r not in places]   # placed, not run: left out
        if unknown:
            problems.append(f"train.layout.colocate[{k}]: {unknown} not among the roles this training runs "
                            f"{[*runs, *own]}")
        elif len({places[r].component if r in places else None for r in group}) > 1:
            problems.append(f"train.layout.colocate[{k}]: {group} are in different Slurm components; colocated roles "
                            f"need the same nodes (same_nodes_as: {group[0]})")
    problems += [f"train.layout.processes_per_node.{r}: not a role of this spec" for r in cfg.layout.processes_per_node
                 if r not in places]
    problems += gpu_sharing_problems(spec, places)
    if cfg.engine.backend == "megatron":
        for r in ("actor_rollout", "critic", "ref"):
            if r not in runs or r not in places:
                continue
            place = places[r]
            if not place.gpus:
                problems.append(f"{place.field}: no GPUs, but train.engine.backend: megatron runs role {r} on GPUs "
                                "(set gpus_per_node, or use engine.backend: torch)")
            elif place.gpus % cfg.engine.model_parallel:
                problems.append(f"train.engine.tensor_parallel: {cfg.engine.tensor_parallel} × pipeline_parallel "
                                f"{cfg.engine.pipeline_parallel} = {cfg.engine.model_parallel} GPUs per model does "
                                f"not divide the {place.gpus} GPUs of role {r} ({place.field})")
    return problems


def gpu_roles(cfg: TrainConfig) -> list[str]:
    """The built-in roles this training runs whose processes each hold a GPU on a GPU node (a rule
    reward and the environments run beside them on the CPU; your own roles are not known here)."""
    return [r for r in cfg.roles() if r in ("actor_rollout", "rollout", "critic", "ref", "judge") or
            (r == "reward" and cfg.reward.model_dir)]


def gpu_sharing_problems(spec: JobSpec, places: dict[str, RolePlace]) -> list[str]:
    """A GPU node runs one process per GPU for each group of colocated roles: roles of one component
    that are not colocated would each need all of its GPUs, and the second could never be placed."""
    cfg, problems = spec.train, []
    for members in spec.component_roles():
        if not places[members[0]].gpus:
            continue
        on_gpus = [r for r in members if r in gpu_roles(cfg)]
        groups = [g for g in cfg.layout.colocate if set(g) & set(on_gpus)]
        apart = [r for r in on_gpus if not any(r in g for g in groups)]
        if len(groups) + len(apart) > 1:
            problems.append(f"roles.{members[0]}: roles {on_gpus} share this component's GPUs, but each process "
                            "holds a GPU of its own and they are not colocated; put them in one process per GPU "
                            f"(train.layout.colocate: [{on_gpus}]) or give each a component of its own")
    return problems


def data_parallel_ranks(cfg: TrainConfig, role: str, place: RolePlace) -> int:
    """The data-parallel ranks of a role: one per GPU (per TP × PP group with megatron), else
    processes_per_node per node."""
    if place.gpus and cfg.engine.backend == "megatron":
        return max(1, place.gpus // cfg.engine.model_parallel)
    return place.gpus or place.nodes * cfg.layout.processes_per_node.get(role, 1)


def own_roles(spec: JobSpec) -> tuple[str, ...]:
    """The roles with a worker class of their own."""
    return tuple(r for r, role in spec.roles.items() if role.worker)


def code_problems(spec: JobSpec) -> list[str]:
    """Your own code the spec names: each worker class imports here, subclasses hpcrl.Worker and
    takes its worker_args, the scoring methods of train.reward.scorers are registered on it, the driver and
    train.reward.fn are functions. Imported in this process: the login node runs the job's interpreter
    on the shared filesystem (or say `python:` and install the package there too)."""
    cfg = spec.train
    reward_fn = cfg.reward.fn if cfg else ""
    if not own_roles(spec) and not spec.driver and not reward_fn:
        return []
    from hpcrl.ppo.roles.custom import method_problem, worker_class

    problems, classes = [], {}
    for role in own_roles(spec):
        where = f"roles.{role}.worker"
        if role in BUILTIN_ROLES:
            problems.append(f"{where}: {role} is a built-in role with its own worker; name your role differently "
                            f"(e.g. my_{role}) and add its scores with train.reward.scorers")
            continue
        try:
            classes[role] = worker_class(spec.roles[role].worker, spec.roles[role].worker_args)
        except ValueError as e:
            problems.append(f"{where}: {e}")
    problems += [f"roles.{role}.worker_args: given, but the role has no worker class of its own (worker:)"
                 for role, r in spec.roles.items() if r.worker_args and not r.worker]
    for i, s in enumerate(cfg.reward.terms() if cfg else []):
        problem = method_problem(classes[s.role], s.method) if s.role in classes else None
        if problem:
            problems.append(f"train.reward.scorers[{i}].method: {problem}")
    if reward_fn:      # the reward role imports it as this process does
        shape = ("def score(prompts, responses, **fields) -> a score per sample" if cfg.reward.batched else
                 "def score(prompt, response, **fields) -> float")
        problems += function_problems("train.reward.fn", reward_fn, shape) or judge_fn_problems(cfg)
    if spec.driver:
        problems += function_problems("driver", spec.driver, "def main(ctx: hpcrl.RunContext)")
        if not spec.train:
            problems.append("driver: given, but train: is empty; the driver reads its settings from train:")
    return problems


def function_problems(where: str, path: str, shape: str) -> list[str]:
    """Why `path` ("package.module:function") names no function in this process; `shape`: how one is written."""
    from hpcrl.importing import import_object

    try:
        fn = import_object(path)
    except ValueError as e:
        return [f"{where}: {e}"]
    return [] if callable(fn) else [f"{where}: {path!r} is not a function ({shape})"]


def judge_fn_problems(cfg: TrainConfig) -> list[str]:
    """train.reward.fn (a function that imports) and train.judge agree: an async fn awaits the judge
    and a judge is awaited by an async fn."""
    import inspect

    from hpcrl.importing import import_object

    awaits = inspect.iscoroutinefunction(import_object(cfg.reward.fn))
    if cfg.judge.enabled and not awaits:
        return [f"train.reward.fn: {cfg.reward.fn} is not an async function, but train.judge.enabled gives it a judge "
                "to await; write `async def score(prompt, response, judge, **fields)`"]
    if awaits and not cfg.judge.enabled:
        return [f"train.reward.fn: {cfg.reward.fn} is an async function, which the reward role awaits only with a judge; "
                "set train.judge.enabled: true (and place roles.judge), or make it a plain def"]
    return []


def environment_problems(spec: JobSpec) -> list[str]:
    """What the job's interpreter (spec.python, or this one) lacks for the settings that need it."""
    import sys

    python = spec.python or sys.executable
    problems = []
    if spec.bootstrap == "mpi":
        from hpcrl.raycluster.rendezvous import mpi_problems

        problems += [f"bootstrap: mpi, but {p}; install MPI (.ci/install-mpi, or pip install 'hpcrl[mpi]' against "
                     "the cluster's MPI), or choose bootstrap: auto (polls where MPI is missing) or poll"
                     for p in mpi_problems(python, spec.mpi)]
    if spec.train and spec.train.checkpoint.io == "parallel":
        from hpcrl.checkpoint.parallel import h5py_problem

        problem = h5py_problem(python)
        if problem:
            problems.append(f"train.checkpoint.io: parallel, but {problem}; build h5py against an MPI HDF5 "
                            "(.ci/install-mpi), or use checkpoint.io: auto (serial where it cannot)")
    return problems


def memory_plan(spec: JobSpec, shape: str | None = None):
    """The spec's memory plan (hpcrl/jobspec/memory.py), or None where no component has GPUs or
    nothing trains; `shape`: a named shape (hpcrl.models.size.NAMED_SHAPES) or model folder to plan
    instead of train.model.path. A model whose config cannot be read here gives a plan of no GPUs
    and a note saying so."""
    from hpcrl.jobspec.gpus import gpu_memory
    from hpcrl.jobspec.memory import CONSTANTS, Gpus, MemoryPlan, plan_memory
    from hpcrl.models.size import ModelSize, model_fields, tiny_qwen2_fields
    from hpcrl.slurm.job import parse_mem_mb

    cfg = spec.train
    components = []
    for members in spec.component_roles():
        owner = spec.roles[members[0]]
        gres = owner.gres_spec()
        per_node = gres.count if gres and gres.name == "gpu" else 0
        memory, source = ((parse_mem_mb(owner.gpu_mem) * 2**20, f"gpu_mem {owner.gpu_mem}") if owner.gpu_mem
                          else gpu_memory(gres.type if gres else None))
        components.append(Gpus(f"roles.{members[0]}", tuple(members), owner.nodes, per_node, memory, source))
    if cfg is None or not any(c.per_node for c in components):
        return None
    source = shape or cfg.model.path
    try:
        if source:
            fields = model_fields(source)
        else:
            from hpcrl.models.tokenizer import CharTokenizer
            from hpcrl.ppo.tasks import copy_digits, tool_sums

            alphabet = {"copy_digits": copy_digits, "tool_sums": tool_sums}[cfg.data.task].ALPHABET
            fields = tiny_qwen2_fields(CharTokenizer(alphabet).vocab_size, cfg.model.hidden_size, cfg.model.layers,
                                       cfg.model.heads)
    except ValueError as e:
        return MemoryPlan(cfg, components, None, CONSTANTS, [], [
            f"GPU memory not planned: train.model.path {e}; plan a shape of the same size with "
            "`hpcrl plan SPEC --shape NAME`"])
    return plan_memory(cfg, components, ModelSize.of(fields))


def memory_problems(spec: JobSpec, shape: str | None = None) -> list[str]:
    """plan_problems of the spec's memory plan."""
    return plan_problems(memory_plan(spec, shape))


def plan_problems(plan) -> list[str]:
    """A problem per component whose GPUs the memory plan says will not hold what the spec puts on
    them, each with the changes that would make it fit and the peak each would give."""
    from hpcrl.jobspec.memory import fixes

    if plan is None or plan.fits:
        return []
    gib = 2**30
    problems = []
    for gpu in plan.gpus:
        if gpu.fits is not False:
            continue
        held = "; ".join(f"{'+'.join(p.roles)} {p.peak / gib:.1f} GiB in {p.peak_phase} ("
                         + ", ".join(f"{k} {v / gib:.1f}" for k, v in p.by_kind().items() if v >= gib / 20) + ")"
                         for p in gpu.processes)
        found = fixes(plan, gpu)
        would = "; ".join(f"{' '.join(f.overrides)} → {f.peak / gib:.1f} GiB" for f in found if f.fits)
        lower = "; ".join(f"{' '.join(f.overrides)} → {f.peak / gib:.1f} GiB" for f in found if not f.fits)
        problems.append(f"{gpu.gpus.field}: does not fit its GPUs: {gpu.peak / gib:.1f} GiB planned on each, "
                        f"{gpu.usable / gib:.1f} GiB usable ({gpu.gpus.source}): {held}. "
                        + (f"Would fit: {would}" if would else "Nothing tried fits alone")
                        + (f". Lower, not enough: {lower}" if lower else "")
                        + f". Or a partition whose GPUs hold {larger_gpu(gpu.peak + gpu.processes[0].constants.gpu_reserve)}"
                        + " (hpcrl plan SPEC shows the whole plan)")
    return problems


def larger_gpu(needed: float) -> str:
    """The size a GPU would need, and the smallest card of the GPU table that has it."""
    from hpcrl.jobspec.gpus import CARDS_MIB

    card = min(((mib, name) for name, mib in CARDS_MIB.items() if mib * 2**20 >= needed), default=None)
    return f"{needed / 2**30:.0f} GiB" + (f" (gpu_type {card[1]}: {card[0] / 1024:.0f} GiB)" if card else
                                          " (larger than any card hpcrl knows: more GPUs, or the changes above)")


def problems_before_submit(spec: JobSpec, job: HetJob, cluster: ClusterInfo | None) -> list[str]:
    """What keeps the job from its script (hpcrl.slurm.directives), the interpreter's problems and,
    given the live cluster (None: offline), the cluster's and its storage's; the spec's own problems
    were found when it was loaded."""
    from hpcrl.slurm.directives import problems as unsafe_values

    found = unsafe_values(job, str(job.run_dir)) + environment_problems(spec) + memory_problems(spec)
    if cluster is None:
        return found
    missing = spec.train.missing_paths() if spec.train else []
    here = [p for b in containers(spec) for p in b.problems_here(str(spec.run_dir))]
    return found + run_dir_problems(spec) + missing + cluster.check(job) + here
