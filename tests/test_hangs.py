"""Every wait bounded: a rank that does not answer a call by its deadline is hung; its stacks are
recorded and it takes a dead process's path (rebuilt with its state, the call made again), up to the
restart limit; a stop request is acted on while a call hangs. Real processes on a local Ray; the
deadline rule itself is pure logic, checked by hand."""
import os
import sys
import threading
import time

import numpy as np
import pytest
import torch

from hpcrl.controller import (
    CallAbandoned,
    DeadlinePolicy,
    Dispatch,
    ResourcePool,
    RoleHung,
    Worker,
    WorkerGroup,
    register,
)
from hpcrl.controller.batch import Batch
from hpcrl.controller.deadline import CallDeadlines
from hpcrl.stop import StopRequest


def test_deadline_is_learned_from_the_slowest_recent_warm_call():
    d = CallDeadlines(DeadlinePolicy(floor_s=10, factor=4, first_s=100, window=3, fixed={"critic.save": 7, "load": 9}))
    assert d.deadline("actor.update") == 100                 # nothing known: the first call's allowance
    assert d.took("actor.update", 50.0) is None              # cold (compile, warm-up): not learned from
    assert d.deadline("actor.update") == 100                 # warm now, but no warm call timed yet
    assert d.took("actor.update", 1.0) == 10                 # 4 × 1 s is under the floor
    assert d.took("actor.update", 2.0) is None and d.deadline("actor.update") == 10   # 8 s: floor, unchanged
    assert d.took("actor.update", 6.0) == 24                 # 4 × 6 s, said: more than twice the 10 s said
    assert d.took("actor.update", 1.0) is None and d.took("actor.update", 1.0) is None    # [6, 1, 1]: still 24
    assert d.took("actor.update", 1.0) == 10                 # the 6 s call left the window of 3: said again
    assert d.stop_grace("actor.update") == 10.0 and d.stop_grace("actor.other") == 30.0   # 3 × 1 s is under 10 s
    d.took("actor.update", 4.0)
    assert d.stop_grace("actor.update") == 12.0              # 3 × the slowest recent, 4 s
    d.new_processes()                                        # rebuilt: the next call is cold again
    assert d.deadline("actor.update") == 100 and d.stop_grace("actor.update") == 30.0
    d.took("actor.update", 500.0)
    assert d.deadline("actor.update") == 16                  # 4 × the 4 s call: the cold one did not count
    assert d.deadline("critic.save") == 7 and d.deadline("ref.load") == 9 and d.deadline("critic.load") == 9
    big = CallDeadlines(DeadlinePolicy(floor_s=10, factor=4, first_s=100))
    big.took("x.y", 1), big.took("x.y", 40)
    big.new_processes()
    assert big.deadline("x.y") == 160                        # a cold call never gets less than what is learned


def stuck_forever():
    while True:
        time.sleep(0.05)


class Summer(Worker):
    """State: a running total per rank, changed by `add` (a state-changing call, replayed after a rebuild)."""

    def __init__(self):
        self.total = 0

    @register(Dispatch.ONE_TO_ALL, changes_state=True)
    def add(self, v, hang_once: str = "", hang_always: bool = False):
        if hang_always or (hang_once and self.rank == 1 and not os.path.exists(hang_once)):
            if hang_once:
                open(hang_once, "w").close()
            stuck_forever()
        self.total += v * (self.rank + 1)
        return self.total


    @register(Dispatch.ONE_TO_ALL, changes_state=True)
    def absorb(self, batch):
        self.total += len(batch)
        return self.total


FAST = DeadlinePolicy(floor_s=1.0, factor=3.0, first_s=60.0)


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    import ray
    from ray import cloudpickle

    from hpcrl.raycluster.session import start_local

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not importable in the workers
    run = tmp_path_factory.mktemp("run")
    start_local(["a"], run_dir=run, num_cpus=4)
    yield run
    ray.shutdown()


