"""Elastic roles (hpcrl scale) on the real local cluster: satellite jobs whose Ray nodes join a run
for its reward role, and leave it. A rule reward scores alike on any number of ranks, so a run whose
reward grows and shrinks, is preempted with its satellites and resumed, trains bitwise what the same
run trains without any of it."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, job_finished, sh, slurm_log, submit, wait_until, with_train
from test_raycluster import ray_processes_of
from test_requeue import assert_same_training

from hpcrl.jobspec import load_spec
from hpcrl.launch.entrypoint import write_local_spec
from hpcrl.launch.scale import elastic_problem
from hpcrl.observe.overview import format_status, gather_status
from hpcrl.observe.status import RunStatus, read_events
from hpcrl.ppo.context import RunContext
from hpcrl.raycluster.node import token_problem

ELASTIC = ROOT / "jobs" / "tiny-cpu-elastic.yaml"
STEPS = 24      # about 0.1-0.25 s each: the test holds the steps where nodes come and go (the run takes
                # a step or two between the holds; the rest only costs time)

HELD_SCORER = '''
import os
import time

from hpcrl.ppo.tasks.copy_digits import score as copy_score


def score(prompts, responses, **_):
    """The copy task's rule; while RUN_DIR/hold exists it waits first (the test holds a step there
    while nodes join and leave)."""
    run = os.environ.get("HPCRL_RUN_DIR")      # set in a job's steps; a local run is never held
    hold = run and os.path.join(run, "hold")
    if hold and os.path.exists(hold):
        print("holding", flush=True)
        while os.path.exists(hold):
            time.sleep(0.05)
    return [copy_score(p, r) for p, r in zip(prompts, responses)]
'''


class Hold:
    """While the block runs, every scoring call of the run waits at its start (RUN_DIR/hold);
    `until(n)` returns once ranks 0..n-1 of the reward role are all waiting in one."""

    def __init__(self, run: Path):
        self.run, self.file = run, run / "hold"

    def _counts(self) -> dict[int, int]:
        logs = sorted((self.run / "logs" / "reward").glob("rank*.log"))
        return {int(p.stem.removeprefix("rank")): p.read_text().count("holding") for p in logs}

    def __enter__(self):
        self.file.parent.mkdir(parents=True, exist_ok=True)
        self.before = self._counts()
        self.file.touch()
        return self

    def until(self, ranks: int) -> None:
        wait_until(lambda: all(self._counts().get(k, 0) > self.before.get(k, 0) for k in range(ranks)), 300,
                   f"{ranks} reward rank(s) waiting in a held step")

    def __exit__(self, *_):
        self.file.unlink()


def scale(run: Path, *targets: str) -> str:
    out = subprocess.run([sys.executable, "-m", "hpcrl", "scale", str(run), *targets], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def satellites(run: Path) -> list[dict]:
    return json.loads((run / "satellites.json").read_text())["jobs"]


def said(run: Path, job_id: str, what: str) -> bool:
    log = run / "logs" / f"satellite-{job_id}.out"
    return log.exists() and what in log.read_text()


def joined(run: Path, job_id: str) -> bool:
    return said(run, job_id, "joined run start")


def world_size(run: Path) -> int:
    """The reward role's ranks; 0 while a (resumed) start has not built its roles yet."""
    roles = json.loads((run / "status.json").read_text())["roles"]
    return roles["reward"]["world_size"] if "reward" in roles else 0


def resizes(run: Path) -> list[tuple[int, int]]:
    return [(e["from"], e["to"]) for e in read_events(run) if e["event"] == "resize"]


