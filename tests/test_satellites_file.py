"""RUN_DIR/satellites.json, the bookkeeping alone (no cluster): changes made at once by several
processes or threads (hpcrl scale beside a driver's start) are all kept, and a satellite is recorded
as soon as its sbatch returns. The only stand-in is a fake `sbatch` on PATH where a submission is
needed; test_elastic.py runs the real thing on the local cluster."""
import multiprocessing
import os
import random
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT

from hpcrl.jobspec import load_spec
from hpcrl.launch.scale import satellite_job
from hpcrl.slurm import satellite
from hpcrl.slurm.cluster_info import SlurmCommandError

UPDATES = 25


def add_jobs(run: str, who: str, seed: int, locked: bool, start=None) -> None:
    """UPDATES read-modify-writes of the record, each adding one job named by `who`, with a pause
    between the read and the write (where another writer's change would be lost without the lock)."""
    rng = random.Random(f"{seed}-{who}")
    if start is not None:
        start.wait()
    for k in range(UPDATES):
        if locked:
            with satellite.locked_record(run) as record:
                time.sleep(rng.uniform(0, 0.004))
                record["jobs"].append({"job_id": f"{who}-{k}"})
                satellite.write_record(run, record)
        else:
            record = satellite.read_record(run)
            time.sleep(rng.uniform(0, 0.004))
            record["jobs"].append({"job_id": f"{who}-{k}"})
            satellite.write_record(run, record)


def recorded(run: Path) -> set[str]:
    return {j["job_id"] for j in satellite.read_record(run)["jobs"]}


def race(run: Path, seed: int, locked: bool) -> set[str]:
    fork = multiprocessing.get_context("fork")
    start = fork.Barrier(2)
    procs = [fork.Process(target=add_jobs, args=(str(run), who, seed, locked, start)) for who in ("scale", "start")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0], f"seed {seed}"
    return recorded(run)


def test_two_processes_changing_the_record_at_once_lose_nothing(tmp_path):
    seed = random.randrange(2**32)
    want = {f"{who}-{k}" for who in ("scale", "start") for k in range(UPDATES)}
    (tmp_path / "locked").mkdir()
    assert race(tmp_path / "locked", seed, locked=True) == want, f"seed {seed}"
    # the same race without the lock loses changes: what the lock is for, and that this test can see it
    (tmp_path / "unlocked").mkdir()
    assert race(tmp_path / "unlocked", seed, locked=False) < want, f"seed {seed}"


def test_threads_of_one_process_changing_the_record_at_once_lose_nothing(tmp_path):
    """flock locks an open file, not a process: threads that each open the lock file exclude each other."""
    seed = random.randrange(2**32)
    start = threading.Barrier(3)
    threads = [threading.Thread(target=add_jobs, args=(str(tmp_path), f"t{n}", seed, True, start)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert recorded(tmp_path) == {f"t{n}-{k}" for n in range(3) for k in range(UPDATES)}, f"seed {seed}"


@pytest.fixture
def sbatch_that_fails_the_second_time(tmp_path, monkeypatch):
    """An `sbatch` first on PATH: its first submission gets job 41, the next one fails as Slurm's does
    when a limit is reached."""
    bin_dir, count = tmp_path / "bin", tmp_path / "sbatch-calls"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        "#!/bin/sh\n"
        f'echo x >> "{count}"\n'
        f'[ "$(wc -l < "{count}")" -eq 1 ] && {{ echo 41; exit 0; }}\n'
        'echo "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy" >&2\nexit 1\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return count


def test_a_failed_sbatch_leaves_the_satellites_submitted_before_it_recorded(tmp_path, sbatch_that_fails_the_second_time):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    spec = load_spec(ROOT / "jobs" / "tiny-cpu-elastic.yaml", run_dir=run)
    jobs = [satellite_job(spec, "reward", {}) for _ in range(2)]
    with satellite.locked_record(run) as record:
        record["targets"]["reward"] = {"nodes": 3, "options": {}}
        satellite.write_record(run, record)
        with pytest.raises(SlurmCommandError, match="accounting/QOS policy"):
            satellite.submit_recorded(run, record, jobs, "40", "start-1")
    assert sbatch_that_fails_the_second_time.read_text().count("x") == 2
    saved = satellite.read_record(run)      # what the job's end reads to cancel the run's satellites
    assert [(j["job_id"], j["members"], j["run_id"]) for j in saved["jobs"]] == [("41", "reward", "start-1")]
    assert saved["targets"] == {"reward": {"nodes": 3, "options": {}}}
