"""Every check of a spec before anything is written or submitted, each problem naming its field.

    spec_problems(spec)           the spec alone: relations between roles, and the training settings
                                  against the roles and resources they need (load_spec runs it)
    environment_problems(spec)    the job's interpreter: mpi4py for bootstrap: mpi, h5py with MPI for
                                  checkpoint_io: parallel
    problems_before_submit(spec, job, cluster)
                                  the interpreter's problems, and against the live cluster (scontrol:
                                  partitions, GRES, limits) and its storage (the files the training
                                  settings name), as validate, render and submit run them
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hpcrl.ppo.config import PPOConfig, RolePlace

if TYPE_CHECKING:
    from hpcrl.job.spec import JobSpec
    from hpcrl.slurm.cluster_info import ClusterInfo
    from hpcrl.slurm.job import HetJob

_RESOURCE_FIELDS = ("partition", "nodes", "gpus_per_node", "gpu_type", "gres", "cpus_per_task", "mem",
                    "time", "account", "qos", "constraint", "exclusive", "sbatch_extra")


def spec_problems(spec: JobSpec) -> list[str]:
    return role_problems(spec) or train_problems(spec)


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


def placements(spec: JobSpec) -> dict[str, RolePlace]:
    """Where each role runs, as the training settings see it: its component and its GPUs."""
    out = {}
    for index, members in enumerate(spec.component_roles()):
        owner = spec.roles[members[0]]
        gres = owner.gres_spec()
        gpus = gres.count * owner.nodes if gres and gres.name == "gpu" else 0
        out.update({m: RolePlace(index, gpus, f"roles.{members[0]}") for m in members})
    return out


def train_problems(spec: JobSpec) -> list[str]:
    """The training settings, and what they need of the roles (hpcrl/ppo/config.py says what)."""
    if not spec.train:
        return []
    try:
        cfg = PPOConfig.from_dict(spec.train)
    except ValueError as e:
        return str(e).splitlines()
    return cfg.placement_problems(placements(spec))


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
    if spec.train and PPOConfig.from_dict(spec.train).checkpoint_io == "parallel":
        from hpcrl.checkpoint.parallel import h5py_problem

        problem = h5py_problem(python)
        if problem:
            problems.append(f"train.checkpoint_io: parallel, but {problem}; build h5py against an MPI HDF5 "
                            "(.ci/install-mpi), or use checkpoint_io: auto (serial where it cannot)")
    return problems


def problems_before_submit(spec: JobSpec, job: HetJob, cluster: ClusterInfo | None) -> list[str]:
    """The interpreter's problems and, given the live cluster (None: offline), the cluster's; the
    spec's own problems were found when it was loaded."""
    if cluster is None:
        return environment_problems(spec)
    missing = PPOConfig.from_dict(spec.train).missing_paths() if spec.train else []
    return environment_problems(spec) + missing + cluster.check(job)
