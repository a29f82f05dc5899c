"""A role's half of a checkpoint: the registered save/load methods every role worker inherits.

The driver's half (hpcrl/checkpoint/commit.py) calls `save_checkpoint` on every role, then commits
the step with a manifest once all have succeeded."""
from __future__ import annotations

import threading
from functools import partial
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from hpcrl.checkpoint import parallel
from hpcrl.checkpoint.format import (from_arrays, read_role_file, rng_state, set_rng_state, snapshot, tensor_arrays,
                                     write_role_file)
from hpcrl.controller import Dispatch, register
from hpcrl.slurm.allocation import node_name


class Checkpointed:
    """Checkpoint methods every role shares. A role defines `checkpoint_state()` and
    `load_checkpoint_state(state)`; `frozen = True` roles are written once per run.

    Ranks of a data-parallel role hold the same parameters and optimizer state, so one file holds
    the role, with every rank's RNG state; any world size can load it (a rank without its own RNG
    entry keeps its seed). Rank 0 writes it, or, with parallel HDF5 (`checkpoint_io`), every rank
    writes its rows of it."""
    frozen = False

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, step: int, background: bool = False):
        together = self._writes_in_parallel()
        ranks = self._gather((rng_state(), node_name()), everywhere=together)
        role_state = self.checkpoint_state()     # on every rank: gathering a sharded engine's state is a collective
        if not (together or self.rank == 0):
            return None
        state = {"role": role_state, "rng": {r: rng for r, (rng, _) in enumerate(ranks)}}
        attrs = {"step": step, "role": self.role, "world_size": self.world_size}
        if together:
            parallel.stage(Path(path), state, attrs, self.rank, self.world_size)
            dist.barrier()                       # every share is staged: training may go on
            if self.rank != 0:
                return None
            write = partial(parallel.write_staged, Path(path), [node for _, node in ranks])
        else:
            write = partial(write_role_file, Path(path), snapshot(state) if background else state, attrs)
        if background:
            self._ckpt_writer().submit(write)
            return {"pending": True}
        return write()

    def _writes_in_parallel(self) -> bool:
        """Parallel HDF5 for a data-parallel role of several ranks, as `checkpoint_io` says."""
        mode = getattr(getattr(self, "cfg", None), "checkpoint_io", "auto")
        if mode == "serial" or self.world_size == 1:
            return False
        why = parallel.unavailable()
        if not getattr(getattr(self, "engine", None), "state_replicated", False):
            why = why or "its ranks hold shards of the state, not copies"
        if why and mode == "parallel":
            raise RuntimeError(f"train.checkpoint.io: parallel, but role {self.role} cannot: {why}")
        return why is None

    def _gather(self, mine, everywhere: bool) -> list | None:
        """Every rank's value, in rank order: on rank 0 (everywhere: on every rank)."""
        if not (dist.is_initialized() and self.world_size > 1):
            return [mine]
        if everywhere:
            out = [None] * self.world_size
            dist.all_gather_object(out, mine)
            return out
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, out, dst=0)
        return out

    @register(Dispatch.RANK_ZERO)
    def finish_checkpoint(self):
        """Wait for a background save; its file info (or None if there was none)."""
        return self._ckpt_writer().wait()

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        state, attrs = read_role_file(Path(path))
        self._load(state)
        return int(attrs["step"])

    @register(Dispatch.ONE_TO_ALL, keeps=True)
    def snapshot_state(self):
        """What this role's checkpoint file would hold, kept where a rebuilt process of the role takes
        it back (load_snapshot): rank 0's (the role's state and every rank's RNG) as the arrays of a
        role file, which Ray copies once into the object store of this node (numpy arrays, not
        pickled tensors); None on the other ranks. Returns its size in bytes."""
        ranks = self._gather(rng_state(), everywhere=False)
        role_state = self.checkpoint_state()     # on every rank: gathering a sharded engine's state is a collective
        if self.rank != 0:
            return 0, None
        skeleton, arrays = tensor_arrays({"role": role_state, "rng": dict(enumerate(ranks))})
        return sum(arr.nbytes for arr, _ in arrays.values()), (skeleton, arrays)

    @register(Dispatch.ONE_TO_ALL)
    def load_snapshot(self, kept) -> None:
        """The role's state and this rank's RNG from what snapshot_state kept."""
        self._load(from_arrays(*kept))

    def _load(self, state: dict) -> None:
        self.load_checkpoint_state(state["role"])
        if self.rank in state["rng"]:
            set_rng_state(state["rng"][self.rank])

    def checkpoint_state(self) -> dict:
        return {}

    def load_checkpoint_state(self, state: dict) -> None:
        pass

    def _ckpt_writer(self) -> AsyncWriter:
        if not hasattr(self, "_writer"):
            self._writer = AsyncWriter()
        return self._writer


class AsyncWriter:
    """Runs one write at a time on a background thread; `wait()` before the next save and before
    exit. What it writes must already be a copy (`snapshot`) or staged, as training goes on."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._result: dict | None = None
        self._error: BaseException | None = None

    def submit(self, write: Callable[[], dict]) -> None:
        self.wait()

        def run():
            try:
                self._result = write()
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                self._error = e
        self._thread = threading.Thread(target=run, name="hpcrl-ckpt", daemon=False)
        self._thread.start()

    def wait(self) -> dict | None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self._result
