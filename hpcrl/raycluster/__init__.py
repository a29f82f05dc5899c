"""Ray inside the Slurm allocation: one node per allocated node, labelled by role, token-protected."""
from hpcrl.raycluster.session import ClusterNotReady, connect, start_local, wait_ready

__all__ = ["ClusterNotReady", "connect", "start_local", "wait_ready"]
