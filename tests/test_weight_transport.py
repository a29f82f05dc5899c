"""The actor's weights to a separate rollout role by a collective group (hpcrl/controller/weight_transport.py):
the bucketed broadcast and a rank that never joins, between real processes over real gloo; and
local runs on real Ray whose rollout takes its weights through the gloo group, its rollout and actor
killed and rebuilt, stopped and resumed, that train bitwise as the same run through Ray's object
store (about 2.5 minutes on 2 cores shared with other work)."""
import json
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, comparable, kill_dead, start_local_training, wait_until

from hpcrl.controller.weight_transport import Rendezvous, WeightGroup, WeightGroupError
from hpcrl.observe.event_kinds import EVENTS, EVERY_EVENT
from hpcrl.observe.metrics import read_metrics
from hpcrl.observe.status import read_events
from hpcrl.ppo.config import TrainConfig

TENSORS = {"embed": torch.randn(40, 16), "steps": torch.arange(7), "norm": torch.randn(16) * 3,
           "head": torch.randn(16, 40)}

MEMBER = """
import pickle, sys, time
import torch
from hpcrl.controller.weight_transport import WeightGroup, WeightGroupError
ticket, rank, tensors, out = pickle.load(sys.stdin.buffer)
t0 = time.monotonic()
try:
    group = WeightGroup.join(ticket, rank)
    if rank == 0:       # in bf16, in buckets smaller than one tensor
        group.send(tensors, torch.bfloat16, bucket_bytes=1024)
        got = "sent"
    else:
        got = {k: v.clone() for k, v in group.receive().items()}
except WeightGroupError as e:
    got = str(e)
with open(out, "wb") as f:
    pickle.dump((got, time.monotonic() - t0), f)
"""
"""One member's part: rank 0 sends the tensors, the others receive; (what it got, seconds) to `out`."""


def members(ticket, ranks: list[int], tmp_path) -> dict[int, tuple]:
    """Each rank in a process of its own, all at once; rank -> (what it got, seconds)."""
    procs = {}
    for rank in ranks:
        procs[rank] = subprocess.Popen([sys.executable, "-c", MEMBER], stdin=subprocess.PIPE, cwd=ROOT)
        procs[rank].stdin.write(pickle.dumps((ticket, rank, TENSORS, tmp_path / f"rank{rank}")))
        procs[rank].stdin.close()
    assert all(p.wait(timeout=120) == 0 for p in procs.values())
    return {rank: pickle.loads((tmp_path / f"rank{rank}").read_bytes()) for rank in ranks}


def test_the_weights_reach_every_receiver_bitwise_in_the_sampling_dtype(tmp_path):
    rendezvous = Rendezvous("127.0.0.1")
    ticket = rendezvous.ticket(["actor_rollout rank 0 (a)", "rollout rank 0 (b)", "rollout rank 1 (c)"], "gloo", 60)
    out = members(ticket, [0, 1, 2], tmp_path)
    assert out[0][0] == "sent"
    expected = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in TENSORS.items()}
    for rank in (1, 2):
        got = out[rank][0]
        assert list(got) == list(expected)
        assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items()), rank


def test_a_rank_that_never_joins_fails_the_sync_within_the_timeout_naming_it(tmp_path):
    rendezvous = Rendezvous("127.0.0.1")
    ticket = rendezvous.ticket(["actor_rollout rank 0 (node-a)", "rollout rank 0 (node-b)",
                                "rollout rank 1 (node-c)"], "gloo", 3)
    out = members(ticket, [0, 1], tmp_path)          # rollout rank 1 never comes
    for rank in (0, 1):
        said, seconds = out[rank]
        assert said == ("weight group 1: rollout rank 1 (node-c) did not join within 3 s "
                        "(train.rollout.weight_sync_timeout)"), said
        assert 3 <= seconds < 10


