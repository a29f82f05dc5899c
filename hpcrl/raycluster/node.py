"""One Ray node, run as the one task of a Slurm step on its node, until the job says stop.

The task starts `ray start --block` in a session of its own: every Ray process of this node (GCS,
raylet, agents, workers) carries that session id, so teardown signals exactly those processes,
never another job's (`ray stop` would kill every Ray process of the host).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from hpcrl.files import atomic_write_text
from hpcrl.raycluster.ports import PortBlock, choose_block
from hpcrl.run_dir import RunDir
from hpcrl.slurm.allocation import node_name

POLL_S = 0.1


def ray_env(run_dir: Path) -> dict[str, str]:
    """What every Ray process of the job (nodes and drivers) needs: token auth, no usage stats."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(RunDir(run_dir).ray_token),
            "RAY_USAGE_STATS_ENABLED": "0"}


def wait_for_port(addr: str, port: int, deadline: float, give_up=lambda: None) -> None:
    """Until something accepts on addr:port. `give_up()` returns a reason to stop early, or None."""
    while time.monotonic() < deadline:
        reason = give_up()
        if reason:
            raise RuntimeError(reason)
        try:
            socket.create_connection((addr, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing accepted on {addr}:{port}")


def session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):  # fields: state ppid pgrp session
                pids.append(int(entry.name))
    return pids


def kill_session(sid: int, grace_s: float = 3.0) -> None:
    """SIGTERM every live process of session `sid`, SIGKILL what is left after the grace time."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_pids(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not session_pids(sid):
            return


def node_resources(members: list[str]) -> str:
    # A role's placement asks a sliver of `role:<name>`: the code never names nodes.
    return json.dumps({f"role:{m}": 1 for m in members})


def node_labels(cluster: dict, me: dict) -> str:
    labels = {"hpcrl.job": cluster["job_id"], "hpcrl.node": me["name"], "hpcrl.component": str(me["component"]),
              "hpcrl.partition": me["partition"], "hpcrl.gpu_type": me["gpu_type"] or "none",
              **{f"hpcrl.role.{m}": "1" for m in me["members"]}}
    return ",".join(f"{k}={v}" for k, v in labels.items())


def start_ray(cmd: list[str], env: dict, log_path: Path) -> tuple[subprocess.Popen, threading.Event]:
    """`ray start --block` in a session of its own, its output appended to log_path; the event is set
    when Ray reports the node started (for a worker node: registered with the head)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    started = threading.Event()

    def copy():
        with open(log_path, "ab") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if b"Ray runtime started" in line:
                    started.set()
    threading.Thread(target=copy, daemon=True, name="ray-start-log").start()
    return proc, started


def run_node(run_dir: Path) -> int:
    paths = RunDir(run_dir)
    cluster = json.loads(paths.ray_cluster.read_text())
    name = node_name()
    me = next((n for n in cluster["nodes"] if n["name"] == name), None)
    if me is None:
        raise RuntimeError(f"node {name} is not in {run_dir}/ray/cluster.json")
    head = name == cluster["head"]["name"]
    ports = PortBlock(cluster["head"]["ports"]["start"]) if head else choose_block(cluster["job_id"], me["index"], len(cluster["nodes"]))
    stop_file = paths.ray_stop(cluster["run_id"])
    failed = paths.ray_failed
    log_dir = paths.ray_logs
    log_dir.mkdir(parents=True, exist_ok=True)
    temp_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"hpcrl-ray-{cluster['job_id']}-{name}"

    mpi = cluster.get("bootstrap") == "mpi"
    if mpi:
        from hpcrl.raycluster import rendezvous
    base = rendezvous.without_pmi(rendezvous.own_component(dict(os.environ), me["component"])) if mpi else dict(os.environ)
    gpus = [g for g in base.get("SLURM_STEP_GPUS", "").split(",") if g]
    cpus = int(base.get("SLURM_CPUS_ON_NODE", "1"))
    mem_mb = int(base.get("SLURM_MEM_PER_NODE", "0") or 0) or 4096
    env = {**base, **ray_env(run_dir),
           # the batch shell's GPUs leak into every component's steps; this step's own are right
           "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    ray_bin = str(Path(sys.executable).with_name("ray"))
    cmd = [ray_bin, "start", "--block", f"--node-ip-address={me['addr']}", f"--num-cpus={cpus}",
           f"--num-gpus={len(gpus)}", f"--object-store-memory={max(80, mem_mb * 3 // 10) * 1024 * 1024}",
           f"--resources={node_resources(me['members'])}", f"--labels={node_labels(cluster, me)}",
           f"--temp-dir={temp_dir}", "--disable-usage-stats", *ports.ray_start_args(head)]
    if head:
        cmd += ["--head", "--include-dashboard=false", "--dashboard-host=127.0.0.1"]
    else:
        cmd += [f"--address={cluster['address']}"]

    stop_asked = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: stop_asked.append(s))
    # USR1/USR2 are the job's checkpoint signals: they are for the driver, not for Ray
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)

    def fail(reason: str) -> int:
        failed.mkdir(parents=True, exist_ok=True)
        atomic_write_text(failed / name, reason)
        print(f"[hpcrl] ray node {name}: {reason}", file=sys.stderr, flush=True)
        return 1

    stopping = lambda: "stopped before the head came up" if stop_asked or stop_file.exists() else None  # noqa: E731
    comm = None
    if mpi:
        if not rendezvous.launched_with_pmi():
            return fail("bootstrap is mpi but this task has no PMI: start it with srun --mpi=<plugin>")
        comm = rendezvous.world()
        if comm.rank == 0 and not head:
            return fail(f"MPI rank 0 runs on {name}, not on the head node {cluster['head']['name']}")
    if comm is not None and not head:
        if not rendezvous.share_head_address(comm, None):    # sent once the head is up, "" if it failed
            rendezvous.gather_started(comm, False)           # rank 0 waits for every rank's answer
            rendezvous.finish()
            return fail("the head node failed to start (its log says why)")
    elif not head:
        try:
            wait_for_port(cluster["head"]["addr"], cluster["head"]["ports"]["gcs"],
                          time.monotonic() + cluster["start_timeout_s"], give_up=stopping)
        except (TimeoutError, RuntimeError) as e:
            return fail(f"head GCS {cluster['head']['addr']}:{cluster['head']['ports']['gcs']}: {e}")
    proc, started = start_ray(cmd, env, log_dir / f"{name}.log")
    if comm is not None:
        t0 = time.monotonic()
        while not started.wait(POLL_S) and proc.poll() is None and not stopping():
            pass
        if head:
            rendezvous.share_head_address(comm, cluster["address"] if started.is_set() else "")
        joined = rendezvous.gather_started(comm, started.is_set())    # the readiness barrier, at rank 0
        rendezvous.finish()     # MPI's part is over: no node's exit may wait on another's in MPI_Finalize
        if joined and all(joined):
            atomic_write_text(paths.ray_ready(cluster["run_id"]),
                              f"{len(joined)} nodes after {time.monotonic() - t0:.2f} s (MPI rendezvous)\n")
    try:
        while not stop_asked and not stop_file.exists() and proc.poll() is None:
            time.sleep(POLL_S)
        exited = proc.poll()
    finally:
        kill_session(proc.pid)
        proc.wait()
        if (temp_dir / "session_latest").exists():  # node-local logs -> shared run dir
            shutil.copytree(temp_dir / "session_latest" / "logs", log_dir / name, dirs_exist_ok=True,
                            ignore_dangling_symlinks=True)
        shutil.rmtree(temp_dir, ignore_errors=True)
    if exited is not None:
        return fail(f"`ray start` exited with {exited}; see {log_dir / name}.log")
    return 0
