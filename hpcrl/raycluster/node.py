"""One Ray node, run as the one task of a Slurm step on its node, until the job says stop: a node of
the job's own components (`run_node`), or a satellite's (`run_satellite`: a job of its own that
joins the run for one role, hpcrl scale).

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
import tempfile
import threading
import time
from pathlib import Path

from hpcrl.files import atomic_write_text
from hpcrl.raycluster.ports import PortBlock, choose_block
from hpcrl.run_dir import RunDir, log_stamp
from hpcrl.slurm.allocation import node_name

POLL_S = 0.1
# Ray's longest socket path is FOLDER/ray/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store, and a Unix
# socket's path holds at most 107 bytes: what is left for FOLDER (ray_temp_dir)
RAY_TEMP_ROOM = 107 - len("/ray/session_2025-01-01_00-00-00_000000_4194304/sockets/plasma_store")


def ray_env(run_dir: Path) -> dict[str, str]:
    """What every Ray process of the job (nodes and drivers) needs: token auth, no usage stats, and
    Python versions matched to the minor one (a component's image may have 3.11.2 where the host has
    3.11.7; Ray's default asks for the same patch release)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(RunDir(run_dir).ray_token),
            "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL": "minor"}


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
    """`hpcrl.component` for a node of the job's own components, `hpcrl.satellite` (its job id) for a
    satellite's; every node carries the job and run it serves and its roles."""
    origin = {"hpcrl.satellite": me["satellite"]} if me.get("satellite") else {"hpcrl.component": str(me["component"])}
    labels = {"hpcrl.jobspec": cluster["job_id"], "hpcrl.run": cluster["run_id"], "hpcrl.node": me["name"], **origin,
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


def ray_temp_dir(prefix: str) -> Path:
    """A fresh folder for one node's Ray, made as mkdtemp makes one: 0700, a random name, never a
    folder or link someone else put there first (a shared /tmp). Ray's own --temp-dir is its `ray`
    folder: Ray opens the folders it makes to everyone (0777, for users sharing a machine's Ray),
    which this one keeps closed. In $TMPDIR, or in /tmp where $TMPDIR is too long a path for Ray's
    sockets (RAY_TEMP_ROOM)."""
    base = os.environ.get("TMPDIR") or "/tmp"
    if len(os.path.join(base, prefix)) + 8 > RAY_TEMP_ROOM:      # mkdtemp adds 8 characters
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def copy_logs(logs: Path, to: Path) -> None:
    """A node's Ray logs (node-local) into the run directory, each file as a new one of this job (the
    umask's mode, not the 0777 of Ray's folders); a link whose target is gone is left out."""
    for f in logs.rglob("*"):
        if f.is_file():
            (to / f.relative_to(logs)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, to / f.relative_to(logs))


def keep_logs_and_remove(temp_dir: Path, logs_to: Path) -> None:
    """Once its Ray has stopped: the logs of its last session into `logs_to`, then ray_temp_dir's folder gone."""
    copy_logs(temp_dir / "ray" / "session_latest" / "logs", logs_to)
    shutil.rmtree(temp_dir, ignore_errors=True)


class _NodeTask:
    """What a node task of either kind shares: its run directory, node name, log and temp dirs, the
    `ray start` command, and the stop it waits for (its run start's stop file, or a signal)."""

    def __init__(self, run_dir: Path, cluster: dict, me: dict, log_name: str, temp_prefix: str):
        self.paths, self.cluster, self.me = RunDir(run_dir), cluster, me
        self.stop_file = self.paths.ray_stop(cluster["run_id"])
        self.log_dir = self.paths.ray_logs
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_name = log_name
        self.temp_prefix, self.temp_dir = temp_prefix, None      # made as Ray starts (ray_temp_dir)
        self.stop_asked: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda s, f: self.stop_asked.append(s))
        # USR1/USR2 are the job's checkpoint signals: they are for the driver, not for Ray
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)

    def wait_started(self, proc: subprocess.Popen, started: threading.Event) -> None:
        """Until `ray start` says it is up, exits, or a stop comes; at most the cluster's start_timeout_s,
        after which it is stopped (and exits: `serve` then says so, with its log)."""
        deadline = time.monotonic() + self.cluster["start_timeout_s"]
        while not started.wait(POLL_S) and proc.poll() is None and not self.stopping():
            if time.monotonic() > deadline:
                print(f"`ray start` did not come up within {self.cluster['start_timeout_s']:.0f} s; stopping it",
                      file=sys.stderr, flush=True)
                proc.terminate()
                return

    def stopping(self) -> str | None:
        return "stopped before the head came up" if self.stop_asked or self.stop_file.exists() else None

    def command(self, base_env: dict, ports: PortBlock, head: bool) -> tuple[list[str], dict]:
        gpus = [g for g in base_env.get("SLURM_STEP_GPUS", "").split(",") if g]
        cpus = int(base_env.get("SLURM_CPUS_ON_NODE", "1"))
        mem_mb = int(base_env.get("SLURM_MEM_PER_NODE", "0") or 0) or 4096
        env = {**base_env, **ray_env(self.paths.root),
               # Slurm sets CUDA_VISIBLE_DEVICES for a step with GPUs (its numbering: 0..n-1 under
               # ConstrainDevices, the node's otherwise, a site's TaskProlog may renumber); a step without
               # GPUs inherits the batch shell's, which belong to component 0
               "CUDA_VISIBLE_DEVICES": base_env.get("CUDA_VISIBLE_DEVICES", "") if gpus else ""}
        me = self.me
        # Ray's command line through this interpreter: where packages are installed with --target (a
        # GPU image's site), the `ray` script is not beside the interpreter, or not on PATH
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", f"--node-ip-address={me['addr']}",
               f"--num-cpus={cpus}", f"--num-gpus={len(gpus)}",
               f"--object-store-memory={max(80, mem_mb * 3 // 10) * 1024 * 1024}",
               f"--resources={node_resources(me['members'])}", f"--labels={node_labels(self.cluster, me)}",
               "--disable-usage-stats", *ports.ray_start_args(head),
               # no driver reads workers' output (each rank logs to its own file): no log monitor
               "--include-log-monitor=false"]
        if head:
            # a Slurm allocation does not autoscale: no autoscaler monitor (as KubeRay's heads)
            cmd += ["--head", "--include-dashboard=false", "--dashboard-host=127.0.0.1", "--no-monitor"]
        else:
            cmd += [f"--address={self.cluster['address']}"]
        return cmd, env

    def wait_for_head(self) -> str | None:
        """Until the head's GCS accepts; why not, or None."""
        head = self.cluster["head"]
        try:
            wait_for_port(head["addr"], head["ports"]["gcs"], time.monotonic() + self.cluster["start_timeout_s"],
                          give_up=self.stopping)
        except (TimeoutError, RuntimeError) as e:
            return f"head GCS {head['addr']}:{head['ports']['gcs']}: {e}"
        return None

    def start(self, cmd: list[str], env: dict) -> tuple[subprocess.Popen, threading.Event]:
        self.temp_dir = ray_temp_dir(self.temp_prefix)
        try:
            return start_ray([*cmd, f"--temp-dir={self.temp_dir / 'ray'}"], env, self.log_dir / f"{self.log_name}.log")
        except BaseException:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            raise

    def serve(self, proc: subprocess.Popen) -> int | None:
        """Until the run start's stop file, a signal, or Ray's own exit; then this node's Ray
        processes end (by session) and its node-local logs move to the run directory. Ray's exit
        status if it exited by itself, else None."""
        try:
            while not self.stop_asked and not self.stop_file.exists() and proc.poll() is None:
                time.sleep(POLL_S)
            exited = proc.poll()
        finally:
            kill_session(proc.pid)
            proc.wait()
            keep_logs_and_remove(self.temp_dir, self.log_dir / self.log_name)
        return exited


