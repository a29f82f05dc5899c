"""Stopping at a checkpoint and resuming, compared bitwise with uninterrupted runs: locally with a
real SIGUSR1, and on the local Slurm cluster with real preemption and a real time limit."""
import json
import random
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest
import yaml
from conftest import (CLUSTER_TURNS, PIPELINED_STEPS, ROOT, UNINTERRUPTED, comparable, in_container, in_image,
                      job_finished, job_records, kill_dead, plot_pixels_seen_by_chromium, preempt_and_finish, sh,
                      short_spec, slurm_log, start_local_training, submit, wait_until)

from hpcrl.observe.metrics import read_metrics
from hpcrl.ppo.config import TrainConfig


def final_state(run, step, roles=("actor_rollout", "critic")) -> dict:
    """Every dataset of the trained roles' files at `step`, as numpy arrays."""
    out = {}
    for role in roles:
        with h5py.File(run / "ckpt" / f"step_{step:08d}" / f"{role}.h5") as f:
            f.visititems(lambda name, obj: out.__setitem__(f"{role}/{name}", obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def assert_same_training(a, b, steps, roles=("actor_rollout", "critic"), metrics=True):
    sa, sb = final_state(a, steps, roles), final_state(b, steps, roles)
    assert sa.keys() == sb.keys()
    differ = [k for k in sa if not (sa[k].dtype == sb[k].dtype and np.array_equal(bits(sa[k]), bits(sb[k])))]
    assert not differ, f"{len(differ)} datasets differ, e.g. {differ[:3]}"
    if metrics:
        assert comparable(read_metrics(a / "metrics.jsonl")) == comparable(read_metrics(b / "metrics.jsonl"))


def test_local_stop_and_resume_is_bitwise_lossless(uninterrupted, tmp_path):
    once, _ = uninterrupted          # the reference (conftest), shared with tests/test_restart.py
    cfg, steps = UNINTERRUPTED, UNINTERRUPTED.total_steps      # no periodic checkpoint: the stop commits its own
    proc = start_local_training(tmp_path / "twice", cfg)
    stop_after = random.Random().randint(2, steps - 4)
    wait_until(lambda: len(read_metrics(tmp_path / "twice" / "metrics.jsonl")) >= stop_after, 300, "steps")
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=300) == 3, stop_after    # stopped at a committed checkpoint, asks to run again
    ckpt = tmp_path / "twice" / "ckpt"
    stopped = json.loads((ckpt / (ckpt / "LATEST").read_text().strip() / "MANIFEST.json").read_text())["step"]
    assert stop_after <= stopped < steps, (stop_after, stopped)
    assert start_local_training(tmp_path / "twice", cfg).wait(timeout=600) == 0
    assert_same_training(once, tmp_path / "twice", steps)


@pytest.mark.parametrize("rc,requeue,restarts,cancelled,status,slurm,said", [
    (0, True, 0, False, 0, [], None),                                      # trained to the last step
    # no component requeued by Slurm (a node failure: tests/test_node_loss.py): the driver's own error
    (1, True, 0, False, 1, [("scontrol", "show", "job", "-o", "77")],
     "the driver exited with 1 (its error is above): training did not finish; the job ends FAILED"),
    (3, False, 0, False, 3, [], "not requeued: requeue is off in the spec; training stopped before its last "
                                "step, at its last checkpoint: the job ends FAILED (exit 3)"),
    (3, True, 2, False, 3, [], "not requeued: restart count 2 has reached max_restarts 2; training stopped "
                               "before its last step"),
    (3, True, 1, False, 0, [("scontrol", "requeue", "77")],
     "requeueing job 77 after a checkpoint (restart 2 of at most 2)"),
    (3, False, 2, True, 0, [("scancel", "77")], "not requeued: hpcrl cancel asked"),
])
def test_the_batch_script_fails_the_job_only_when_training_stopped_early_and_goes_no_further(
        tmp_path, monkeypatch, capsys, rc, requeue, restarts, cancelled, status, slurm, said):
    """The requeue step's exit status is the batch script's, so the job's state: FAILED where training
    stopped before its last step and the job neither requeues nor was cancelled (then it cancels itself)."""
    from hpcrl.run_dir import RunDir
    from hpcrl.slurm import requeue as step

    calls = []
    monkeypatch.setattr(step, "slurm_cmd", lambda *args: calls.append(args) or "")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restarts))
    monkeypatch.setenv("HPCRL_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("HPCRL_REQUEUE", "1" if requeue else "0")
    monkeypatch.setenv("HPCRL_MAX_RESTARTS", "2")
    if cancelled:
        RunDir(tmp_path).cancel.touch()
    assert step.after(rc) == status
    assert calls == slurm
    out = capsys.readouterr().out
    assert said in out if said else out == "", out


def time_limited_spec(tmp_path, max_restarts, minutes=2, lead=90):
    """A few minutes per run, Slurm's signal `lead` seconds before the end, more steps than fit."""
    spec = short_spec(tmp_path, f"limited-{minutes}", max_restarts=max_restarts, signal_lead=lead)
    data = yaml.safe_load(spec.read_text())
    data["train"]["total_steps"] = 1000
    for role in data["roles"].values():
        if "time" in role:
            role["time"] = f"00:{minutes:02d}:00"
    spec.write_text(yaml.safe_dump(data))
    return spec


def status(run) -> dict:
    out = subprocess.run([sys.executable, "-m", "hpcrl", "status", str(run), "--json"], capture_output=True,
                         text=True, cwd=ROOT, check=True)
    return json.loads(out.stdout)


@pytest.mark.slurm
@pytest.mark.cluster_exclusive    # an urgent job preempts its node
def test_preempted_pipelined_hetjob_resumes_bitwise_lossless(slurm_cluster, tmp_path, image, pipelined_once):
    """jobs/tiny-cpu-pipelined.yaml, on the host; then with the actor's and the reference's
    components in slurm/image's Charliecloud image (the rollout, whose node runs the driver, and the
    critic on the host), preempted: the checkpoint taken on the signal holds the batch the rollout
    had generated ahead (with the weights before the checkpoint's), the job requeues, and the
    resumed run trains on it in its containers, ending bitwise as the run on the host did."""
    # 80 steps of about 0.4 s: the preemption (status, the urgent job, Slurm's signal: up to ~10 s on
    # 2 busy cores) lands well before the end from any step it is started at
    spec = short_spec(tmp_path, "tiny", job="tiny-cpu-pipelined.yaml", steps=PIPELINED_STEPS)
    once, twice = pipelined_once, tmp_path / "twice"
    job = submit(in_image(spec, image, ["actor_rollout", "ref"]), twice)
    at = random.Random().randint(5, 25)
    wait_until(lambda: len(read_metrics(twice / "metrics.jsonl")) >= at, 300, f"{at} steps")
    st = status(twice)   # while it runs, from the login node: no Ray connection
    assert st["run"]["state"] == "running" and st["run"]["step"] >= at - 1, st["run"]
    assert [c["state"] for c in st["components"]] == ["RUNNING"] * 4
    assert all(role["state"] == "alive" for role in st["run"]["roles"].values())
    boxed = {role: in_container(r["ranks"][0]["pid"]) for role, r in st["run"]["roles"].items()}
    assert boxed == {"rollout": False, "actor_rollout": True, "critic": False, "ref": True, "reward": True}, boxed
    stopped_at = preempt_and_finish(twice, job)
    assert f"batches of steps [{stopped_at + 1}] were generated ahead" in slurm_log(twice)
    # each start's node tasks of the two components ran the image's interpreter
    assert slurm_log(twice).count("python /opt/venv/bin/python\n") == 4, slurm_log(twice)
    assert json.loads((twice / "allocation.json").read_text())["restart_count"] >= 1
    assert_same_training(once, twice, PIPELINED_STEPS)
    for run in (once, twice):
        critic = json.loads((run / "ckpt" / "step_00000080" / "MANIFEST.json").read_text())["roles"]["critic"]
        assert critic["writer"] == "parallel HDF5, 2 ranks", critic
    st = status(twice)
    assert st["job"]["restart_count"] >= 1 and st["run"]["state"] == "finished" and st["checkpoint"]["step"] == 80
    # the report of a real requeue: the restart is in the page, and the page renders its plots
    subprocess.run([sys.executable, "-m", "hpcrl", "report", str(twice)], cwd=ROOT, check=True, capture_output=True)
    page = (twice / "report" / "index.html").read_text()
    assert f"1 (resumed at steps {stopped_at})" in page, page
    assert plot_pixels_seen_by_chromium(twice / "report" / "index.html", tmp_path / "shot.png") > 5000


@pytest.fixture(scope="module")
def time_limited_jobs(slurm_cluster, tmp_path_factory):
    """The two tests below wait on time limits, not on work: their jobs are submitted together, the
    first time either test asks, and run side by side (each fits beside the other on the cluster).
    sbatch: 2 min, signal_lead 90, max_restarts 1. submitit: 3 min, its USR2 60 s before the end
    (sent to job steps, so only once the function's step runs), max_restarts 3."""
    tmp = tmp_path_factory.mktemp("limited")
    sbatch_run, submitit_run = tmp / "sbatch", tmp / "submitit"
    with CLUSTER_TURNS.shared():    # the jobs run between the tests: no exclusive test meanwhile
        jobs = {"sbatch": (submit(time_limited_spec(tmp, max_restarts=1), sbatch_run), sbatch_run)}
        subprocess.run([sys.executable, "-m", "hpcrl", "submit", str(time_limited_spec(tmp, max_restarts=3, minutes=3, lead=60)),
                        "--via", "submitit", "--run-dir", str(submitit_run)], check=True, capture_output=True, cwd=ROOT)
        jobs["submitit"] = (json.loads((submitit_run / "job.json").read_text())["job_id"], submitit_run)
        yield jobs
        for job, _ in jobs.values():
            sh("scancel", job, check=False)


@pytest.mark.slurm
def test_time_limit_checkpoints_and_requeues_until_max_restarts(time_limited_jobs):
    """--time 2 min, signal_lead 90, max_restarts 1: the driver stops by its deadline (Slurm's end
    time minus the lead) or Slurm's USR1, the job requeues itself once, resumes, stops again, and
    then says it will not requeue a second time."""
    job, run = time_limited_jobs["sbatch"]
    wait_until(lambda: job_finished(job), 600, "two time-limited runs")
    log = slurm_log(run)
    assert log.count("checkpoint committed") == 2, log
    assert f"requeueing job {job} after a checkpoint (restart 1 of at most 1" in log
    assert "resumed from checkpoint step" in log
    assert "not requeued: restart count 1 has reached max_restarts 1; training stopped before its last step" in log
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1))   # appended once per step: nothing lost, nothing twice
    assert len(steps) < 1000
    # stopped part way and not requeued again: a failed job, with the driver's exit status 3
    assert {(r["JobState"], r["ExitCode"]) for r in job_records(job)} == {("FAILED", "3:0")}, job_records(job)


