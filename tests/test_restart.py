"""A role's process killed while the run trains: the rebuilt role takes back its state of the last
step boundary (a snapshot) and the state-changing calls since are made again, so the run ends
bitwise where an uninterrupted one ends. A role whose call hangs (tests/hung_reward.py) takes the
same path once its deadline passes; one that hangs for good stops the run at its last step,
committed. Real processes, real SIGKILLs, a local Ray."""
from __future__ import annotations

import json
import random
import re
import signal
import time

import h5py
import numpy as np
from conftest import ROOT, UNINTERRUPTED, comparable, kill_dead, start_local_training, wait_until

from hpcrl.checkpoint.store import CheckpointStore
from hpcrl.observe.metrics import read_metrics
from hpcrl.observe.overview import format_status, gather_status
from hpcrl.ppo.config import TrainConfig

CFG = UNINTERRUPTED      # every interrupted run here must end bitwise as the `uninterrupted` one (conftest)
STEPS = CFG.total_steps


def role_tensors(path) -> dict[str, np.ndarray]:
    """A role file's tensors (its state; not its attributes, which hold the time it was written)."""
    out = {}
    with h5py.File(path) as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


def test_roles_killed_at_random_moments_end_bitwise_as_an_uninterrupted_run(uninterrupted, tmp_path):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    whole_run, whole = uninterrupted
    cfg = CFG

    run = tmp_path / "killed"
    proc = start_local_training(run, cfg)
    status = run / "status.json"
    wait_until(lambda: status.exists() and json.loads(status.read_text())["step"] >= 1, 300, "the first step")
    kills = []
    while proc.poll() is None and len(kills) < 4:
        now = json.loads(status.read_text())
        role = rng.choice(["actor_rollout", "critic"])
        if now["step"] > STEPS - 3:          # a kill after the roles' last call would rebuild nothing
            break
        if now["roles"][role]["state"] == "alive":
            try:
                kill_dead(now["roles"][role]["ranks"][0]["pid"])
                kills.append((role, now["step"]))
            except ProcessLookupError:       # dead already; the driver has not called it since
                pass
            wait_until(lambda: proc.poll() is not None or
                       json.loads(status.read_text())["roles"][role]["restarts"] == now["roles"][role]["restarts"] + 1
                       and json.loads(status.read_text())["roles"][role]["state"] == "alive", 300, f"{role} rebuilt")
        time.sleep(rng.uniform(0.2, 1.5))
    assert proc.wait(timeout=600) == 0, f"seed {seed}, kills {kills}"
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    rebuilt = [e["role"] for e in events if e["event"] == "rebuilt"]
    assert len(kills) >= 2 and sorted(rebuilt) == sorted(r for r, _ in kills), (seed, kills, rebuilt)
    assert comparable(read_metrics(run / "metrics.jsonl")) == comparable(whole), (seed, kills)
    for role in ("actor_rollout", "critic"):
        a = role_tensors(whole_run / "ckpt" / f"step_{STEPS:08d}" / f"{role}.h5")
        b = role_tensors(run / "ckpt" / f"step_{STEPS:08d}" / f"{role}.h5")
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), (role, seed, kills)


def hang_config(fn: str, **deadlines) -> TrainConfig:
    """CFG with the reward role's score function one of tests/hung_reward.py's (the copy task's score
    until it hangs) and deadlines short enough for a test."""
    return CFG.updated(reward={"fn": f"hung_reward:{fn}"}, deadlines=deadlines)


def test_a_reward_call_that_hangs_once_is_rebuilt_and_the_run_ends_as_an_uninterrupted_one(uninterrupted, tmp_path,
                                                                                                   monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))      # the driver's and the workers' (Ray passes it on)
    monkeypatch.setenv("HANG_FLAG", str(tmp_path / "hung"))
    run = tmp_path / "hangs"
    # and no periodic snapshots, but a replay log bounded to 50 kB: snapshots come when it is full
    cfg = hang_config("hangs_once", floor=5, first=120).updated(checkpoint={"snapshot_every": 0, "replay_limit": 0.05})
    assert start_local_training(run, cfg).wait(timeout=900) == 0
    assert (tmp_path / "hung").exists()
    assert json.loads((run / "status.json").read_text())["last_snapshot"]["step"] > 1
    assert comparable(read_metrics(run / "metrics.jsonl")) == comparable(uninterrupted[1])
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    hangs = [e for e in events if e["event"] == "hang" and e["call"] == "reward.compute_scores"]
    assert hangs and hangs[0]["ranks"] == [0] and hangs[0]["deadline"] >= 5, events
    assert any(e["event"] == "deadline" and e["call"] == "reward.compute_scores" for e in events), events
    assert "in stuck_in_the_reward" in (run / "logs" / "reward" / "rank0.log").read_text()
    shown = format_status(gather_status(run))
    assert "did not answer reward.compute_scores" in shown and "stuck_in_the_reward" in shown, shown


def test_a_reward_call_that_hangs_for_good_stops_the_run_at_its_last_step_committed(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    monkeypatch.setenv("HANG_FLAG", str(tmp_path / "hung"))
    run = tmp_path / "hangs"
    cfg = hang_config("hangs_for_good", calls={"compute_scores": 5}).updated(layout={"restart_limit": 1})
    t0 = time.monotonic()
    assert start_local_training(run, cfg).wait(timeout=900) == 3       # stopped at a checkpoint: requeue
    assert time.monotonic() - t0 < 600
    done = read_metrics(run / "metrics.jsonl")[-1]["step"]
    assert 1 <= done < STEPS and CheckpointStore(run).committed_steps() == [done]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] in ("hang", "rebuild", "rebuilt")] == ["hang", "rebuild", "rebuilt", "hang"]
    stop = events[-1]
    assert stop["event"] == "stop" and stop["step"] == done and re.search(
        r"role reward: ranks \[0\] did not answer reward.compute_scores within its deadline of 5 s.*stopped at step "
        + str(done), stop["reason"]), stop
    assert "in stuck_in_the_reward" in format_status(gather_status(run))

    # the job requeues: its next start resumes there and hangs again at once (HANG_FLAG), now with a long
    # deadline; Slurm's USR1 before the time limit is acted on while the call hangs
    proc = start_local_training(run, hang_config("hangs_for_good", calls={"compute_scores": 3600}))
    status = run / "status.json"
    wait_until(lambda: proc.poll() is not None or json.loads(status.read_text()).get("state") == "running" and
               json.loads(status.read_text())["phase"] == "score", 300, "the resumed run to score its first step")
    time.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=300) == 3 and time.monotonic() - t0 < 120     # not the 3600 s deadline
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "stop" and events[-1]["reason"] == "SIGUSR1" and events[-1]["step"] == done, events[-1]
    assert CheckpointStore(run).committed_steps() == [done]
