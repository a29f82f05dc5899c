"""The one way to start the driver, whoever starts it: the batch script (`python -m hpcrl.launch
RUN_DIR`, once the job's Ray cluster is up), submitit (hpcrl/launch/submitit.py), `hpcrl run --local`
and the tests (`python -m hpcrl.launch RUN_DIR --local`).

Every way reads RUN_DIR/spec.yaml (written at submission, or by `hpcrl run`), joins a Ray cluster
whose nodes carry the spec's roles (the job's own, or one local node carrying them all), and runs
the built-in PPO driver (hpcrl/ppo/loop.py), or the spec's own `driver:`, until it finishes or
stops at a committed checkpoint.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hpcrl.files import StorageError
from hpcrl.raycluster.session import ClusterNotReady
from hpcrl.ppo.config import TrainConfig
from hpcrl.jobspec import SpecError, load_spec
from hpcrl.env_vars import EXIT_REQUEUE, JobEnv
from hpcrl.run_dir import RunDir, log_stamp
from hpcrl.stop import StopRequest


def run(run_dir: str | Path, stop: StopRequest | None = None, local: bool = False,
        num_cpus: int | None = None) -> tuple[list[dict], str | None]:
    """Train the run's spec; returns (the metrics records of this start, why it stopped early or None)."""
    import ray

    from hpcrl.importing import import_object
    from hpcrl.raycluster import start_local, wait_ready

    # the training loop's imports (torch, the roles': 2.3 CPU-s; 3.8 s on a GPU node) while Ray
    # starts, which mostly waits on its daemons: a local one here, or a job's nodes (the batch script
    # starts its driver beside them)
    imports = ThreadPoolExecutor(1, thread_name_prefix="hpcrl-imports")
    loop = imports.submit(importlib.import_module, "hpcrl.ppo.loop")
    imports.shutdown(wait=False)
    imported = time.time()

    paths = RunDir(Path(run_dir).resolve())
    spec = load_spec(paths.spec, run_dir=paths.root)
    if not spec.train:
        raise SpecError(["train: empty; there is nothing to run (the docs' reference/spec.md lists the settings)"],
                        str(paths.spec))
    own = {r: (role.worker, role.worker_args) for r, role in spec.roles.items() if role.worker}
    driver = import_object(spec.driver) if spec.driver else None
    if local:
        start_local(list(spec.roles), run_dir=paths.root, num_cpus=num_cpus)
    else:
        waited = wait_ready(paths.root, stay_connected=True)     # every node joined: the job's barrier
        print(f"{log_stamp()} ray: all nodes joined after {waited:.2f} s", flush=True)
        _ask_for_satellites(paths)
    train = loop.result().train
    try:
        return train(spec.train, paths.root, stop=stop or StopRequest(cancel_file=paths.cancel),
                     metrics=spec.metrics.model_dump(), own=own, driver=driver, began=began(paths, local, imported))
    finally:
        ray.shutdown()


def began(paths: RunDir, local: bool, imported: float) -> tuple[float, str, list[tuple[str, float]]]:
    """When this start of the run began, since what, and its phases up to the driver's roles
    (hpcrl/observe/startup.py): a local run's since its driver's process started (driver: its
    imports, until `imported`; then ray); a job's first start since its submission (queued until its
    allocation, ray, driver); a requeued start since the start before it ended, its last event
    (requeued, ray, driver)."""
    from hpcrl.controller.startup import process_started
    from hpcrl.observe.status import read_events
    from hpcrl.raycluster.session import read_cluster

    if local:
        return process_started(), "the driver's start", [("driver", imported), ("ray", time.time())]
    job = json.loads(paths.job.read_text()) if paths.job.exists() else {}
    last = read_events(paths.root)[-1:]
    if last and last[0]["time"] > job.get("submitted_at", 0):
        since, first, began_at = "the start before it ended", "requeued", last[0]["time"]
    elif "submitted_at" in job:
        since, first, began_at = "the submission", "queued", job["submitted_at"]
    else:
        return process_started(), "the driver's start", [("driver", time.time())]
    phases = []
    if paths.allocation.exists():
        phases.append((first, paths.allocation.stat().st_mtime))    # the batch shell writes it first
    with contextlib.suppress(OSError, ValueError, KeyError):
        phases.append(("ray", paths.ray_ready(read_cluster(paths.root)["run_id"]).stat().st_mtime))
    return began_at, since, [*phases, ("driver", time.time())]


def _ask_for_satellites(paths: RunDir) -> None:
    """The satellites `hpcrl scale` asked for, submitted again for this start of the job (the last
    start's ended with it); a failure is said, and the run goes on with the nodes it has."""
    if not paths.satellites.exists():
        return
    from hpcrl.launch.scale import reconcile
    from hpcrl.slurm.cluster_info import SlurmCommandError
    from hpcrl.slurm.sbatch import SubmitError

    def say(text: str) -> None:
        print(f"{log_stamp()} {text}", flush=True)
    try:
        reconcile(paths.root, say)
    except (SlurmCommandError, SubmitError, SpecError) as e:
        say(f"the satellites of hpcrl scale were not all asked for again (those submitted before it are in "
            f"{paths.satellites.name} and train): {e}")


def write_local_spec(run_dir: str | Path, train: dict | TrainConfig, name: str = "local") -> Path:
    """RUN_DIR/spec.yaml for a run of these training settings on one local Ray node (`python -m
    hpcrl.launch RUN_DIR --local`): the roles they need, colocated ones in one component."""
    from hpcrl.slurm.sbatch import write_spec

    cfg = train if isinstance(train, TrainConfig) else TrainConfig.parse(train)
    roles: dict[str, dict] = {}
    for group in cfg.layout.colocate:
        roles[group[0]] = {"partition": "local"}
        roles.update({r: {"same_nodes_as": group[0]} for r in group[1:]})
    for role in cfg.roles():
        roles.setdefault(role, {"partition": "local"})
    paths = RunDir(Path(run_dir).resolve())
    write_spec(paths.root, {"name": name, "run_dir": str(paths.root), "roles": roles, "train": cfg.model_dump(mode="json", exclude_unset=True)})
    return paths.spec


def main(argv: list[str] | None = None) -> int:
    """Exits 0 when training is done, EXIT_REQUEUE (3) when it stopped at a checkpoint to run again."""
    from hpcrl.observe.metrics import read_metrics, reward_table

    ap = argparse.ArgumentParser(prog="python -m hpcrl.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="the run directory (its spec.yaml says what to run)")
    ap.add_argument("--local", action="store_true", help="a fresh one-node Ray here, instead of the job's cluster")
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs the local Ray may use (default: all)")
    args = ap.parse_args(argv)
    paths = RunDir(args.run_dir)
    stop = StopRequest(JobEnv.read().deadline, paths.stop, paths.cancel)
    stop.install()
    try:
        _, reason = run(paths.root, stop, local=args.local, num_cpus=args.num_cpus)
    except (StorageError, ClusterNotReady) as e:
        print(f"{log_stamp()} error: {e}", file=sys.stderr, flush=True)
        return 1
    if reason:
        return EXIT_REQUEUE
    print(f"metrics: {paths.metrics}\n{reward_table(read_metrics(paths.metrics))}", flush=True)
    return 0
