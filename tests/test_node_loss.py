"""A node lost without a signal: periodic checkpoints by time (`save_every: auto`,
hpcrl/checkpoint/cadence.py: pure logic on a clock the test moves), the batch script making Slurm's
requeue of a hetjob whole (hpcrl/slurm/requeue.py), and on the local Slurm cluster a component's node
taken away mid-run (its processes killed, the node DOWN): the whole hetjob requeued, the run resumed
from its last periodic checkpoint, and trained bitwise as the uninterrupted run."""
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import (PIPELINED_STEPS, ROOT, job_finished, job_records, sh, short_spec, slurm_log, submit, wait_until)
from test_requeue import assert_same_training

from hpcrl.checkpoint.cadence import CEILING, FLOOR, SHARE, CommitCadence
from hpcrl.observe.metrics import read_metrics
from hpcrl.slurm.sbatch import JobHandle, SubmitError, half_requeued


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def steps_until_due(cadence: CommitCadence, clock: Clock, step_s: float) -> int:
    steps = 0
    while not cadence.due(steps):
        clock.now += step_s
        steps += 1
    return steps


def test_auto_commits_by_time_keeping_their_cost_under_its_share():
    clock = Clock()
    cadence = CommitCadence("auto", clock)
    # nothing measured yet: the first FLOOR seconds after the first step (0.3 s steps: 34 of them)
    assert steps_until_due(cadence, clock, 0.3) == 34
    # a commit that held training 2 s: the next 2 / 0.05 = 40 s later, said as a new interval
    assert cadence.took(2.0) == pytest.approx(40.0)
    steps = steps_until_due(cadence, clock, 0.3)
    assert steps == 134 and 2.0 / (2.0 + steps * 0.3) <= SHARE
    # about the same cost again: nothing new to say; twice the cost: a new interval
    assert cadence.took(2.5) is None
    assert cadence.took(5.0) == pytest.approx(100.0)
    # bounds: a cheap commit no more often than FLOOR, a costly one at least every CEILING
    assert cadence.took(0.01) == FLOOR
    assert cadence.took(600.0) == CEILING
    clock.now += CEILING - 0.01
    assert not cadence.due(1)
    clock.now += 0.02
    assert cadence.due(2)


def test_every_n_steps_and_never_take_no_time_into_account():
    clock = Clock()
    every5, never = CommitCadence(5, clock), CommitCadence(0, clock)
    clock.now += 10 * CEILING
    assert [s for s in range(1, 16) if every5.due(s)] == [5, 10, 15]
    assert not any(never.due(s) for s in range(1, 16))
    assert every5.took(100.0) is None


def test_save_every_defaults_to_auto():
    from hpcrl.ppo.config import TrainConfig

    assert TrainConfig().checkpoint.save_every == "auto"
    assert TrainConfig.model_validate({"checkpoint": {"save_every": 7}}).checkpoint.save_every == 7
    assert TrainConfig.parse({"checkpoint": {"save_every": "12"}}).checkpoint.save_every == 12   # an override's text
    with pytest.raises(ValueError, match=r"train.checkpoint.save_every: 'hourly' is neither a number of steps "
                                         r"\(≥ 0; 0: never\) nor \"auto\""):
        TrainConfig.parse({"checkpoint": {"save_every": "hourly"}})


def records(*components: tuple[str, int]) -> str:
    """`scontrol show job -o` lines of a 3-component hetjob 77 (component ids 77, 78, 79)."""
    return "\n".join(f"JobId={77 + i} HetJobId=77 HetJobOffset={i} JobState={state} Restarts={restarts} "
                     f"Reason=None FailedNode={'h100n1' if i == 1 else '(null)'}"
                     for i, (state, restarts) in enumerate(components)) + "\n"


