"""The job's own Ray cluster: prepared in the batch shell, joined by every node, connected to by the driver.

    prepare(run_dir)     fresh token (0600), head and its ports, the expected nodes -> ray/cluster.json
    wait_ready(run_dir)  barrier: returns when exactly the expected nodes are alive, or names the missing
    request_stop(run_dir) every node task tears its Ray node down (by session id) and exits
    connect(run_dir)     ray.init on the job's cluster with its token
    start_local(roles)   a one-node Ray with the same role resources, for `hpcrl run --local`
"""
from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import socket
import time
import uuid
from pathlib import Path

from hpcrl.files import atomic_write_text
from hpcrl.env_vars import JobEnv
from hpcrl.raycluster.node import keep_logs_and_remove, node_resources, ray_env, ray_temp_dir, wait_for_port
from hpcrl.raycluster.ports import choose_block
from hpcrl.requirements import require_ray
from hpcrl.run_dir import RunDir
from hpcrl.slurm.allocation import gpu_type

# Here, at import: every process that starts or joins the job's Ray cluster imports this module first
# (hpcrl.raycluster), in its own interpreter, where an older Ray would run it without authentication.
require_ray()


def _write_token(path: Path) -> None:
    """A random token, created 0600 (never readable by others, not even for an instant)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def prepare(run_dir: Path, start_timeout_s: float = JobEnv.ray_start_timeout, bootstrap: str = JobEnv.bootstrap,
            mpi_plugin: str = JobEnv.mpi) -> dict:
    """Run in the batch shell, on the head node (first node of component 0), after allocation.json.
    Decides the bootstrap (`auto` becomes mpi or poll here) and records it in cluster.json."""
    from hpcrl.raycluster.rendezvous import resolve

    mode, why = resolve(bootstrap, mpi_plugin)
    paths = RunDir(run_dir)
    alloc = json.loads(paths.allocation.read_text())
    paths.ray.mkdir(parents=True, exist_ok=True)
    paths.ray.chmod(0o700)
    paths.ray_token.unlink(missing_ok=True)  # a fresh token for every job start
    _write_token(paths.ray_token)
    for old in paths.ray_failed.glob("*"):
        old.unlink()
    nodes = [{"index": k, "name": n["name"], "addr": n["addr"], "component": c["index"], "members": c["members"],
              "partition": c["partition"], "gpu_type": gpu_type(c["gres"])}
             for k, (c, n) in enumerate((c, n) for c in alloc["components"] for n in c["nodes"])]
    head = nodes[0]
    ports = choose_block(alloc["job_id"], 0, len(nodes))
    cluster = {"job_id": alloc["job_id"], "run_id": uuid.uuid4().hex[:12], "start_timeout_s": start_timeout_s,
               "bootstrap": mode, "bootstrap_why": why,
               "head": {"name": head["name"], "addr": head["addr"], "ports": {"start": ports.start, "gcs": ports.gcs}},
               "address": f"{head['addr']}:{ports.gcs}", "nodes": nodes}
    atomic_write_text(paths.ray_cluster, json.dumps(cluster, indent=1))
    return cluster


def read_cluster(run_dir: Path) -> dict:
    return json.loads(RunDir(run_dir).ray_cluster.read_text())


def _use_env(run_dir: Path) -> None:
    """Token auth for this process and its children. Ray reads RAY_AUTH_MODE when it is imported and
    the token when first used, once per process: a process that imported ray first (a driver, a
    test joining several clusters) must have both read again. Ray has no public call for that (up to
    2.60 its only interface to token auth is the environment and `ray get-auth-token`); these two
    private ones are what Ray's own `_enable_token_auth` and `reset_auth_token_state` call (2.52-2.60)."""
    os.environ.update(ray_env(Path(run_dir)))
    import sys

    if "ray" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()   # a token read for an earlier cluster


def _local_ip(addr: str) -> str | None:
    """addr if this host owns it (we are on the head node), else None (let Ray pick)."""
    try:
        with socket.socket() as s:
            s.bind((addr, 0))
        return addr
    except OSError:
        return None


def connect(run_dir: str | Path, **init_kwargs):
    """Join the job's Ray cluster as a driver (on the head node), with the job's token."""
    run_dir = Path(run_dir)
    cluster = read_cluster(run_dir)
    _use_env(run_dir)
    import ray

    ip = _local_ip(cluster["head"]["addr"])
    kwargs = {"address": cluster["address"], "log_to_driver": False, **init_kwargs}
    if ip:
        kwargs["_node_ip_address"] = ip
    return ray.init(**kwargs)


def _failures(run_dir: Path) -> str | None:
    """What the nodes that failed wrote (each renames its file into place whole; a name starting
    with a dot is one still being written)."""
    failed = sorted(RunDir(run_dir).ray_failed.glob("[!.]*"))
    if not failed:
        return None
    return "; ".join(f"{f.name}: {f.read_text()}" for f in failed)


