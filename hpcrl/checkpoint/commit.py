"""The driver's half of a checkpoint: every role writes its own file (hpcrl/checkpoint/role.py),
then the step is committed with a manifest once all have succeeded; resume loads every role from
the newest step that verifies. Between checkpoints, snapshots: each training role's state at a step
boundary, kept in host memory (the object store of its rank 0's node), for a rebuilt role to take
back: checkpoints answer losing the job, snapshots losing a process."""
from __future__ import annotations

import errno
import logging
import os
import time

from ray.exceptions import ObjectLostError, RayTaskError

from hpcrl.checkpoint.format import DamagedFile
from hpcrl.checkpoint.store import CheckpointStore
from hpcrl.controller import RoleStateLost
from hpcrl.files import STORAGE_ERRNOS, StorageError, free_bytes

log = logging.getLogger("hpcrl.checkpoint")


def every_result(futures: dict) -> dict:
    """Each future's result (key -> result), once every one has ended; then the first error, if any.
    A role whose write fails removes its own half-written file, but only while its process lives:
    a run stopped at the first failure (a full disk refuses every role) would end the others mid-write."""
    results, first = {}, None
    for key, f in futures.items():
        try:
            results[key] = f.result()
        except Exception as e:
            first = first or e
    if first is not None:
        raise first
    return results


