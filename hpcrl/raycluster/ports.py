"""Per-node Ray port blocks, derived from the job id and checked free before use.

Ray binds its object manager and worker ports on 0.0.0.0, so two Ray nodes on one host (two jobs
sharing a node, or the local cluster's virtual nodes) need disjoint ports even with distinct IPs.
Each node takes a block of SIZE ports: the block its job id and node index point at, or the next
free one at a stride of the job's node count, so that two nodes of one job never probe the same
block while the other is still starting. Every port Ray's Slurm caveats list is in the block.

Blocks lie outside the host's ephemeral range (ip_local_port_range): a port there that is free when
checked can become the source port of any outgoing connection before Ray binds it, and two Ray
clusters on one host make thousands of such connections.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from functools import cache
from importlib.util import find_spec
from pathlib import Path

BASE, TOP, SIZE = 20000, 65536, 200  # blocks of SIZE ports in [BASE, TOP)
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
WORKERS_FROM = 10  # offsets 10..SIZE-1 are the worker ports


# `ray start` flag -> offset in the block; worker ports are offsets WORKERS_FROM..SIZE-1
NODE_PORTS = {"node-manager-port": 1, "object-manager-port": 2, "dashboard-agent-listen-port": 3,
              "dashboard-agent-grpc-port": 4, "metrics-export-port": 5, "runtime-env-agent-port": 6}
HEAD_PORTS = {"port": 0, "dashboard-port": 7}  # GCS and the (minimal) dashboard head
# Ray Client's server: a head runs it where grpc is installed (ray[client]), by default on 10001,
# which gRPC binds with SO_REUSEPORT, so two jobs' heads on one host would share it. Where grpc is
# missing (a lean image), no server runs and `ray start` refuses the flag.
CLIENT_PORT = {"ray-client-server-port": 8}
# not Ray's: the OpenAI-compatible endpoint a generating rank serves to agents (hpcrl/serving)
ENDPOINT_PORT = 9


@dataclass
class PortBlock:
    start: int

    @property
    def gcs(self) -> int:
        return self.start + HEAD_PORTS["port"]

    def ray_start_args(self, head: bool) -> list[str]:
        # called in the interpreter that runs `ray start`: its packages decide
        client = CLIENT_PORT if head and find_spec("grpc") else {}
        flags = {**NODE_PORTS, **(HEAD_PORTS if head else {}), **client}
        return [f"--{flag}={self.start + off}" for flag, off in flags.items()] + [
            f"--min-worker-port={self.start + WORKERS_FROM}", f"--max-worker-port={self.start + SIZE - 1}"]


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


@cache
def block_starts() -> tuple[int, ...]:
    """The first port of every block on this host: in [BASE, TOP), clear of the ephemeral range."""
    low, high = map(int, EPHEMERAL.read_text().split()) if EPHEMERAL.exists() else (32768, 60999)
    return tuple(s for s in range(BASE, TOP - SIZE + 1, SIZE) if s + SIZE <= low or s > high)


def choose_block(job_id: str, node_index: int, n_nodes: int) -> PortBlock:
    """The first block of this node's sequence whose every port is free on this host."""
    starts = block_starts()
    first = int(job_id) * 8 + node_index
    for k in range(len(starts)):
        start = starts[(first + k * n_nodes) % len(starts)]
        if all(_free(p) for p in range(start, start + SIZE)):
            return PortBlock(start)
    raise RuntimeError(f"no free block of {SIZE} ports in {BASE}-{TOP - 1} outside the ephemeral range "
                       f"({EPHEMERAL}) on this host")