def elastic_spec(tmp_path: Path, **train) -> Path:
    spec = yaml.safe_load(ELASTIC.read_text())
    with_train(spec, total_steps=STEPS, progress=False, reward_fn="held_scorer:score", **train)
    path = tmp_path / "elastic.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def another_users_satellite(run: Path, run_id: str) -> subprocess.CompletedProcess:
    """The satellite's node task in a process of another user (nobody): Python starts as this user,
    then gives its uid away before it touches the run directory, as a job of that user would be."""
    code = ("import os, sys\nfrom pathlib import Path\nfrom hpcrl.raycluster.node import run_satellite\n"
            "os.setgid(65534); os.setuid(65534)\n"
            f"sys.exit(run_satellite(Path({str(run)!r}), 'reward', {run_id!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def wrong_token_node(run: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """`ray start` of a node for the reward role at the run's address, with a token of its own."""
    cluster = json.loads((run / "ray" / "cluster.json").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64, RAY_USAGE_STATS_ENABLED="0")
    ray = str(Path(sys.executable).with_name("ray"))
    return subprocess.run([ray, "start", f"--address={cluster['address']}", "--node-ip-address=127.0.0.16",
                           '--resources={"role:reward": 1}', "--num-cpus=1", f"--temp-dir={tmp_path / 'intruder'}",
                           "--disable-usage-stats"], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slurm
@pytest.mark.cluster_exclusive    # an urgent job preempts its node
def test_a_rule_reward_grows_shrinks_and_is_requeued_with_its_satellites_training_bitwise_as_without(
        slurm_cluster, tmp_path, monkeypatch):
    """The reward role of jobs/tiny-cpu-elastic.yaml (1 node of its own component): `hpcrl scale
    reward=3` adds two satellites that serve from the next step; another user's satellite and a node
    with a wrong token cannot join; preempted, the job ends its satellites, requeues, and its next
    start asks for them again; `hpcrl scale reward=2` cancels one in the middle of a step and a
    scancel takes the other: the group shrinks each time and the run completes, bitwise the same
    run as one without satellites (run locally meanwhile, its actor on as many threads)."""
    (tmp_path / "held_scorer.py").write_text(HELD_SCORER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))         # the job's, and so its Ray workers' and satellites'
    spec = elastic_spec(tmp_path)
    once, twice = tmp_path / "once", tmp_path / "twice"
    with Hold(twice) as hold:
        job = submit(spec, twice)
        write_local_spec(once, yaml.safe_load(spec.read_text())["train"])
        local = subprocess.Popen([sys.executable, "-m", "hpcrl.launch", str(once), "--local", "--num-cpus", "4"],
                                 cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        hold.until(1)
        out = scale(twice, "reward=3")
        assert "reward: 3 node(s) asked = 1 of its component + 2 satellite job(s)" in out, out
        first = [j["job_id"] for j in satellites(twice)]
        # while they start, nobody else joins: another user's satellite cannot read the run's token,
        # and a node with a wrong token is refused
        run_id = json.loads((twice / "ray" / "cluster.json").read_text())["run_id"]
        other = another_users_satellite(twice, run_id)
        assert other.returncode == 1 and "cannot read the run's Ray token" in other.stderr, other.stdout + other.stderr
        intruder = wrong_token_node(twice, tmp_path)
        assert intruder.returncode != 0, intruder.stdout + intruder.stderr
        wait_until(lambda: all(joined(twice, j) for j in first), 180, "two satellites joined")
    wait_until(lambda: resizes(twice) == [(1, 3)], 120, "the reward role on three ranks")
    grown = next(e for e in read_events(twice) if e["event"] == "resize")      # the two satellites, nobody else
    assert [n.split(" (")[1] for n in grown["nodes"]] == ["component 1)"] + [f"satellite {j})" for j in first], grown

    # preempted: its satellites end with it, the next start asks for two more, which join it
    node = json.loads((twice / "allocation.json").read_text())["components"][0]["nodes"][0]["name"]
    sh("sbatch", "--parsable", "-p", "urgent", "-w", node, "--exclusive", "-o", "/dev/null", "--wrap", "sleep 1")
    wait_until(lambda: "stopped after step" in slurm_log(twice), 300, "the preempted start's last checkpoint")
    with Hold(twice) as hold:
        wait_until(lambda: "resumed from checkpoint step" in slurm_log(twice), 300, "the job requeued and resumed")
        wait_until(lambda: not (set(first) & set(sh("squeue", "-h", "-o", "%i").split())), 60, "first satellites gone")
        second = wait_until(lambda: [j["job_id"] for j in satellites(twice) if j["job_id"] not in first] or None, 120,
                            "satellites asked for again")
        assert len(second) == 2 and "submitted" in slurm_log(twice)
        wait_until(lambda: all(joined(twice, j) for j in second), 180, "the new satellites joined")
    wait_until(lambda: world_size(twice) == 3, 120, "three reward ranks again")

    # one satellite cancelled by hpcrl scale in the middle of a step, the other by scancel: each
    # leaves while its rank is in a held call, which the group then makes again without it
    with Hold(twice) as hold:
        hold.until(3)
        scale(twice, "reward=2")
        gone = next(j for j in second if j not in [s["job_id"] for s in satellites(twice)])
        wait_until(lambda: said(twice, gone, "left the run"), 60, f"satellite {gone} gone")
    wait_until(lambda: world_size(twice) == 2, 120, "two reward ranks")
    with Hold(twice) as hold:
        hold.until(2)
        last = satellites(twice)[0]["job_id"]
        sh("scancel", last)
        wait_until(lambda: said(twice, last, "left the run"), 60, f"satellite {last} gone")
    wait_until(lambda: world_size(twice) == 1, 120, "the component's rank alone")

    wait_until(lambda: job_finished(job), 600, "the scaled run to finish")
    assert local.wait(timeout=600) == 0
    assert_same_training(once, twice, STEPS, roles=("actor_rollout",))
    left = [e for e in read_events(twice) if e["event"] == "resize" and e["to"] < e["from"]]
    assert [(e["from"], e["to"]) for e in left] == [(3, 2), (2, 1)], left
    assert all(re.fullmatch(r"satellite \d+ left \(cpun\d\) during compute_scores", e["why"]) for e in left), left
    assert all((twice / "logs" / "reward" / f"rank{k}.calls.jsonl").exists() for k in (1, 2))
    # nothing of the satellites is left: no job, no Ray process
    everyone = first + second
    assert not set(everyone) & set(sh("squeue", "-h", "-o", "%i").split())
    wait_until(lambda: not any(ray_processes_of(j) for j in everyone), 30, "no Ray process of a satellite")
    status = subprocess.run([sys.executable, "-m", "hpcrl", "status", str(twice)], capture_output=True, text=True,
                            cwd=ROOT, check=True).stdout
    # the last target stands (a scancel is no `hpcrl scale`): the next start would ask for it again
    assert "satellites (hpcrl scale): reward 2 node(s) asked" in status, status
    assert re.search(rf"job {second[0]} +reward +ended", status) and "PENDING" not in status, status
    # each satellite's join is said once: at the step boundary after it, or as the resumed start's
    # resize where it joined before the group was built (which of the two is up to timing)
    joins = [j for e in read_events(twice) if e["event"] == "resize"
             for j in re.findall(r"satellite (\d+) joined", e["why"])]
    assert sorted(joins) == sorted(map(str, everyone)), joins
    assert all(f"satellite {j} joined" in status for j in everyone) and "reward 3 -> 2 ranks" in status, status


def test_which_roles_scale_and_the_token_a_satellite_accepts(tmp_path):
    """Only roles whose workers hold no trained state scale; the token must be the user's own, 0600."""
    spec = yaml.safe_load((ROOT / "jobs" / "tiny-cpu.yaml").read_text())
    spec["train"]["layout"] = {"colocate": [["ref", "reward"]]}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    loaded = load_spec(path, run_dir=tmp_path / "run")
    assert "its ranks train together" in elastic_problem(loaded, "critic")
    assert "its ranks train together" in elastic_problem(loaded, "actor_rollout")
    assert "shares its processes" in elastic_problem(loaded, "reward")
    assert "no role 'judge'" in elastic_problem(loaded, "judge")
    assert elastic_problem(load_spec(ELASTIC, run_dir=tmp_path / "e"), "reward") is None
    token = tmp_path / "token"
    token.write_text("x" * 64)
    token.chmod(0o600)
    assert token_problem(token) is None
    token.chmod(0o640)
    assert "readable by others (mode 640" in token_problem(token)
    token.chmod(0o600)
    os.chown(token, 65534, 65534)
    assert "belongs to uid 65534" in token_problem(token)
    assert "cannot read the run's Ray token" in token_problem(tmp_path / "missing")


def test_satellites_that_joined_before_a_role_started_are_said_as_its_resize(tmp_path, capsys):
    """A start may find its satellites joined before the elastic group was built (the test above
    cannot choose which happens): the group starts with their ranks, and events and log say so
    as the resize it would have been a step later. The groups stand in for WorkerGroup.describe()."""
    class Group:
        def __init__(self, elastic, origins):
            self.elastic, self.origins = elastic, origins

        def describe(self):
            return {"ranks": [{"origin": o, "node": n} for o, n in self.origins]}

    ctx = object.__new__(RunContext)
    ctx.status = RunStatus(tmp_path, 60)
    ctx.groups = {"actor_rollout": Group(False, [("component 0", "a100n1")]),
                  "ref": Group(True, [("component 1", "cpun1")]),
                  "reward": Group(True, [("component 1", "cpun1"), ("satellite 10", "cpun1"),
                                         ("satellite 10", "cpun1"), ("satellite 11", "cpun2")])}
    ctx._satellites_at_start(2)
    [event] = [e for e in read_events(tmp_path) if e["event"] == "resize"]
    assert {k: event[k] for k in ("role", "step", "from", "to", "nodes")} == {
        "role": "reward", "step": 2, "from": 1, "to": 4,
        "nodes": ["cpun1 (component 1)", "cpun1 (satellite 10)", "cpun2 (satellite 11)"]}
    assert event["why"] == ("satellite 10 joined (cpun1) before the role started; "
                            "satellite 11 joined (cpun2) before the role started")
    assert "role reward: satellite 10 joined (cpun1) before the role started; " in capsys.readouterr().out
    assert "resize at step 2: reward 1 -> 4 ranks" in format_status(gather_status(tmp_path))
