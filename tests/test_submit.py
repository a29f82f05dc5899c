"""Spec -> live validation -> hetjob on the real local cluster, by sbatch and by submitit."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, job_finished, job_records, queue_ids, wait_until

import hpcrl
from hpcrl.slurm.sbatch import SubmitError

pytestmark = pytest.mark.slurm
TINY = ROOT / "jobs" / "tiny-cpu.yaml"


def spec_file(tmp_path, patch_roles=None, **top):
    data = yaml.safe_load(TINY.read_text())
    data.update(top)
    for role, fields in (patch_roles or {}).items():
        data["roles"][role] = {**data["roles"].get(role, {}), **fields}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def check_components(job_id, expected=("a100", "h100", "cpu")):
    recs = {int(r["HetJobOffset"]): r for r in job_records(job_id)}
    assert [recs[i]["Partition"] for i in range(len(expected))] == list(expected)
    for i, part in enumerate(expected):
        assert recs[i]["JobState"] == "COMPLETED"
        assert recs[i]["NodeList"].startswith({"a100": "a100n", "h100": "h100n", "cpu": "cpun"}[part])
    return recs


def test_sbatch_path_places_each_role_on_its_partition(slurm_cluster, tmp_path):
    ray_only = spec_file(tmp_path, train={})     # no training: the job ends once Ray was up everywhere
    job = hpcrl.submit(hpcrl.load_spec(ray_only, run_dir=tmp_path / "run"), via="sbatch")
    states = job.wait(timeout=600)     # its time in the queue too: other tests' jobs may hold the nodes
    assert states == {0: "COMPLETED", 1: "COMPLETED", 2: "COMPLETED"}
    recs = check_components(job.job_id)
    alloc = json.loads((tmp_path / "run" / "allocation.json").read_text())
    assert alloc["members"] == {"actor_rollout": 0, "critic": 1, "ref": 2, "reward": 2}
    for i, comp in enumerate(alloc["components"]):
        assert [n["name"] for n in comp["nodes"]] == [recs[i]["NodeList"]]
        assert comp["nodes"][0]["addr"].startswith("127.0.0.")
    assert [c["gres"] for c in alloc["components"]] == ["gpu:a100:1", "gpu:h100:1", ""]
    assert [c["cpus_per_node"] for c in alloc["components"]] == [2, 2, 2]
    assert (tmp_path / "run" / "job.sbatch").read_text().count("#SBATCH hetjob") == 2
    assert "component 2 (ref,reward) on cpu" in job.logs()
    status = subprocess.run([sys.executable, "-m", "hpcrl", "status", str(tmp_path / "run")],
                            capture_output=True, text=True).stdout
    assert re.search(rf"component 1 critic +COMPLETED +partition h100 +nodes {recs[1]['NodeList']}\n", status), status
    assert re.search(rf"ray: 127\.0\.0\.\d+:\d+ \(head {recs[0]['NodeList']}\), nodes .*{recs[2]['NodeList']}@127", status), status
    assert "ready: 3 nodes after" in status, status


def where_am_i(x):
    return {"partition": os.environ["SLURM_JOB_PARTITION"], "node": os.environ["SLURMD_NODENAME"],
            "answer": x * 2, "allocation": json.loads(
                (Path(os.environ["HPCRL_RUN_DIR"]) / "allocation.json").read_text())["members"]}


def test_submitit_path_returns_the_function_result(slurm_cluster, tmp_path):
    import cloudpickle

    from hpcrl.slurm.sbatch import HetjobExecutor

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not importable in the job

    spec = hpcrl.load_spec(TINY, run_dir=tmp_path / "run")
    sjob = HetjobExecutor(spec.to_hetjob(python=sys.executable)).submit(where_am_i, 21)
    result = sjob.result()
    assert result["partition"] == "a100" and result["node"].startswith("a100n") and result["answer"] == 42
    assert result["allocation"]["critic"] == 1
    wait_until(lambda: job_finished(sjob.job_id), 60, "Ray teardown after the function returned")
    # mode="force": submitit caches sacct for seconds; our watcher maps the hetjob's N+0 rows to N
    wait_until(lambda: sjob.get_info(mode="force").get("State") == "COMPLETED", 30, "sacct COMPLETED via submitit")
    check_components(sjob.job_id)


def test_a_submitit_job_that_fails_before_its_function_shows_why(slurm_cluster, tmp_path):
    """The function never runs when the job's Ray cluster does not come up; submitit's error then
    shows the batch script's log, not only 'no output/error stream produced'."""
    import submitit

    from hpcrl.slurm.sbatch import HetjobExecutor

    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'this python is broken' >&2\nexit 3\n")
    broken.chmod(0o755)
    job = hpcrl.load_spec(TINY, run_dir=tmp_path / "run").to_hetjob(python=str(broken))
    sjob = HetjobExecutor(job).submit(where_am_i, 21)
    with pytest.raises(submitit.core.utils.UncompletedJobError) as e:
        sjob.result()
    assert "state: FAILED" in str(e.value) and "this python is broken" in str(e.value), str(e.value)


