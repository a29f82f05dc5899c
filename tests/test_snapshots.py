"""Snapshots: when they are taken (hpcrl/checkpoint/cadence.py: pure logic, on a clock the test moves)
and whether the node's object store holds them (on a real Ray node)."""
import pytest

from hpcrl.checkpoint.cadence import SHARE, SnapshotCadence
from hpcrl.ppo.context import snapshots_spill


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_every_n_steps_and_never():
    every3, never = SnapshotCadence(3), SnapshotCadence(0)
    assert [s for s in range(1, 10) if every3.due(s)] == [3, 6, 9]
    assert not any(never.due(s) for s in range(1, 10))


def test_auto_keeps_the_snapshots_under_their_share_of_the_wall_time():
    clock = Clock()
    cadence = SnapshotCadence("auto", clock)
    assert cadence.due(1)                      # nothing measured yet: the first step boundary
    cadence.took(0.86)                         # the GPU run's snapshot: 0.86 s
    wait = 0.86 / SHARE                        # 17.2 s of training before the next
    clock.now += wait - 0.01
    assert not cadence.due(2)
    clock.now += 0.02
    assert cadence.due(57)
    # 0.30 s steps (the GPU run's): one snapshot every ~57 steps, ~5% of the wall time
    steps = 0
    cadence.took(0.86)
    while not cadence.due(steps):
        clock.now += 0.30
        steps += 1
    assert steps == 58 and 0.86 / (0.86 + steps * 0.30) < SHARE


class Placed:
    """A role's ranks where describe() says (the one thing snapshots_spill reads of a WorkerGroup)."""

    def __init__(self, ip: str):
        self.ip = ip

    def describe(self) -> dict:
        return {"ranks": [{"rank": 0, "node_ip": self.ip}]}


@pytest.fixture
def ray_node(tmp_path):
    """A Ray node of this process's cluster: an earlier test's, or one of its own (whatever its
    object store's size: the test sizes the snapshots against it)."""
    import ray

    from hpcrl.raycluster.session import start_local

    mine = not ray.is_initialized()
    if mine:        # as the other tests' local nodes start: with the run's token, as in a job
        start_local(["a"], run_dir=tmp_path, num_cpus=1)
    try:
        yield next(n for n in ray.nodes() if n["Alive"])
    finally:
        if mine:
            ray.shutdown()


def test_snapshots_that_do_not_fit_twice_in_the_object_store_are_named(ray_node):
    ip, store = ray_node["NodeManagerAddress"], ray_node["Resources"]["object_store_memory"]
    groups = {"actor_rollout": Placed(ip), "critic": Placed(ip), "elsewhere": Placed("192.0.2.1")}
    fits = int(store // 2) - 1
    assert snapshots_spill(groups, {"actor_rollout": fits}) == []
    # two roles on one node: their snapshots add up; a node Ray does not know is not judged
    warnings = snapshots_spill(groups, {"actor_rollout": fits, "critic": 2, "elsewhere": 10 * int(store)})
    assert len(warnings) == 1, warnings
    assert "actor_rollout, critic" in warnings[0] and ip in warnings[0] and "mem" in warnings[0], warnings[0]
