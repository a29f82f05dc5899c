"""Ray nodes on this machine laid out as a job's components would be, without Slurm, for the benches
that hold a layout's figures against the same layout through Slurm or on one process.

Each node is `ray start --block` in a session of its own, with its roles' resources and GPUs, and is
stopped by its session as the job's nodes are (hpcrl/raycluster/node.py): never `ray stop`, which
ends every Ray process of the host, another run's and the machine's own.
"""
from __future__ import annotations

import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def local_nodes(nodes: list[tuple[list[str], str, int]], env: dict, logs: Path) -> Iterator[str]:
    """nodes: (roles, CUDA_VISIBLE_DEVICES ("" for none), CPUs) each, the head first; yields the
    head's address once every node has started (its output in logs/local-<k>.log)."""
    from hpcrl.raycluster.node import kill_session, node_resources, start_ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for k, (roles, gpus, cpus) in enumerate(nodes):
            where = ["--head", f"--port={port}", "--include-dashboard=false"] if k == 0 else [f"--address=127.0.0.1:{port}"]
            cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *where, "--node-ip-address=127.0.0.1",
                   f"--num-gpus={len(gpus.split(',')) if gpus else 0}", f"--num-cpus={cpus}",
                   f"--resources={node_resources(roles)}", "--disable-usage-stats"]
            proc, started = start_ray(cmd, {**env, "CUDA_VISIBLE_DEVICES": gpus}, logs / f"local-{k}.log")
            procs.append(proc)
            deadline = time.monotonic() + 120
            while not started.wait(0.2):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"local Ray node {k} ({roles}) did not start: see {logs / f'local-{k}.log'}")
        yield f"127.0.0.1:{port}"
    finally:
        for proc in reversed(procs):
            kill_session(proc.pid)
            proc.wait()