def run_node(run_dir: Path) -> int:
    """A node of the job's own components: the head (first node of component 0) or a worker."""
    paths = RunDir(run_dir)
    cluster = json.loads(paths.ray_cluster.read_text())
    name = node_name()
    me = next((n for n in cluster["nodes"] if n["name"] == name), None)
    if me is None:
        raise RuntimeError(f"node {name} is not in {run_dir}/ray/cluster.json")
    head = name == cluster["head"]["name"]
    ports = (PortBlock(cluster["head"]["ports"]["start"]) if head else
             choose_block(cluster["job_id"], me["index"], len(cluster["nodes"])))
    task = _NodeTask(run_dir, cluster, me, name, f"hpcrl-ray-{cluster['job_id']}-")
    print(f"[hpcrl] ray node {name} (component {me['component']}): python {sys.executable}", flush=True)

    mpi = cluster.get("bootstrap") == "mpi"
    if mpi:
        from hpcrl.raycluster import rendezvous
    base = rendezvous.without_pmi(rendezvous.own_component(dict(os.environ), me["component"])) if mpi else dict(os.environ)
    cmd, env = task.command(base, ports, head)

    def fail(reason: str) -> int:
        paths.ray_failed.mkdir(parents=True, exist_ok=True)
        atomic_write_text(paths.ray_failed / name, reason)
        print(f"[hpcrl] ray node {name}: {reason}", file=sys.stderr, flush=True)
        return 1

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
        why = task.wait_for_head()
        if why:
            return fail(why)
    try:
        proc, started = task.start(cmd, env)
    except OSError as e:            # e.g. an interpreter the node cannot execute
        if comm is not None:
            if head:
                rendezvous.share_head_address(comm, "")
            rendezvous.gather_started(comm, False)
            rendezvous.finish()
        return fail(f"cannot start Ray: {e}")
    if comm is not None:
        t0 = time.monotonic()
        task.wait_started(proc, started)
        if head:
            rendezvous.share_head_address(comm, cluster["address"] if started.is_set() else "")
        joined = rendezvous.gather_started(comm, started.is_set())    # the readiness barrier, at rank 0
        rendezvous.finish()     # MPI's part is over: no node's exit may wait on another's in MPI_Finalize
        if joined and all(joined):
            atomic_write_text(paths.ray_ready(cluster["run_id"]),
                              f"{len(joined)} nodes after {time.monotonic() - t0:.2f} s (MPI rendezvous)\n")
    exited = task.serve(proc)
    if exited is not None:
        return fail(f"`ray start` exited with {exited}; see {task.log_dir / name}.log")
    return 0