def test_a_rank_that_hangs_once_is_rebuilt_with_its_state_and_the_call_made_again(ray_local, tmp_path):
    hangs = []
    a = WorkerGroup(ResourcePool.for_role("a", processes_per_node=2), Summer, log_dir=tmp_path / "logs", deadlines=FAST)
    a.on_hang(hangs.append)
    try:
        assert a.add(1) == [1, 2] and a.add(2) == [3, 6]       # cold, then warm: deadline max(1 s, 3 × a few ms)
        pids = a.pids()
        t0 = time.monotonic()
        assert a.add(3, hang_once=str(tmp_path / "hung")) == [6, 12]   # 1+2+3 times rank+1: as if uninterrupted
        assert time.monotonic() - t0 < 40         # the deadline (1 s) plus stacks and a rebuild, not the first_s 60 s
        assert a.add(4) == [10, 20] and set(a.pids()).isdisjoint(pids)
        info = a.describe()
        assert info["restarts"] == 1 and info["last_hang"]["call"] == "a.add" and info["last_hang"]["ranks"] == [1]
        assert "stuck_forever" in info["last_hang"]["stacks"]["1"], info["last_hang"]     # rank 0 had answered
        assert hangs == [info["last_hang"]]
        log = (tmp_path / "logs" / "a" / "rank1.log").read_text()
        assert "a.add missed its deadline of 1 s" in log and "in stuck_forever" in log, log[-2000:]
    finally:
        a.shutdown()


def test_a_hang_past_the_restart_limit_stops_naming_role_call_and_ranks(ray_local, tmp_path):
    a = WorkerGroup(ResourcePool.for_role("a", processes_per_node=2), Summer, restart_limit=1,
                    deadlines=DeadlinePolicy(first_s=60, fixed={"add": 2.0}))   # also for the cold call after a rebuild
    try:
        a.add(1), a.add(1)
        with pytest.raises(RoleHung, match=r"role a: ranks \[0, 1\] did not answer a.add within its deadline of 2 s.*"
                                           r"restart_limit=1") as e:
            a.add(1, hang_always=True)
        assert (e.value.role, e.value.method, e.value.ranks) == ("a", "a.add", [0, 1]) and a.busy()
        assert a.describe()["restarts"] == 1       # once rebuilt and called again, then given up
    finally:
        a.shutdown()


def test_a_stop_while_a_call_hangs_gives_it_up_and_the_group_goes_back_to_the_boundary(ray_local):
    a = WorkerGroup(ResourcePool.for_role("a", processes_per_node=2), Summer,
                    deadlines=DeadlinePolicy(floor_s=600, first_s=600))
    stop = StopRequest()
    a.stop_when(stop.check)
    try:
        a.add(1), a.add(1)
        boundary = {a: a.calls_issued()}
        timer = threading.Timer(1.0, stop.request, ("SIGUSR1",))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(CallAbandoned, match=r"SIGUSR1: a.add of ranks \[0, 1\] had run"):
            a.add(5, hang_always=True)
        assert time.monotonic() - t0 < 30 and a.busy()     # not the 600 s deadline
        a.stop_when(lambda: None)
        a.roll_back(boundary)                               # the state the last step boundary had
        assert not a.busy() and a.add(0) == [2, 4]
    finally:
        a.shutdown()


def test_the_replay_log_counts_the_bytes_of_the_batches_it_keeps(ray_local):
    """What train.checkpoint.replay_limit bounds: the Batch arguments of the state-changing calls kept
    for a rebuild, until a snapshot or checkpoint holds their effect."""
    a = WorkerGroup(ResourcePool.for_role("a"), Summer)
    try:
        batch = Batch({"ids": torch.zeros(100, 6, dtype=torch.int64), "mask": torch.ones(100, 6)}, {"group": np.arange(100)})
        a.absorb(batch), a.add(1), a.absorb(batch.index(torch.arange(10)))
        per_sample = 6 * 8 + 6 * 4 + 8          # int64 ids, float32 mask, int64 group
        assert a.replay_size() == (3, 110 * per_sample)
        a.forget_calls(a.calls_issued())
        assert a.replay_size() == (0, 0)
    finally:
        a.shutdown()
