"""Sweeps, cancel and ls on the real local cluster: `hpcrl sweep` submits one hetjob per combination
(all checked first, --max-running through Slurm dependencies), `hpcrl cancel` ends a running job
after a committed checkpoint and `hpcrl submit --resume` continues it, `hpcrl ls` shows the states."""
import json
import os
import signal
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, job_records, queue_ids, sh, wait_until

from hpcrl.jobspec.overrides import OverrideError, parse_sweep
from hpcrl.launch.sweep import combinations
from hpcrl.observe.metrics import read_metrics

SPEC = str(ROOT / "jobs" / "tiny-cpu-grpo.yaml")


def hpcrl(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], capture_output=True, text=True, cwd=ROOT)


def test_sweep_words_make_axes_and_every_combination():
    fixed, axes = parse_sweep(["train.actor_lr=1e-6,3e-6", "train.seed=1,2,3", "train.total_steps=40",
                               "roles.ref.gres=[gpu:1]", "x.y=[1, 2],[3]"])
    assert fixed == {"train.total_steps": 40, "roles.ref.gres": ["gpu:1"]}
    assert axes["train.actor_lr"] == [("1e-6", 1e-6), ("3e-6", 3e-6)] and axes["x.y"] == [("[1, 2]", [1, 2]), ("[3]", [3])]
    runs = combinations({k: axes[k] for k in ("train.actor_lr", "train.seed")})
    assert [name for name, _ in runs] == [f"actor_lr-{lr}_seed-{s}" for lr in ("1e-6", "3e-6") for s in (1, 2, 3)]
    assert runs[4][1] == {"train.actor_lr": 3e-6, "train.seed": 2}
    with pytest.raises(OverrideError, match="train.seed: given twice"):
        parse_sweep(["train.seed=1,2", "train.seed=3"])


@pytest.mark.slurm
@pytest.mark.cluster_exclusive    # the queue before and after is the same
@pytest.mark.usefixtures("slurm_cluster")
def test_one_bad_combination_submits_nothing(tmp_path):
    before = queue_ids()
    out = hpcrl("sweep", SPEC, "train.seed=1,2", "roles.ref.nodes=1,5", "--run-dir", str(tmp_path / "sw"))
    assert out.returncode == 2, out.stdout + out.stderr
    # the live cluster has two cpu nodes: both combinations with 5 are named, and nothing was submitted
    assert "seed-1_nodes-5: " in out.stderr and "seed-2_nodes-5: " in out.stderr, out.stderr
    assert "seed-1_nodes-1" not in out.stderr and "nothing of the sweep was submitted" in out.stderr
    assert queue_ids() == before and not (tmp_path / "sw").exists()


def test_cancel_stops_a_local_run_at_a_checkpoint_and_it_resumes(tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, "-m", "hpcrl", "run", SPEC, "--local", "--num-cpus", "2", "--run-dir", str(run),
            "train.progress=false"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: read_metrics(run / "metrics.jsonl") or proc.poll() is not None, 300, "the first step")
        out = hpcrl("cancel", str(run), "--timeout", "120")
        assert out.returncode == 0 and "the local run: stopped (after a last checkpoint)" in out.stdout, out.stdout
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    stopped_at = json.loads((run / "status.json").read_text())["step"]
    assert 1 <= stopped_at < 300 and f"checkpoint: step {stopped_at};" in out.stdout, out.stdout
    resumed = hpcrl("run", SPEC, "--local", "--num-cpus", "2", "--run-dir", str(run), "--resume",
                    f"train.total_steps={stopped_at + 2}")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, stopped_at + 3))


def leader_state(job: str) -> str:
    return next(r for r in job_records(job) if r.get("HetJobOffset", "0") == "0")["JobState"]


@pytest.fixture
def sweep_dir(tmp_path, slurm_cluster):
    """The sweep's folder; whatever of it still runs when the test ends is cancelled (a failed
    test must not leave jobs that slow the next ones)."""
    yield tmp_path / "sw"
    for job in (tmp_path / "sw").glob("*/job.json"):
        sh("scancel", json.loads(job.read_text())["job_id"], check=False)