def test_a_member_waiting_for_a_formation_a_newer_one_replaced_gives_up_quietly():
    rendezvous = Rendezvous("127.0.0.1")
    old = rendezvous.ticket(["sender", "receiver"], "gloo", 60)
    rendezvous.ticket(["sender", "receiver"], "gloo", 60)
    t0 = time.monotonic()
    assert WeightGroup.join(old, 0) is None and time.monotonic() - t0 < 5


ROLLOUT_APART = TrainConfig.model_validate({
    "total_steps": 8, "progress": False, "rollout": {"own_role": True, "n_samples": 2},
    "algorithm": {"advantage": "grpo", "kl_coef": 0.0}, "checkpoint": {"save_every": 0}, "layout": {"restart_limit": 10}})
"""GRPO (three roles to start: actor_rollout, rollout, reward) in sequential steps with a rollout
role: a rebuilt rollout generates what it would have (pipelined, a batch redone after a rebuild is
sampled with the newer weights then sent)."""


def role_now(run, role: str) -> dict:
    return json.loads((run / "status.json").read_text())["roles"][role]


def kill_and_wait_rebuilt(run, role: str, proc) -> None:
    before = role_now(run, role)
    kill_dead(before["ranks"][0]["pid"])
    wait_until(lambda: proc.poll() is not None or role_now(run, role)["restarts"] == before["restarts"] + 1
               and role_now(run, role)["state"] == "alive", 300, f"{role} rebuilt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run twice, at the same time: through Ray's object store, uninterrupted; and by the
    collective (auto on CPU), its rollout killed after step 2, its actor after step 4, stopped
    (SIGUSR1) after step 5 and resumed."""
    tmp = tmp_path_factory.mktemp("weights")
    once, twice = tmp / "object_store", tmp / "collective"
    reference = start_local_training(once, ROLLOUT_APART.updated(rollout={"weight_transport": "object_store"}))
    proc = start_local_training(twice, ROLLOUT_APART)
    steps = lambda: len(read_metrics(twice / "metrics.jsonl")) if (twice / "metrics.jsonl").exists() else 0  # noqa: E731
    for role, after in (("rollout", 2), ("actor_rollout", 4)):
        wait_until(lambda: steps() >= after, 300, f"{after} steps")
        kill_and_wait_rebuilt(twice, role, proc)
    wait_until(lambda: steps() >= 5, 300, "5 steps")
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=300) == 3           # stopped at a committed checkpoint
    assert start_local_training(twice, ROLLOUT_APART).wait(timeout=600) == 0
    assert reference.wait(timeout=600) == 0
    return once, twice


def test_the_rollout_gets_its_weights_by_the_gloo_group_and_trains_as_through_the_object_store(runs):
    once, twice = runs
    routes = [e for e in read_events(once) if e["event"] == "weight_sync"]
    assert [(e["path"], e["backend"], e["receivers"]) for e in routes] == [("object_store", None, 1)]
    assert all(e["path"] == "collective" and e["backend"] == "gloo" for e in read_events(twice) if e["event"] == "weight_sync")
    assert all(set(e) == set(EVERY_EVENT) | set(EVENTS["weight_sync"].fields) for e in routes)
    assert comparable(read_metrics(twice / "metrics.jsonl")) == comparable(read_metrics(once / "metrics.jsonl"))


def test_the_group_is_formed_again_after_either_role_is_rebuilt_and_after_a_resume(runs):
    _, twice = runs
    said = [e["event"] if e["event"] != "rebuild" else f"rebuild {e['role']}" for e in read_events(twice)
            if e["event"] in ("weight_sync", "start", "rebuild", "stop", "finish")]
    # formed at the start, after the rollout's rebuild, during the actor's, and by the resumed run before it starts
    assert said == ["weight_sync", "start", "rebuild rollout", "weight_sync", "rebuild actor_rollout", "weight_sync",
                    "stop", "weight_sync", "start", "finish"], said
