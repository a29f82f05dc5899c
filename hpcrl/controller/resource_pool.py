"""`ResourcePool`: the processes one role may run, found by the role's label on the Ray nodes.

The Ray bootstrap gives every node of a role's Slurm component the custom resource
`role:<name>`; the pool is the alive nodes carrying it, never a list of node names. A node
with GPUs runs one process per GPU, and that process holds its whole GPU, however many
colocated roles it hosts: no other process can be placed on "the rest" of a GPU it uses. A CPU
node runs `processes_per_node` (default 1). When several roles share a node (the reference and
reward roles of one component, or every role in local mode) each gets an equal share of its CPUs.

Ranks are laid out node by node: rank = node_index * processes_per_node + local_index, each
bundle pinned to its node by Ray's `node:<ip>` resource, so a group's placement is the same
every time it is (re)built.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass


class ResourcePoolError(RuntimeError):
    pass


@dataclass
class ResourcePool:
    role: str
    node_ips: list[str]
    processes_per_node: int
    cpus_per_process: float
    gpus_per_process: int          # 1 on a GPU node, 0 on a CPU node
    max_colocate_count: int = 1    # roles one process may host

    @classmethod
    def for_role(cls, role: str, processes_per_node: int | None = None, max_colocate_count: int = 1) -> ResourcePool:
        import ray

        nodes = sorted((n for n in ray.nodes() if n["Alive"] and n["Resources"].get(f"role:{role}")),
                       key=lambda n: n["NodeManagerAddress"])
        if not nodes:
            roles = sorted({k.removeprefix("role:") for n in ray.nodes() if n["Alive"] for k in n["Resources"]
                            if k.startswith("role:")})
            raise ResourcePoolError(f"no alive Ray node carries role {role!r} (roles present: {roles}); "
                                    "the role must be in the job spec, or given to start_local()")
        gpus = min(int(n["Resources"].get("GPU", 0)) for n in nodes)
        if gpus and processes_per_node not in (None, gpus):
            raise ResourcePoolError(f"role {role!r}: processes_per_node={processes_per_node} on nodes with "
                                    f"{gpus} GPUs; a GPU node runs one process per GPU")
        ppn = gpus or processes_per_node or 1
        sharing = max(sum(k.startswith("role:") for k in n["Resources"]) for n in nodes)
        cpus = min(n["Resources"].get("CPU", 0) for n in nodes) / ppn / sharing
        return cls(role, [n["NodeManagerAddress"] for n in nodes], ppn, cpus, 1 if gpus else 0, max_colocate_count)

    @property
    def world_size(self) -> int:
        return len(self.node_ips) * self.processes_per_node

    def bundle(self, n_roles: int = 1) -> dict[str, float]:
        """Resources of one process hosting n_roles colocated roles."""
        b = {"CPU": math.floor(self.cpus_per_process * n_roles * 1e4) / 1e4}  # Ray counts in 1e-4 units
        if self.gpus_per_process:
            b["GPU"] = self.gpus_per_process
        return b

    def placement_group(self, n_roles: int = 1, timeout_s: float = 120.0):
        """A new placement group with one bundle per rank, each pinned to its node. Each WorkerGroup
        holds its own (kept when the group is rebuilt); colocated roles share one group."""
        import ray
        from ray.util.placement_group import placement_group

        bundles = [{**self.bundle(n_roles), f"node:{ip}": 0.001}
                   for ip in self.node_ips for _ in range(self.processes_per_node)]
        pg = placement_group(bundles, strategy="PACK", name=f"hpcrl-{self.role}-{time.time_ns()}")
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            ray.util.remove_placement_group(pg)
            raise ResourcePoolError(
                f"role {self.role!r}: {len(bundles)} processes of {self.bundle(n_roles)} could not be placed on "
                f"{self.node_ips} within {timeout_s:.0f} s; free resources: {ray.available_resources()}")
        return pg