def test_submitit_via_cli(slurm_cluster, tmp_path):
    ray_only = spec_file(tmp_path, train={})     # without training, submitit runs its default function
    out = subprocess.run([sys.executable, "-m", "hpcrl", "submit", str(ray_only), "--via", "submitit", "--wait",
                          "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "result: {'job_id'" in out.stdout and "COMPLETED" in out.stdout


def test_a_run_stopped_before_its_last_step_fails_and_a_cancelled_one_is_cancelled(slurm_cluster, tmp_path):
    """Two GRPO runs side by side, each followed by `hpcrl submit --wait`. One with requeue off gets
    Slurm's USR1 (as before a time limit) after its first step: it stops at a checkpoint, is not
    requeued, and its job ends FAILED, exit 3, saying why. The other gets `hpcrl cancel`: it ends
    CANCELLED. `submit --wait` exits 1 for both (0 only for a completed job), naming the state."""
    from hpcrl.observe.metrics import read_metrics

    runs = {}
    for name, requeue in (("stopped", False), ("cancelled", True)):
        data = yaml.safe_load((ROOT / "jobs" / "tiny-cpu-grpo.yaml").read_text())
        data["requeue"] = requeue
        data["train"]["progress"] = False
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(yaml.safe_dump(data, sort_keys=False))
        runs[name] = (tmp_path / name, subprocess.Popen(
            [sys.executable, "-m", "hpcrl", "submit", str(spec), "--run-dir", str(tmp_path / name), "--wait"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT))
    try:
        for run, _ in runs.values():
            wait_until(lambda: read_metrics(run / "metrics.jsonl"), 400, f"{run.name}'s first step", poll=0.5)
        job = {name: json.loads((run / "job.json").read_text())["job_id"] for name, (run, _) in runs.items()}
        subprocess.run(["scancel", "--batch", "--signal=USR1", job["stopped"]], check=True)
        cancel = subprocess.run([sys.executable, "-m", "hpcrl", "cancel", str(runs["cancelled"][0])],
                                capture_output=True, text=True, cwd=ROOT)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        out = {name: proc.communicate(timeout=300) for name, (_, proc) in runs.items()}
    finally:
        for run, proc in runs.values():
            proc.kill()
            if (run / "job.json").exists():
                subprocess.run(["scancel", json.loads((run / "job.json").read_text())["job_id"]], capture_output=True)
    for name, state in (("stopped", "FAILED"), ("cancelled", "CANCELLED")):
        run, proc = runs[name]
        stdout, stderr = out[name]
        assert proc.returncode == 1, stdout + stderr
        assert f"0:actor_rollout={state}" in stdout, stdout
        assert f"error: job {job[name]} ended {state}, not COMPLETED; {run}/logs/slurm-{job[name]}.out says why" \
            in stderr, stderr
        assert next(r for r in job_records(job[name]) if r["HetJobOffset"] == "0")["JobState"] == state
        assert len(read_metrics(run / "metrics.jsonl")) < 300
    assert {(r["JobState"], r["ExitCode"]) for r in job_records(job["stopped"])} == {("FAILED", "3:0")}
    log = (runs["stopped"][0] / "logs" / f"slurm-{job['stopped']}.out").read_text()
    assert re.search(r"stopped after step \d+ \(SIGUSR1", log), log
    assert ("not requeued: requeue is off in the spec; training stopped before its last step, at its last "
            "checkpoint: the job ends FAILED (exit 3)") in log, log


@pytest.mark.parametrize("patch,top,field", [
    ({"critic": {"partition": "v100"}}, {}, "roles.critic.partition: no partition 'v100'"),
    ({"critic": {"gpu_type": "a100"}}, {}, "roles.critic: gres gpu:a100:1 per node on 1 node(s) is not available"),
    ({"actor_rollout": {"nodes": 4}}, {}, "roles.actor_rollout.nodes: 4 nodes asked"),
    ({"ref": {"time": "05:00:00"}}, {}, "roles.ref.time: 05:00:00 is over partition 'cpu' MaxTime 04:00:00"),
    ({"ref": {"mem": "64G"}}, {}, "roles.ref.mem"),
    ({"critic": {"gpu": 1}}, {}, "roles.critic.gpu: unknown field"),
    ({}, {"requeue": "sometimes"}, "requeue: Input should be a valid boolean"),
    # the cluster's accounting (slurm/cluster: accounts root, rlhf with QoS normal and high, research with normal)
    ({"critic": {"account": "physics"}}, {},
     "roles.critic.account: user root has no account 'physics' here (accounts: research, rlhf, root)"),
    ({"critic": {"qos": "urgent"}}, {}, "roles.critic.qos: no QoS 'urgent' on this cluster (QoS: high, normal)"),
    ({"critic": {"account": "research", "qos": "high"}}, {},
     "roles.critic.qos: QoS 'high' is not allowed for user root under account research (allowed: normal)"),
    ({"critic": {"qos": "high"}}, {}, "under the default account root (set account:) (allowed: normal)"),
    ({"critic": {"constraint": "ib&v100"}}, {},
     "roles.critic.constraint: no node of partition 'h100' has feature 'v100' (its features: h100, ib)"),
    ({"critic": {"sbatch_extra": ["--reservation=maint"]}}, {},
     "roles.critic.sbatch_extra[0]: no reservation 'maint' on this cluster (reservations: none)"),
    # injection: a newline would end Slurm's header and run the rest as shell on the compute node
    ({"critic": {"sbatch_extra": ["--comment=x\ntouch {victim}"]}}, {}, "roles.critic.sbatch_extra[0]: 'x\\ntouch"),
    ({"critic": {"account": "rlhf\ntouch {victim}"}}, {}, "roles.critic.account: "),
    ({}, {"name": "demo\ntouch {victim}"}, "name: "),
])
def test_bad_specs_are_rejected_before_anything_is_submitted(slurm_cluster, tmp_path, patch, top, field):
    victim = tmp_path / "injected"
    fill = lambda v: v.replace("{victim}", str(victim)) if isinstance(v, str) else (  # noqa: E731
        [fill(x) for x in v] if isinstance(v, list) else {k: fill(x) for k, x in v.items()} if isinstance(v, dict) else v)
    name = f"rejected-{tmp_path.name}"[:60]
    path = spec_file(tmp_path, fill(patch), **{"name": name, **fill(top)})
    for cmd in (["validate"], ["submit"], ["submit", "--via", "submitit"]):
        out = subprocess.run([sys.executable, "-m", "hpcrl", *cmd, str(path), "--run-dir", str(tmp_path / "run")],
                             capture_output=True, text=True)
        assert out.returncode == 2, out
        assert field in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    # no job of this name in the queue (other tests' jobs may come and go meanwhile: they run side by side)
    assert subprocess.run(["squeue", "-h", "--name", name, "-o", "%i"], capture_output=True, text=True,
                          check=True).stdout.strip() == ""
    assert not (tmp_path / "run").exists() and not victim.exists()
    # and Slurm's accounting never saw a job of this name
    accounted = subprocess.run(["sacct", "-n", "-X", "-P", "-S", "2000-01-01", "--name", name, "-o", "JobID"],
                               capture_output=True, text=True, check=True).stdout
    assert accounted.strip() == "", accounted


def test_an_allowed_account_and_qos_reach_slurm_as_written(slurm_cluster, tmp_path):
    """The other side of the accounting checks: what they let through, Slurm takes and records."""
    spec = hpcrl.load_spec(spec_file(tmp_path, {"critic": {"account": "rlhf", "qos": "high"},
                                                "actor_rollout": {"sbatch_extra": ["--begin=now+600"]}}),
                           run_dir=tmp_path / "run")
    job = hpcrl.submit(spec)
    try:
        recs = {int(r["HetJobOffset"]): r for r in job_records(job.job_id)}
        assert (recs[1]["Account"], recs[1]["QOS"]) == ("rlhf", "high")
        assert recs[0]["Account"] == "root" and recs[0]["QOS"] == "normal"
    finally:
        subprocess.run(["scancel", job.job_id], check=True)


@pytest.mark.parametrize("text,field", [
    ("name: t\nrun_dir: /tmp/x\nroles:\n  critic: {partition: h100}\n  critic: {partition: a100}\n",
     "duplicate key 'critic'"),
    ("name: t\nroles: [a, b\n", "not valid YAML"),
])
@pytest.mark.cluster_exclusive    # the queue before and after is the same
def test_malformed_files_are_rejected(slurm_cluster, tmp_path, text, field):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    before = queue_ids()
    out = subprocess.run([sys.executable, "-m", "hpcrl", "submit", str(path)], capture_output=True, text=True)
    assert out.returncode == 2 and field in out.stderr
    assert queue_ids() == before


def test_run_dir_is_never_reused_silently(slurm_cluster, tmp_path):
    spec = hpcrl.load_spec(spec_file(tmp_path, {"actor_rollout": {"sbatch_extra": ["--begin=now+600"]}}),
                           run_dir=tmp_path / "run")
    pending = hpcrl.submit(spec)
    try:
        assert set(pending.state().values()) == {"PENDING"}
        with pytest.raises(SubmitError, match=f"still .*PENDING.*scancel {pending.job_id}"):
            hpcrl.submit(spec, resume=True)
    finally:
        pending.cancel()
    pending.wait(timeout=30)
    (tmp_path / "run" / "ckpt").mkdir()
    (tmp_path / "run" / "ckpt" / "keep").write_text("precious")
    with pytest.raises(SubmitError, match="pass --resume"):
        hpcrl.submit(spec)
    shutil.rmtree(tmp_path / "run" / "logs")
    again = hpcrl.submit(spec, resume=True)
    again.cancel()
    assert (tmp_path / "run" / "ckpt" / "keep").read_text() == "precious"


@pytest.mark.slurm
def test_the_python_api_takes_the_options_of_the_command(slurm_cluster, tmp_path):
    """hpcrl.submit(PATH, overrides=..., run_dir=..., dry_run=True) gives what `hpcrl submit PATH
    PATH=VALUE --run-dir R --dry-run` prints, for either path; an option it does not have fails at
    the call, by name."""
    spec, run = str(ROOT / "jobs" / "tiny-cpu.yaml"), tmp_path / "run"
    cli = subprocess.run([sys.executable, "-m", "hpcrl", "submit", spec, "roles.critic.nodes=2", "--run-dir", str(run),
                          "--dry-run"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert str(run) in cli and "#SBATCH --nodes=2" in cli
    for via in ("sbatch", "submitit"):
        assert hpcrl.submit(spec, via=via, overrides=["roles.critic.nodes=2"], run_dir=run, dry_run=True) == cli
    assert hpcrl.submit(hpcrl.load_spec(spec), overrides={"roles.critic.nodes": 2}, run_dir=run, dry_run=True) == cli
    assert not run.exists()
    with pytest.raises(TypeError, match="rundir"):
        hpcrl.submit(spec, rundir=run)