class RoleCheckpoints:
    """Saves, commits and resumes the roles of one run (`groups`: role -> WorkerGroup); frozen roles
    are written once. A rebuilt role takes back the newer of its snapshot and its file of the newest
    committed step; its WorkerGroup then makes again the state-changing calls made since."""

    def __init__(self, store: CheckpointStore, groups: dict, background: bool,
                 on_commit=lambda step, nbytes, seconds: None):
        self.store, self.groups, self.background, self.on_commit = store, groups, background, on_commit
        self.frozen = {r: wg.worker_cls.frozen for r, wg in groups.items()}
        self.written: dict[str, dict] = {}          # frozen role -> its one file
        self.pending: tuple | None = None           # a background save not committed yet
        self.snapshots: dict[str, tuple[int, object]] = {}   # role -> (step, its rank 0's kept state)
        self.sizes: dict[str, int] = {}             # role -> bytes of its state, as last written or kept
        for role, wg in groups.items():
            wg.on_restore(lambda role=role: self.restore_role(role))

    def save(self, step: int, driver_state: dict, background: bool = False, inflight: list = ()) -> None:
        """inflight: the batches a pipelined run generated ahead of `step` (hpcrl/checkpoint/inflight.py)."""
        self.finish()
        t0 = time.perf_counter()
        held = {r: wg.calls_issued() for r, wg in self.groups.items()}     # what the files will hold
        writers = [r for r in self.groups if not (self.frozen[r] and r in self.written)]
        self._refuse_if_it_cannot_fit(step, writers)
        ahead = self.store.write_inflight(step, list(inflight))
        background = background and self.background
        files, futures = {}, {}
        for role, wg in self.groups.items():
            if role not in writers:
                files[role] = self.written[role]
                continue
            path = self.store.role_path(step, role)
            futures[role] = (path, wg.save_checkpoint.future(str(path), step, background and not self.frozen[role]))
        written = every_result({role: fut for role, (path, fut) in futures.items()})
        for role, (path, fut) in futures.items():
            files[role] = {"path": str(path.relative_to(self.store.root)), **written[role][0]}
            if self.frozen[role]:
                self.written[role] = files[role]
        self.pending = (step, files, driver_state, ahead, t0, set(futures), held)
        if not background:
            self.finish()

    def finish(self) -> None:
        """Wait for background writes, then commit the step."""
        if self.pending is None:
            return
        step, files, driver_state, ahead, t0, fresh, held = self.pending
        waiting = [role for role, info in files.items() if info.pop("pending", False)]
        for role, info in every_result({r: self.groups[r].finish_checkpoint.future() for r in waiting}).items():
            files[role].update(info)
        self.store.commit(step, files, driver_state, ahead)
        self.pending = None
        for role, upto in held.items():
            self.groups[role].forget_calls(upto)
        self.sizes.update({r: files[r]["bytes"] for r in fresh})
        self.on_commit(step, sum(files[r]["bytes"] for r in fresh), time.perf_counter() - t0)

    def take_snapshots(self, step: int) -> dict[str, int]:
        """Every role that trains keeps its state of `step` in host memory (a snapshot replaces the
        one before it, once made); role -> the bytes kept. Waited for: issued and left to run beside the next
        step, it would hold two snapshots in the object store through every step, not for an instant."""
        roles = [r for r in self.groups if not self.frozen[r]]
        held = {r: self.groups[r].calls_issued() for r in roles}
        futures = {r: self.groups[r].snapshot_state.future() for r in roles}
        for role, f in futures.items():
            self.sizes[role] = sum(f.result())      # the sizes: the states stay where they were made
            self.snapshots[role] = (step, f.kept[0])
            self.groups[role].forget_calls(held[role])
        return {r: self.sizes[r] for r in roles}

    def resume(self) -> tuple[int, dict, int, list] | None:
        """Load every role from the newest good step: (step, the driver's state, bytes read, the
        batches generated ahead of it), or None. The driver reads manifests and the batches generated
        ahead only: each role reads its own file on its own node, all at once, checking every checksum
        as it reads; a step whose file is found damaged is passed over for the one before it."""
        for step in reversed(self.store.committed_steps()):
            problems = self.store.check(step)
            manifest = None if problems else self.store.manifest(step)
            inflight = []
            if not problems:
                try:
                    inflight = self.store.read_inflight(manifest)
                except DamagedFile as e:
                    problems = [f"in-flight batches: {e}"]
            problems = problems or self._load(manifest)
            if not problems:
                self.written = {r: info for r, info in manifest["roles"].items() if self.frozen.get(r)}
                return (step, manifest["driver"], sum(info["bytes"] for r, info in manifest["roles"].items()
                                                      if r in self.groups), inflight)
            log.warning("checkpoint step %d is unusable (%s); trying an older one", step, "; ".join(problems))
        return None

    def _load(self, manifest: dict) -> list[str]:
        """Every role of the run loads its file of `manifest`; what the roles found damaged."""
        futures = {r: self.groups[r].load_checkpoint.future(str(self.store.path(info["path"], manifest["step"])))
                   for r, info in manifest["roles"].items() if r in self.groups}
        damaged = []
        for role, f in futures.items():
            try:
                f.result()
            except RayTaskError as e:
                if not isinstance(e.cause, DamagedFile):
                    raise
                damaged.append(f"{role}: {e.cause}")
        return damaged

    def _refuse_if_it_cannot_fit(self, step: int, roles: list[str]) -> None:
        """The roles write their files at once, each to the same filesystem: where the free space
        cannot take them all (each as large as it was last written or kept), none begins (each role
        also checks its own file, which is all there is before the first save or snapshot)."""
        need = sum(self.sizes.get(r, 0) for r in roles)
        free = free_bytes(self.store.root)
        if need and free is not None and free < need + 2**20 * len(roles):
            raise StorageError(errno.ENOSPC, f"{STORAGE_ERRNOS[errno.ENOSPC]} ({os.strerror(errno.ENOSPC)}): step "
                               f"{step}'s files of {', '.join(roles)} need about {need / 1e6:.1f} MB together, "
                               f"{free / 1e6:.1f} MB are free", str(self.store.step_dir(step)))

    def restore_role(self, role: str) -> None:
        """After a role was rebuilt: the newer of its snapshot and its file of the newest committed
        step (neither before the first: the role's __init__ state). A snapshot lost with its node
        stops the run (RoleStateLost): every role then resumes from the newest committed step."""
        steps = self.store.committed_steps()
        info = self.store.manifest(steps[-1])["roles"].get(role) if steps else None
        snap = self.snapshots.get(role)
        if snap and (info is None or snap[0] >= steps[-1]):
            try:
                self.groups[role].load_snapshot(snap[1])
            except ObjectLostError as e:
                back = f"committed step {steps[-1]}" if steps else "the start"
                raise RoleStateLost(f"role {role} was rebuilt, but its state of step {snap[0]} was lost with the "
                                    f"node that held it ({type(e).__name__}); every role goes back to {back}") from None
        elif info:
            self.groups[role].load_checkpoint(str(self.store.path(info["path"], steps[-1])))