@pytest.mark.slurm
def test_submitit_path_checkpoints_on_its_signal_and_resumes(time_limited_jobs):
    """--via submitit: submitit's USR2 calls SubmititTraining.checkpoint(), which waits for the
    step's committed checkpoint; submitit requeues; the driver resumes from it. The batch script's
    requeue step (after-submitit, for a hetjob Slurm requeued only in part) leaves that requeue alone."""
    job, run = time_limited_jobs["submitit"]

    def logs():
        return "".join(p.read_text(errors="replace") for p in run.rglob("*_log.*"))

    def story():      # CI once timed out here with nothing to tell why: the job's state and its logs' ends
        return (sh("scontrol", "show", "job", job, check=False) + "\n".join(
            f"== {p}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(run.rglob("*_log.*"))))
    try:
        wait_until(lambda: "resumed from checkpoint step" in logs() or job_finished(job), 420,
                   "the requeued submitit job resuming", story=story)
        assert "resumed from checkpoint step" in logs(), story()
    finally:
        sh("scancel", job)
    assert "(USR2 (submitit)); checkpoint committed" in logs()
    assert "[hpcrl] Slurm requeued components" not in slurm_log(run), slurm_log(run)


def test_a_rebuilt_role_comes_back_from_its_latest_committed_file(tmp_path):
    import ray

    from hpcrl.ppo.loop import build_worker_groups, prepare_inputs, train
    from hpcrl.raycluster.session import start_local

    cfg = TrainConfig(total_steps=4, save_every=2, progress=False)
    start_local(["actor_rollout", "critic", "ref", "reward"], run_dir=tmp_path, num_cpus=2)
    try:
        model_dir, _ = prepare_inputs(cfg, tmp_path)
        groups = build_worker_groups(cfg, model_dir, tmp_path)
        train(cfg, tmp_path, groups)
        critic, actor_pids = groups["critic"], groups["actor_rollout"].pids()
        kill_dead(critic.pids()[0])
        critic.save_checkpoint(str(tmp_path / "after.h5"), 4)     # rebuilt, restored, then saved
        assert groups["actor_rollout"].pids() == actor_pids
    finally:
        ray.shutdown()
    with h5py.File(tmp_path / "after.h5") as a, h5py.File(tmp_path / "ckpt" / "step_00000004" / "critic.h5") as b:
        names = []
        a.visit(lambda n: names.append(n) if isinstance(a[n], h5py.Dataset) and n.startswith("role/") else None)
        assert names and all(np.array_equal(bits(a[n][()]), bits(b[n][()])) for n in names)
