"""`ResourcePool`: the processes one role may run, found by the role's label on the Ray nodes.

The Ray bootstrap gives every node of a role's Slurm component the custom resource
`role:<name>`; so does a satellite job that joins the run for that role (`hpcrl scale`). The pool
is the alive nodes carrying it, never a list of node names. A node with GPUs runs one process per
GPU, and that process holds its whole GPU, however many colocated roles it hosts: no other process
can be placed on "the rest" of a GPU it uses. A CPU node runs `processes_per_node` (default 1), and
so does a GPU node for a role whose processes use no GPU (`uses_gpus=False`: the environments).
When several roles share a node (the reference and reward roles of one component, or every role in
local mode) each gets an equal share of its CPUs.

Ranks are laid out node by node: rank = node_index * processes_per_node + local_index, the job's
own nodes first (by address), then satellites (by job id). Each node's bundles are pinned to that
Ray node by its id (two Ray nodes may share an address: a satellite on a node the job also uses),
so a group's placement is the same every time it is (re)built.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

NODE_ID = "ray.io/node-id"      # the label Ray gives every node


class ResourcePoolError(RuntimeError):
    pass


@dataclass(frozen=True)
class PoolNode:
    """One Ray node a role may use."""
    node_id: str
    ip: str
    name: str          # the Slurm node (label hpcrl.node)
    origin: str        # "component <k>", "satellite <job id>", or "local"

    @property
    def leaves(self) -> bool:
        """A satellite's node may go away (cancelled, preempted, timed out) while the run goes on."""
        return self.origin.startswith("satellite")

    @classmethod
    def of(cls, ray_node: dict) -> PoolNode:
        labels = ray_node.get("Labels") or {}
        origin = (f"satellite {labels['hpcrl.satellite']}" if "hpcrl.satellite" in labels else
                  f"component {labels['hpcrl.component']}" if "hpcrl.component" in labels else "local")
        return cls(ray_node["NodeID"], ray_node["NodeManagerAddress"], labels.get("hpcrl.node", ray_node["NodeManagerAddress"]),
                   origin)


def _layout_key(node: dict):
    labels = node.get("Labels") or {}
    satellite = labels.get("hpcrl.satellite")
    return (satellite is not None, int(satellite) if satellite and satellite.isdigit() else 0,
            node["NodeManagerAddress"], node["NodeID"])


@dataclass
class ResourcePool:
    role: str
    nodes: list[PoolNode]
    processes_per_node: int
    cpus_per_process: float
    gpus_per_process: int          # 1 on a GPU node, 0 on a CPU node
    max_colocate_count: int = 1    # roles one process may host
    uses_gpus: bool = True         # False: CPU processes even on a GPU node (Worker.uses_gpus)

    @classmethod
    def for_role(cls, role: str, processes_per_node: int | None = None, max_colocate_count: int = 1,
                 ray_nodes: list[dict] | None = None, uses_gpus: bool = True) -> ResourcePool:
        """The alive nodes carrying `role` (from `ray_nodes`, a snapshot of ray.nodes(), or asked now);
        uses_gpus False: its processes hold no GPU on GPU nodes."""
        if ray_nodes is None:
            import ray

            ray_nodes = ray.nodes()
        alive = [n for n in ray_nodes if n["Alive"]]
        nodes = sorted((n for n in alive if n["Resources"].get(f"role:{role}")), key=_layout_key)
        if not nodes:
            roles = sorted({k.removeprefix("role:") for n in alive for k in n["Resources"] if k.startswith("role:")})
            raise ResourcePoolError(f"no alive Ray node carries role {role!r} (roles present: {roles}); "
                                    "the role must be in the job spec, or given to start_local()")
        gpus = min(int(n["Resources"].get("GPU", 0)) for n in nodes) if uses_gpus else 0
        if gpus and processes_per_node not in (None, gpus):
            raise ResourcePoolError(f"role {role!r}: processes_per_node={processes_per_node} on nodes with "
                                    f"{gpus} GPUs; a GPU node runs one process per GPU")
        ppn = gpus or processes_per_node or 1
        sharing = max(sum(k.startswith("role:") for k in n["Resources"]) for n in nodes)
        cpus = min(n["Resources"].get("CPU", 0) for n in nodes) / ppn / sharing
        return cls(role, [PoolNode.of(n) for n in nodes], ppn, cpus, 1 if gpus else 0, max_colocate_count, uses_gpus)

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.processes_per_node

    @property
    def node_ips(self) -> list[str]:
        return [n.ip for n in self.nodes]

    def node_of(self, rank: int) -> PoolNode:
        return self.nodes[rank // self.processes_per_node]

    def bundle(self, n_roles: int = 1) -> dict[str, float]:
        """Resources of one process hosting n_roles colocated roles."""
        b = {"CPU": math.floor(self.cpus_per_process * n_roles * 1e4) / 1e4}  # Ray counts in 1e-4 units
        if self.gpus_per_process:
            b["GPU"] = self.gpus_per_process
        return b

    def placement_groups(self, nodes: list[PoolNode], n_roles: int = 1, timeout_s: float = 120.0) -> dict:
        """node id -> a new placement group of that node's processes (one bundle each), pinned to it.
        Each WorkerGroup holds its own (kept when the group is rebuilt); colocated roles share them;
        a node that joins or leaves adds or removes its own."""
        import ray
        from ray.util.placement_group import placement_group

        per_node = self.processes_per_node
        pgs = {n.node_id: placement_group([self.bundle(n_roles)] * per_node, strategy="PACK",
                                          name=f"hpcrl-{self.role}-{n.name}-{time.time_ns()}",
                                          bundle_label_selector=[{NODE_ID: n.node_id}] * per_node)
               for n in nodes}
        ready, _ = ray.wait([pg.ready() for pg in pgs.values()], num_returns=len(pgs), timeout=timeout_s)
        if len(ready) < len(pgs):
            for pg in pgs.values():
                ray.util.remove_placement_group(pg)
            raise ResourcePoolError(
                f"role {self.role!r}: {per_node} processes of {self.bundle(n_roles)} per node could not be placed on "
                f"{[n.name for n in nodes]} within {timeout_s:.0f} s; free resources: {ray.available_resources()}")
        return pgs