def token_problem(path: Path) -> str | None:
    """Why a satellite must not use the run's token file: it must be this user's own, readable by
    nobody else (0600), as `prepare` writes it. None: it may."""
    try:
        st = path.stat()
        path.read_bytes()
    except OSError as e:
        return f"cannot read the run's Ray token {path} ({e.strerror}): a satellite joins only the runs of its own user"
    if st.st_uid != os.getuid():
        return f"the run's Ray token {path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & 0o077:
        return f"the run's Ray token {path} is readable by others (mode {st.st_mode & 0o777:o}; it must be 600)"
    return None


def run_satellite(run_dir: Path, role: str, run_id: str) -> int:
    """A satellite's node: one more node for `role` of the run start `run_id`, from a job of its
    own (`hpcrl scale`). It joins that start's Ray cluster with the run's token, ports of its own
    job and the role's labels, serves until that start stops (its stop file: the job ended or was
    requeued) or its own job ends, and never joins another start: one that has ended is left alone."""
    from hpcrl.slurm.allocation import this_job

    paths = RunDir(run_dir)
    name = node_name()

    def say(text: str, rc: int) -> int:
        print(f"{log_stamp()} [hpcrl] satellite {name} of role {role}: {text}",
              file=sys.stderr if rc else sys.stdout, flush=True)
        return rc

    problem = token_problem(paths.ray_token)     # first: another user cannot even read what follows
    if problem:
        return say(problem, 1)
    cluster = json.loads(paths.ray_cluster.read_text())
    if cluster["run_id"] != run_id or paths.ray_stop(run_id).exists():
        return say(f"the run start it was submitted for ({run_id}) has ended; not joining", 0)
    job = this_job()
    me = {"name": name, "addr": job["addr"], "members": [role], "partition": job["partition"],
          "gpu_type": job["gpu_type"], "satellite": job["job_id"]}
    task = _NodeTask(run_dir, cluster, me, f"{name}-satellite-{job['job_id']}", f"hpcrl-ray-{job['job_id']}-")
    cmd, env = task.command(dict(os.environ), choose_block(job["job_id"], 0, 1), head=False)
    why = task.wait_for_head()
    if why:
        return say(why, 1)
    proc, started = task.start(cmd, env)
    task.wait_started(proc, started)
    if started.is_set():
        say(f"joined run start {run_id} at {cluster['address']} as {me['addr']}", 0)
    exited = task.serve(proc)
    if exited is not None:
        return say(f"`ray start` exited with {exited}; see {task.log_dir / task.log_name}.log", 1)
    return say("left the run", 0)