class ClusterNotReady(RuntimeError):
    """The job's Ray nodes did not all join in time, or one failed; the message names the missing ones."""


def wait_ready(run_dir: Path, timeout_s: float | None = None, stay_connected: bool = False) -> float:
    """Block until every expected node has joined; seconds waited. Raises ClusterNotReady with the
    missing nodes. stay_connected: this process stays the cluster's driver (the job's driver waits
    so), instead of leaving it."""
    run_dir = Path(run_dir)
    cluster = read_cluster(run_dir)
    timeout_s = cluster["start_timeout_s"] if timeout_s is None else timeout_s
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    expected = {n["name"] for n in cluster["nodes"]}
    joined: set[str] = set()

    def missing_error(why: str) -> ClusterNotReady:
        missing = sorted(expected - joined)
        logs = ", ".join(str(RunDir(run_dir).ray_logs / f"{m}.log") for m in missing)
        return ClusterNotReady(f"Ray cluster of job {cluster['job_id']} not ready: {why}. "
                               f"Missing nodes: {', '.join(missing)}. Their logs: {logs}")

    def until(done, timeout_why: str, poll_s: float) -> float:
        while not done():
            reason = _failures(run_dir)
            if reason:
                raise missing_error(f"a node failed ({reason})")
            if time.monotonic() > deadline:
                raise missing_error(timeout_why)
            time.sleep(poll_s)
        return time.monotonic() - t0

    ready = RunDir(run_dir).ray_ready(cluster["run_id"])
    if cluster.get("bootstrap") == "mpi":      # the node step's rank 0 writes it after the MPI barrier
        return until(ready.exists, f"no MPI rendezvous within {timeout_s:.0f}s", 0.01)
    try:
        wait_for_port(cluster["head"]["addr"], cluster["head"]["ports"]["gcs"], deadline,
                      give_up=lambda: _failures(run_dir))
    except TimeoutError:
        raise missing_error(f"the head's GCS did not accept within {timeout_s:.0f}s") from None
    except RuntimeError as e:
        raise missing_error(f"a node failed ({e})") from None
    connect(run_dir, logging_level="WARNING")
    import ray

    def all_joined() -> bool:
        nonlocal joined
        joined = {n["Labels"].get("hpcrl.node") for n in ray.nodes()
                  if n["Alive"] and n["Labels"].get("hpcrl.jobspec") == cluster["job_id"]}
        return expected <= joined

    try:
        waited = until(all_joined, f"timed out after {timeout_s:.0f}s", 0.05)
    except BaseException:
        ray.shutdown()
        raise
    if not stay_connected:
        ray.shutdown()
    # for watchers on the login node (hpcrl submit --wait): this start's cluster is up
    ready.write_text(f"{len(joined)} nodes after {waited:.2f} s\n")
    return waited


def request_stop(run_dir: Path) -> None:
    cluster = read_cluster(run_dir)
    RunDir(run_dir).ray_stop(cluster["run_id"]).touch()


def start_local(roles: list[str], run_dir: Path | None = None, num_cpus: int | None = None, **init_kwargs):
    """One local Ray node advertising every role, as a Slurm node advertises its own. Its temp dir is
    made as a job node's (ray_temp_dir), not Ray's shared /tmp/ray; at this process's exit its Ray
    stops, its logs go to RUN_DIR/logs/ray/local and the folder is removed."""
    logs_to = None
    if run_dir is not None:
        paths = RunDir(run_dir)
        paths.ray.mkdir(parents=True, exist_ok=True)
        if not paths.ray_token.exists():
            _write_token(paths.ray_token)
        _use_env(paths.root)
        logs_to = paths.ray_logs / "local"
    import ray

    temp_dir = ray_temp_dir("hpcrl-ray-local-")

    def stop() -> None:   # before Ray's own exit handler (atexit runs the last registered first)
        ray.shutdown()
        if logs_to is not None and Path(run_dir).is_dir():     # a run dir gone meanwhile is not made again
            keep_logs_and_remove(temp_dir, logs_to)
        else:
            shutil.rmtree(temp_dir, ignore_errors=True)
    atexit.register(stop)
    context = ray.init(address="local", num_cpus=num_cpus, resources=json.loads(node_resources(roles)),
                       labels={"hpcrl.node": "local", **{f"hpcrl.role.{r}": "1" for r in roles}},
                       include_dashboard=False, log_to_driver=False, _temp_dir=str(temp_dir / "ray"), **init_kwargs)
    _stop_autoscaler_monitor()
    return context


def _stop_autoscaler_monitor() -> None:
    """ray.init starts the autoscaler's monitor, of no use to one fixed node (a job's nodes start with
    `ray start --no-monitor`): stopped now, it takes no core while the roles start, and Ray's shutdown
    no longer waits out its second of grace (a two-step local run: 10.1 -> 9.1 s,
    bench/startup_monitor.json). Where a Ray release has moved these internals, the monitor stays."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    for info in getattr(node, "all_processes", {}).pop("monitor", []):
        info.process.kill()
        info.process.wait()
