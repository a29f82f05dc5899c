"""The batches a pipelined run had generated ahead of its last trained step, kept with that step.

With `pipeline: one_step_off` the rollout has already generated (and the reward and reference
roles have scored) the next batches when step k is checkpointed; they were sampled with older
weights than the checkpoint holds, so a resumed run cannot make them again and must train on
these. One file in the role files' format (hpcrl/checkpoint/format.py): each Batch's tensors and
numeric arrays as HDF5 datasets, its per-sample values and meta as JSON, every part checksummed.
Data only: reading a checkpoint never runs code from it (earlier versions of hpcrl pickled them into
inflight.pkl, which a resume now refuses: `upgrade_pickled` converts one, on the user's word).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hpcrl.checkpoint.format import read_role_file, write_role_file
from hpcrl.files import atomic_write_text

FILE = "inflight.h5"


class PickledInflight(RuntimeError):
    """A committed step keeps its batches generated ahead as a pickle, which hpcrl does not load."""


def write_inflight(path: Path, batches: list) -> dict:
    """Write the batches; returns what the manifest records of them."""
    state = {"batches": [{"tensors": b.tensors, "arrays": b.arrays, "meta": b.meta} for b in batches]}
    return {**write_role_file(Path(path), state, {"kind": "inflight"}), "batches": len(batches)}


def read_inflight(path: Path) -> list:
    """The batches; DamagedFile where a checksum fails."""
    from hpcrl.controller.batch import Batch

    state, _ = read_role_file(Path(path))
    return [Batch(b["tensors"], b["arrays"], b["meta"]) for b in state["batches"]]


def is_pickled(info: dict) -> bool:
    return info["path"].endswith(".pkl")


def refuse_pickled(path: Path, run_dir: Path) -> PickledInflight:
    return PickledInflight(
        f"{path} holds the batches this pipelined run had generated ahead as a pickle (an earlier hpcrl wrote "
        "it); hpcrl no longer loads pickles from a run directory, as whoever can write one could run code in the "
        f"driver. If you trust everyone who could write {path.parent.parent}, convert it once with "
        f"`hpcrl ckpt upgrade {run_dir} --trust-pickle`, then resume; or start the run again without --resume")


def pickled_problem(path: Path, info: dict) -> str | None:
    """None if an old pickled file is the one its manifest describes (size and SHA-256); else what is wrong."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        return f"{Path(path).name}: {e.strerror or e}"
    if len(data) != info["bytes"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
        return f"{Path(path).name}: {len(data)} bytes that do not match the manifest's checksum"
    return None


def upgrade_pickled(store, step: int) -> bool:
    """Convert step's inflight.pkl into inflight.h5 and its manifest to match (the manifest replaced
    atomically, the pickle removed after): what `hpcrl ckpt upgrade --trust-pickle` runs, where the
    user vouches for the file. False where the step has no pickle."""
    import pickle

    manifest = store.manifest(step)
    info = manifest.get("inflight")
    if not info or not is_pickled(info):
        return False
    old = store.path(info["path"], step)
    if problem := pickled_problem(old, info):
        raise ValueError(f"step {step}: {problem}; it cannot be converted")
    batches = pickle.loads(old.read_bytes())    # noqa: S301 - the user vouched for it (--trust-pickle)
    new = old.with_name(FILE)
    manifest["inflight"] = {"path": str(new.relative_to(store.root)), **write_inflight(new, batches)}
    atomic_write_text(store.step_dir(step) / "MANIFEST.json", json.dumps(manifest, indent=1))
    old.unlink()
    return True
