"""The batches a pipelined run had generated ahead of its last trained step, kept with that step.

With `pipeline: one_step_off` the rollout has already generated (and the reward and reference
roles have scored) the next batches when step k is checkpointed; they were sampled with older
weights than the checkpoint holds, so a resumed run cannot make them again and must train on
these. Pickled Batches (numpy buffers), written atomically, checked by size and SHA-256 on resume.
"""
from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

from hpcrl.files import atomic_write_text


def write_inflight(path: Path, batches: list) -> dict:
    """Write the batches; returns what the manifest records of them."""
    data = pickle.dumps(list(batches), protocol=5)
    atomic_write_text(path, data)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "batches": len(batches)}


def inflight_problem(path: Path, info: dict) -> str | None:
    """None if the file is the one the manifest describes; else what is wrong."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        return f"{Path(path).name}: {e.strerror or e}"
    if len(data) != info["bytes"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
        return f"{Path(path).name}: {len(data)} bytes that do not match the manifest's checksum"
    return None


def read_inflight(path: Path) -> list:
    return pickle.loads(Path(path).read_bytes())
