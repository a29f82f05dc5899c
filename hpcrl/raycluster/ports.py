"""Per-node Ray port blocks, derived from the job id and checked free before use.

Ray binds its object manager and worker ports on 0.0.0.0, so two Ray nodes on one host (two jobs
sharing a node, or the local cluster's virtual nodes) need disjoint ports even with distinct IPs.
Each node takes a block of SIZE ports: the block its job id and node index point at, or the next
free one at a stride of the job's node count, so that two nodes of one job never probe the same
block while the other is still starting. Every port Ray's Slurm caveats list is in the block.
"""
from __future__ import annotations

import socket
from dataclasses import asdict, dataclass

BASE, SIZE, BLOCKS = 20000, 200, 200  # ports 20000-59999
WORKERS_FROM = 10  # offsets 10..SIZE-1 are the worker ports


@dataclass
class PortBlock:
    start: int

    @property
    def gcs(self) -> int: return self.start
    @property
    def node_manager(self) -> int: return self.start + 1
    @property
    def object_manager(self) -> int: return self.start + 2
    @property
    def dashboard_agent_listen(self) -> int: return self.start + 3
    @property
    def dashboard_agent_grpc(self) -> int: return self.start + 4
    @property
    def metrics_export(self) -> int: return self.start + 5
    @property
    def runtime_env_agent(self) -> int: return self.start + 6
    @property
    def dashboard(self) -> int: return self.start + 7

    def ray_start_args(self, head: bool) -> list[str]:
        args = [f"--node-manager-port={self.node_manager}", f"--object-manager-port={self.object_manager}",
                f"--dashboard-agent-listen-port={self.dashboard_agent_listen}",
                f"--dashboard-agent-grpc-port={self.dashboard_agent_grpc}",
                f"--metrics-export-port={self.metrics_export}", f"--runtime-env-agent-port={self.runtime_env_agent}",
                f"--min-worker-port={self.start + WORKERS_FROM}", f"--max-worker-port={self.start + SIZE - 1}"]
        if head:
            args += [f"--port={self.gcs}", f"--dashboard-port={self.dashboard}"]
        return args

    def to_dict(self) -> dict:
        return asdict(self)


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def choose_block(job_id: str, node_index: int, n_nodes: int) -> PortBlock:
    """The first block of this node's sequence whose every port is free on this host."""
    first = int(job_id) * 8 + node_index
    for k in range(BLOCKS):
        start = BASE + ((first + k * n_nodes) % BLOCKS) * SIZE
        if all(_free(p) for p in range(start, start + SIZE)):
            return PortBlock(start)
    raise RuntimeError(f"no free block of {SIZE} ports in {BASE}-{BASE + SIZE * BLOCKS - 1} on this host")