def slurm_showing(monkeypatch, tmp_path, restarts: int, at_end: str, after_requeue: list | None) -> list[tuple]:
    """The requeue step's Slurm, in job 77's batch script at restart `restarts` (max_restarts 2): `scontrol
    show job` shows at_end, then after_requeue's records once it is asked to requeue; the calls made."""
    from hpcrl.slurm import requeue as step

    calls, shown = [], [at_end]

    def slurm_cmd(*args):
        calls.append(args)
        if args[:2] == ("scontrol", "show"):
            return shown[-1]
        if args[:2] == ("scontrol", "requeue") and after_requeue:
            shown.append(records(*after_requeue))
        return ""
    monkeypatch.setattr(step, "slurm_cmd", slurm_cmd)
    monkeypatch.setattr(step.time, "sleep", lambda s: None)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restarts))
    monkeypatch.setenv("HPCRL_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("HPCRL_REQUEUE", "1")
    monkeypatch.setenv("HPCRL_MAX_RESTARTS", "2")
    return calls


@pytest.mark.parametrize("restarts,cancelled,after_requeue,status,said", [
    # Slurm 22.05 requeued components 0 and 1 (up to the failed node's), left 2 running
    (0, False, [("PENDING", 1), ("PENDING", 1), ("PENDING", 1)], 0,
     "Slurm requeued components 0,1 of job 77 after the failure of node h100n1 (the driver exited with 134: its "
     "error is above); requeueing the whole hetjob (restart 1 of at most 2)"),
    (2, False, None, 134, "not requeued: restart count 2 has reached max_restarts 2: the whole hetjob is cancelled"),
    (0, True, None, 134, "not requeued: hpcrl cancel asked: the whole hetjob is cancelled"),
    # a component that will not requeue: cancelled, never left half-pending
    (0, False, [("PENDING", 1), ("PENDING", 1), ("RUNNING", 0)], 134,
     "not requeued: components 2 refused to requeue: the whole hetjob is cancelled"),
])
def test_a_node_failure_requeues_every_component_or_cancels_them_all(
        tmp_path, monkeypatch, capsys, restarts, cancelled, after_requeue, status, said):
    from hpcrl.run_dir import RunDir
    from hpcrl.slurm import requeue as step

    at_failure = records(("PENDING", restarts + 1), ("PENDING", restarts + 1), ("RUNNING", restarts))
    calls = slurm_showing(monkeypatch, tmp_path, restarts, at_failure, after_requeue)
    if cancelled:
        RunDir(tmp_path).cancel.touch()
    assert step.after(134) == status
    out = capsys.readouterr().out
    assert said in out, out
    requeued = ("scontrol", "requeue", "77") in calls
    assert requeued == (after_requeue is not None)
    assert (("scancel", "77") in calls) == (status != 0)


@pytest.mark.parametrize("restarts,at_end,rc,status,requeued,cancelled", [
    # Slurm requeued components 0 and 1 for a failed node: the whole hetjob, as for the sbatch path
    (0, [("PENDING", 1), ("PENDING", 1), ("RUNNING", 0)], 1, 0, True, False),
    (2, [("PENDING", 3), ("PENDING", 3), ("RUNNING", 2)], 1, 1, False, True),    # max_restarts 2 reached
    # submitit requeued the whole job itself (its process exits 255 after `scontrol requeue`): left alone
    (2, [("PENDING", 3), ("PENDING", 3), ("PENDING", 3)], 255, 255, False, False),
    # the function failed, nothing requeued: the job ends FAILED
    (0, [("RUNNING", 0), ("RUNNING", 0), ("RUNNING", 0)], 1, 1, False, False),
])
def test_a_submitit_job_is_never_left_half_requeued_and_its_own_requeue_is_left_alone(
        tmp_path, monkeypatch, capsys, restarts, at_end, rc, status, requeued, cancelled):
    """The batch script of --via submitit runs `requeue after-submitit RC` once the function's step ended."""
    from hpcrl.jobspec import parse_spec
    from hpcrl.slurm import requeue as step
    from hpcrl.slurm.sbatch import HetjobExecutor

    job = parse_spec(yaml.safe_load((ROOT / "jobs" / "tiny-cpu.yaml").read_text()),
                     run_dir=tmp_path / "run").to_hetjob(python=sys.executable)
    script = HetjobExecutor(job)._make_submission_file_text("python -m submitit.core._submit x", "u")
    assert script.endswith(' python -m submitit.core._submit x\n# submitit requeues the whole job itself on USR2; '
                           "where Slurm requeued only some components for a failed\n# node (then it never starts "
                           "again), the requeue step requeues every component or cancels them all.\n"
                           f'{sys.executable} -m hpcrl.slurm.requeue after-submitit "$?"\n'), script[-600:]
    calls = slurm_showing(monkeypatch, tmp_path, restarts, records(*at_end), [("PENDING", restarts + 1)] * 3)
    assert step.after_submitit(rc) == status
    assert (("scontrol", "requeue", "77") in calls) == requeued, calls
    assert (("scancel", "77") in calls) == cancelled, calls
    assert ("requeueing the whole hetjob" in capsys.readouterr().out) == requeued


# ------------------------------------------------------------------ on the local Slurm cluster
def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def steps_done(run: Path) -> int:
    return len(read_metrics(run / "metrics.jsonl"))


def node_processes(job_id: str, node: str) -> list[int]:
    """Every process of component job `job_id` on virtual node `node`: its slurmstepd there (the
    one whose tasks have SLURMD_NODENAME=node) and all their descendants."""
    children: dict[int, list[int]] = {}
    cmd: dict[int, str] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
                cmd[int(p.name)] = (p / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(p.name))

    def tree(pid):
        return [pid] + [d for c in children.get(pid, []) for d in tree(c)]

    def on_node(pid):
        try:
            return f"SLURMD_NODENAME={node}\0".encode() in Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return False
    stepds = [pid for pid, c in cmd.items() if c.startswith(f"slurmstepd: [{job_id}.")
              and any(on_node(c) for c in children.get(pid, []))]
    return [d for s in stepds for d in tree(s)]


@pytest.mark.slurm
@pytest.mark.cluster_exclusive    # its node is set DOWN
def test_a_lost_node_requeues_the_whole_hetjob_and_resumes_from_the_last_periodic_checkpoint(
        slurm_cluster, tmp_path, pipelined_once):
    """jobs/tiny-cpu-pipelined.yaml (save_every: auto, its default). After its first periodic
    checkpoint and a few more steps, the node of the reference and reward's component is taken
    away: every process of the job there SIGKILLed, no signal to anyone, and the node set DOWN.
    A one-node component neither first nor last: Slurm 22.05 requeues the components up to it and
    leaves the last one running, to end FAILED with the batch script (the hetjob would then pend
    for good); the batch script requeues it. Every component runs again, once; the run resumes from
    the last checkpoint committed before the loss, at most one interval (plus a step and a commit)
    old, and ends bitwise as the uninterrupted run."""
    seed = random.randrange(1 << 30)
    more = random.Random(seed).randint(0, 8)
    twice = tmp_path / "twice"
    job = submit(short_spec(tmp_path, "tiny", job="tiny-cpu-pipelined.yaml", steps=PIPELINED_STEPS), twice)
    periodic = lambda: [e for e in events(twice) if e["event"] == "checkpoint"]   # noqa: E731
    wait_until(lambda: (twice / "events.jsonl").exists() and periodic(), 300, "the first periodic checkpoint")
    first = periodic()[0]["step"]
    assert first + more < PIPELINED_STEPS - 5, (
        f"the first periodic checkpoint (due {FLOOR:.0f} s after the first step) came at step {first} of "
        f"{PIPELINED_STEPS}: too late to lose a node after it (a machine this fast needs more steps)")
    wait_until(lambda: steps_done(twice) >= first + more, 300, f"{more} more steps")
    alloc = json.loads((twice / "allocation.json").read_text())
    lost = next(c for c in alloc["components"] if "ref" in c["members"])
    assert 0 < lost["index"] < len(alloc["components"]) - 1 and len(lost["nodes"]) == 1, alloc
    node = lost["nodes"][0]["name"]
    victims = node_processes(lost["job_id"], node)
    assert victims, f"no processes of component {lost['job_id']} on {node}"
    killed_at, done = time.time(), steps_done(twice)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sh("scontrol", "update", f"nodename={node}", "state=down", "reason=hpcrl test: node lost")
    try:
        wait_until(lambda: all(int(r["Restarts"]) >= 1 for r in job_records(job)), 120,
                   f"Slurm and the batch script to requeue every component (seed {seed})")
    finally:
        sh("scontrol", "update", f"nodename={node}", "state=resume", check=False)   # back, if not by itself
    wait_until(lambda: job_finished(job), 600, "the requeued run to finish")
    log = slurm_log(twice)
    # the whole hetjob was requeued, once, and came back to finish: every component's record says so
    assert {(r["JobState"], r["Restarts"]) for r in job_records(job)} == {("COMPLETED", "1")}, job_records(job)
    assert "of job " + job + " after the failure of" in log and "requeueing the whole hetjob" in log, log
    # resumed from the last checkpoint committed before the loss: lost at most one interval
    ev = events(twice)
    before = [e for e in ev if e["time"] <= killed_at]
    last = [e for e in before if e["event"] == "checkpoint"][-1]
    starts = [e for e in ev if e["event"] == "start"]
    assert [(s["resumed"], s["step"]) for s in starts] == [(False, 0), (True, last["step"])], (seed, starts)
    assert f"resumed from checkpoint step {last['step']} " in log
    interval = [e for e in before if e["event"] == "checkpoint_interval"][-1]["seconds"]
    assert f"periodic checkpoints every {interval:.0f} s" in log
    times = [r["time"] for r in read_metrics(pipelined_once / "metrics.jsonl")]
    step_s = max(b - a for a, b in zip(times, times[1:]))
    commit_s = max(e["seconds"] for e in ev if e["event"] == "checkpoint")
    assert killed_at - last["time"] <= interval + step_s + commit_s, (seed, killed_at, last, interval, step_s)
    assert last["step"] <= done, (last, done)
    assert_same_training(pipelined_once, twice, PIPELINED_STEPS)