@pytest.mark.slurm
def test_a_sweep_runs_every_combination_and_a_cancelled_run_resumes(sweep_dir):
    out = hpcrl("sweep", SPEC, "train.optim.actor_lr=3e-4,1e-3", "train.seed=1,2", "train.total_steps=12",
                "--max-running", "3", "--run-dir", str(sweep_dir))
    assert out.returncode == 0, out.stdout + out.stderr
    runs = json.loads((sweep_dir / "sweep.json").read_text())["runs"]
    names = ["actor_lr-3e-4_seed-1", "actor_lr-3e-4_seed-2", "actor_lr-1e-3_seed-1", "actor_lr-1e-3_seed-2"]
    assert [r["name"] for r in runs] == names
    jobs = [r["job_id"] for r in runs]
    # at most three at once: the fourth waits for the first to end
    assert [r["after"] for r in runs] == [None, None, None, jobs[0]]
    fourth = job_records(jobs[3])[0]
    assert fourth["JobState"] == "PENDING" and f"afterany:{jobs[0]}" in fourth["Dependency"], fourth
    for run, (lr, seed) in zip(runs, [(3e-4, 1), (3e-4, 2), (1e-3, 1), (1e-3, 2)]):
        train = yaml.safe_load((sweep_dir / run["name"] / "spec.yaml").read_text())["train"]
        assert (train["optim"]["actor_lr"], train["seed"], train["total_steps"]) == (lr, seed, 12)

    # cancel the first once it has trained a step: a last checkpoint, no requeue, state CANCELLED. Its
    # driver is held (SIGSTOP) while the commands start, so that its 12 steps cannot end first
    first = sweep_dir / names[0]
    wait_until(lambda: read_metrics(first / "metrics.jsonl"), 400, "the first run's first step", poll=0.5)
    driver = json.loads((first / "status.json").read_text())["pid"]
    os.kill(driver, signal.SIGSTOP)
    try:
        listing = hpcrl("ls", str(sweep_dir)).stdout
        assert {names[0]: "RUNNING", names[3]: "PENDING"}.items() <= {
            line.split()[0]: line.split()[2] for line in listing.splitlines()[1:]}.items(), listing
        cancelling = subprocess.Popen([sys.executable, "-m", "hpcrl", "cancel", str(first)], cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: (first / "cancel").exists() or cancelling.poll() is not None, 120, "the cancel asked")
    finally:
        os.kill(driver, signal.SIGCONT)
    stdout, stderr = cancelling.communicate(timeout=600)
    out = subprocess.CompletedProcess(cancelling.args, cancelling.returncode, stdout, stderr)
    assert out.returncode == 0, out.stdout + out.stderr
    assert leader_state(jobs[0]) == "CANCELLED"
    stop = [e for e in map(json.loads, (first / "events.jsonl").read_text().splitlines()) if e["event"] == "stop"]
    assert stop and stop[0]["reason"] == "cancelled (hpcrl cancel)", stop
    stopped_at = stop[0]["step"]
    assert 1 <= stopped_at < 12 and f"checkpoint: step {stopped_at};" in out.stdout, out.stdout
    assert hpcrl("ckpt", "verify", str(first), str(stopped_at)).returncode == 0
    log = "".join(p.read_text() for p in (first / "logs").glob("slurm-*.out"))
    assert "not requeued: hpcrl cancel asked" in log and "requeueing job" not in log, log

    # its resubmission continues from that checkpoint while the sweep goes on
    out = hpcrl("submit", str(first / "spec.yaml"), "--resume", "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"resumed from checkpoint step {stopped_at} " in "".join(
        p.read_text() for p in (first / "logs").glob("slurm-*.out"))
    assert [r["step"] for r in read_metrics(first / "metrics.jsonl")] == list(range(1, 13))
    wait_until(lambda: all(leader_state(j) == "COMPLETED" for j in jobs[1:]), 600, "the sweep's other runs", poll=2)
    # the fourth started only once the first had ended (afterany)
    assert job_records(jobs[3])[0]["StartTime"] >= job_records(jobs[0])[0]["EndTime"]

    status = hpcrl("sweep", "status", str(sweep_dir)).stdout
    rows = {line.split()[0]: line.split() for line in status.splitlines()[2:]}
    assert set(rows) == set(names), status
    for name in names:
        assert rows[name][2:5] == ["COMPLETED", "finished", "12/12"], status
    # the report draws the four runs' curves on one page
    out = hpcrl("report", str(sweep_dir))
    assert out.returncode == 0, out.stderr
    page = (sweep_dir / "report" / "index.html").read_text()
    assert all(name in page for name in names) and (sweep_dir / "report" / "reward.png").stat().st_size > 5000
