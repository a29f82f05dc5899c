"""A role's process killed while the run trains: the rebuilt role takes back its state of the last
step boundary (a snapshot) and the state-changing calls since are made again, so the run ends
bitwise where an uninterrupted one ends. Real processes, real SIGKILLs, a local Ray."""
from __future__ import annotations

import json
import random
import time

import h5py
import numpy as np
from conftest import comparable, kill_dead, run_local, start_local_training, wait_until

from hpcrl.observe.metrics import read_metrics
from hpcrl.ppo.config import TrainConfig

STEPS = 16


def role_tensors(path) -> dict[str, np.ndarray]:
    """A role file's tensors (its state; not its attributes, which hold the time it was written)."""
    out = {}
    with h5py.File(path) as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


def test_roles_killed_at_random_moments_end_bitwise_as_an_uninterrupted_run(tmp_path):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    cfg = TrainConfig(total_steps=STEPS, save_every=0, restart_limit=50, progress=False)
    whole = run_local(tmp_path / "whole", cfg)

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
        a = role_tensors(tmp_path / "whole" / "ckpt" / f"step_{STEPS:08d}" / f"{role}.h5")
        b = role_tensors(run / "ckpt" / f"step_{STEPS:08d}" / f"{role}.h5")
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), (role, seed, kills)
